"""`PromptIndex`: finished sessions by their last prompt, to find a conversation that goes on.

A request without a session id continues the FINISHED session of its owner whose last prompt
is the longest prefix of its own (`AgentEngine.find_session`). The index keys each such
session by its owner and a hash chained over the full `BLOCK`-token blocks of its prompt, so a
lookup hashes the new prompt's blocks (no more of them than the owner's longest indexed
prompt has) and checks only the sessions whose hashed blocks all match: its cost does not
grow with the sessions of other owners, nor with those of its own owner that share no prefix
with it. A candidate is checked token by token before it is returned (a hash collision never
names a wrong session).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence

BLOCK = 64  # tokens per hashed block


class PromptIndex:
    """Sessions by (owner, blocks of their prompt); see the module docstring."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[Hashable, int, int], dict[str, None]] = {}
        self._keys: dict[str, tuple[Hashable, int, int]] = {}  # session -> its bucket
        self._blocks: dict[Hashable, Counter[int]] = {}  # owner -> its sessions' block counts

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._keys

    def add(self, session_id: str, owner: Hashable, tokens: Sequence[int], length: int) -> None:
        """Index ``session_id`` of ``owner`` under its prompt ``tokens[:length]`` (replacing
        its earlier entry)."""
        self.remove(session_id)
        blocks = length // BLOCK
        key = (owner, blocks, _chain(tokens, blocks)[-1])
        self._buckets.setdefault(key, {})[session_id] = None
        self._keys[session_id] = key
        self._blocks.setdefault(owner, Counter())[blocks] += 1

    def remove(self, session_id: str) -> None:
        """Drop ``session_id`` (no-op if it is not indexed)."""
        key = self._keys.pop(session_id, None)
        if key is None:
            return
        bucket = self._buckets[key]
        del bucket[session_id]
        if not bucket:
            del self._buckets[key]
        counts = self._blocks[key[0]]
        counts[key[1]] -= 1
        if not counts[key[1]]:
            del counts[key[1]]
            if not counts:
                del self._blocks[key[0]]

    def find(self, owner: Hashable, prompt: Sequence[int],
             match: Callable[[str], int]) -> str | None:
        """The indexed session of ``owner`` for which ``match`` (its prompt's length if that
        prompt is a prefix of ``prompt``, else -1) is greatest, or None."""
        counts = self._blocks.get(owner)
        if not counts:
            return None
        hashes = _chain(prompt, min(len(prompt) // BLOCK, max(counts)))
        for blocks in range(len(hashes) - 1, -1, -1):
            if blocks not in counts:
                continue
            bucket = self._buckets.get((owner, blocks, hashes[blocks]), {})
            best, best_len = None, 0
            for session_id in bucket:
                n = match(session_id)
                if n > best_len:
                    best, best_len = session_id, n
            if best is not None:
                return best
        return None


def _chain(tokens: Sequence[int], blocks: int) -> list[int]:
    """Hashes of the first 0..``blocks`` full blocks of ``tokens``, each chained over the ones
    before it."""
    out = [0]
    for i in range(blocks):
        out.append(hash((out[-1], tuple(tokens[i * BLOCK:(i + 1) * BLOCK]))))
    return out
