"""Incremental encoding of rendered chat prompts.

An agent's next request repeats the conversation so far: encoding it whole costs ~1 µs per
token on the server's CPU (tens of milliseconds at 32K tokens, before the engine sees it).
Hugging Face fast tokenizers split text at added tokens (``<|im_start|>``, ...) before the
model runs, so ``ids(a + b) == ids(a) + ids(b)`` whenever ``b`` starts with an added token.
`PromptEncoder` keeps the ids of recent prompts with the positions of their added tokens; a new
prompt reuses the ids of the longest text prefix it shares with one of them, cut back to an
added token that both hold at the same place, and encodes only the rest.

Added tokens that strip neighbouring whitespace or are normalised would break the identity:
with any such token the encoder encodes whole (`PromptEncoder.incremental` is False).
"""

from __future__ import annotations

import bisect
import re
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass
class _Encoded:
    text: str
    ids: array  # token ids (int64)
    cuts: list[tuple[int, int]]  # (char offset, token index) of each added token, in order


class PromptEncoder:
    """Token ids of prompt texts (``add_special_tokens=False``), reusing recent prompts' ids.

    Not thread-safe: one thread owns it (and its tokenizer): the server's tokenizing thread, the
    agent layer's engine thread.

    Args:
        tokenizer: a Hugging Face tokenizer; incremental only for a fast one whose added
            tokens neither strip whitespace nor are normalised.
        capacity: recent prompts kept (the oldest dropped first).
    """

    def __init__(self, tokenizer: Any, capacity: int = 16) -> None:
        self._tokenizer = tokenizer
        self._fast = getattr(tokenizer, "_tokenizer", None)
        added = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
        plain = all(not (t.lstrip or t.rstrip or t.normalized or t.single_word) for t in added)
        self._pattern = (re.compile("|".join(re.escape(t.content) for t in
                                             sorted(added, key=lambda t: -len(t.content))))
                         if self._fast is not None and added and plain else None)
        self._recent: deque[_Encoded] = deque(maxlen=capacity)
        self.reused_tokens = 0  # ids taken from earlier prompts, over the encoder's life
        self.encoded_tokens = 0  # ids produced by the tokenizer

    @property
    def incremental(self) -> bool:
        """Whether prompts can reuse earlier prompts' ids (see the module docstring)."""
        return self._pattern is not None

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, equal to ``tokenizer.encode(text, add_special_tokens=False)``."""
        if self._pattern is None:
            ids = list(self._tokenizer.encode(text, add_special_tokens=False))
            self.encoded_tokens += len(ids)
            return ids
        base, char, tok = self._longest_prefix(text)
        head = base.ids[:tok] if base is not None else array("q")
        cuts = base.cuts[:bisect.bisect_left(base.cuts, (char, -1))] if base is not None else []
        tail_ids, tail_cuts = self._encode_part(text, char, tok)
        entry = _Encoded(text, head + tail_ids, cuts + tail_cuts)
        self._recent.append(entry)
        self.reused_tokens += tok
        self.encoded_tokens += len(tail_ids)
        return entry.ids.tolist()

    def _longest_prefix(self, text: str) -> tuple[_Encoded | None, int, int]:
        """The recent prompt sharing the longest prefix with ``text`` that ends where both hold
        an added token (each cut of an entry is one), that place and its token index."""
        assert self._pattern is not None
        best: tuple[_Encoded | None, int, int] = (None, 0, 0)
        for entry in reversed(self._recent):
            prev = 0
            for char, tok in entry.cuts:
                if not text.startswith(entry.text[prev:char], prev):
                    break
                if self._pattern.match(text, char) is None:  # no added token here in text
                    break
                if char > best[1]:
                    best = (entry, char, tok)
                prev = char
        return best

    def _encode_part(self, text: str, start: int, tok0: int) -> tuple[array, list[tuple[int,
                                                                                   int]]]:
        """Ids of ``text[start:]`` and its added tokens' (char, token index) in ``text``."""
        assert self._pattern is not None and self._fast is not None
        part = text[start:]
        enc = self._fast.encode(part, add_special_tokens=False)
        starts = [s for s, _ in enc.offsets]
        cuts = []
        for m in self._pattern.finditer(part):
            i = bisect.bisect_left(starts, m.start())
            if i < len(starts) and starts[i] == m.start():  # a token starts there: the added one
                cuts.append((start + m.start(), tok0 + i))
        return array("q", enc.ids), cuts
