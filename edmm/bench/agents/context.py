"""A replayed session's context as token ids, with where its reasoning sits.

The in-process replay builds each next prompt from the last one and the turn's output
(`Context`): the result appended or inserted, the context cut (``keep_tokens``), part of the
output dropped (the first generator's ``reasoning_stripped``), the reasoning since the last
user message dropped at a user message. It keeps the spans of that reasoning through every
cut and insertion, and `common_prefix` tells how much of the new prompt the old context
already held (what an unbounded prefix cache serves).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

Span = tuple[int, int]  # [start, end) positions in the context


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (slices compared in C: a binary
    search over prefix lengths, not a Python loop over tokens)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class Context:
    """Token ids of a session's context and the spans of its reasoning (since the last user
    message), kept in order and disjoint."""

    ids: list[int]
    reasoning: list[Span] = field(default_factory=list)

    def add_output(self, output: Sequence[int], reasoning_tokens: int) -> None:
        """The turn's output appended; its first ``reasoning_tokens`` are reasoning."""
        start = len(self.ids)
        self.ids.extend(output)
        if reasoning_tokens:
            self.reasoning.append((start, start + min(reasoning_tokens, len(output))))

    def cut(self, start: int, end: int) -> None:
        """Remove positions ``[start, end)``; spans after them move back."""
        start, end = max(0, start), min(end, len(self.ids))
        if end <= start:
            return
        del self.ids[start:end]
        n = end - start
        spans = []
        for s, e in self.reasoning:
            s2 = s if s < start else max(start, s - n)
            e2 = e if e <= start else max(start, e - n)
            if e2 > s2:
                spans.append((s2, e2))
        self.reasoning = spans

    def keep(self, n: int) -> None:
        """Keep the first ``n`` tokens only."""
        self.cut(n, len(self.ids))

    def insert(self, position: int, tokens: Sequence[int]) -> None:
        """Insert ``tokens`` at ``position``; a span across it is split around them."""
        self.ids[position:position] = tokens
        n, spans = len(tokens), []
        for s, e in self.reasoning:
            if e <= position:
                spans.append((s, e))
            elif s >= position:
                spans.append((s + n, e + n))
            else:
                spans += [(s, position), (position + n, e + n)]
        self.reasoning = spans

    def drop_reasoning(self) -> None:
        """Remove every reasoning span (a user message: the template drops it)."""
        for s, e in reversed(self.reasoning):
            del self.ids[s:e]
        self.reasoning = []


__all__ = ["Context", "Span", "common_prefix"]
