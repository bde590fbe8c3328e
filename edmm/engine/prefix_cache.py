"""Prefix reuse on the KV arena: slots that hold KV of known tokens are sources of shared pages.

Sources are arena slots with the tokens whose KV they hold:

- **entries**: slots of finished or preempted sequences, kept instead of freed. The cache owns
  them: LRU order, freed (`KVArena.free`) when `evict_one` is asked to make room.
- **live sources**: slots of running sequences, tracked as their KV grows (`track`). The
  scheduler owns them; the cache only reads them, and a branch never disturbs its source.

A new sequence looks up the source with the longest common token prefix and gets
`KVArena.branch` of it: the same physical pages for the full pages of that prefix, one copied
boundary page, no recompute. When the sequence extends an entry entirely (the next turn of an
agent loop, a preempted sequence resuming), it adopts the entry's slot instead: no copy at all.

Lookup is O(prompt length): every full block of ``block_size`` tokens of a source is indexed by
a hash chained over the blocks before it (as in vLLM), so walking the prompt's block hashes finds
the sources sharing the most full blocks; the match is then extended token by token inside the
next block (at most ``block_size - 1`` comparisons per candidate) and verified against the
source's tokens, so a hash collision can never reuse wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from edmm.memory import KVArena, KVMemoryError

_CHAIN_SEED = 0x45444D4D  # "EDMM": the hash chain's value before the first block


@dataclass(frozen=True)
class PrefixHit:
    """A slot whose first ``num_tokens`` tokens already have KV: branched from ``source``, or
    ``source`` itself when an entry was adopted."""

    slot: int
    num_tokens: int
    source: int


@dataclass
class _Source:
    tokens: list[int]  # KV holds tokens[:num_tokens]; a live source's list may be longer
    num_tokens: int
    hashes: list[int] = field(default_factory=list)  # chained hash of each full block


class PrefixCache:
    """Index of reusable KV prefixes over the arena's slots; see the module docstring.

    With ``enabled=False`` nothing is indexed and `release` frees slots at once, so the
    scheduler runs one code path either way.
    """

    def __init__(self, arena: KVArena, block_size: int = 16, enabled: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.arena = arena
        self.block_size = block_size
        self.enabled = enabled
        self._sources: dict[int, _Source] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # entries, least recently used first
        self._index: dict[int, dict[int, None]] = {}  # block hash -> slots holding that chain

    @property
    def num_entries(self) -> int:
        """Slots held by the cache (evictable)."""
        return len(self._lru)

    def entry_slots(self) -> list[int]:
        """Slots held by the cache, least recently used first."""
        return list(self._lru)

    # ------------------------------------------------------------------ sources
    def track(self, slot: int, tokens: list[int], num_tokens: int) -> None:
        """Record that live ``slot`` holds KV of ``tokens[:num_tokens]`` (``tokens`` may grow
        later, but its first ``num_tokens`` never change while the slot is live)."""
        if not self.enabled:
            return
        src = self._sources.get(slot)
        if src is None:
            src = self._sources[slot] = _Source(tokens, 0)
        elif slot in self._lru:
            raise KVMemoryError(f"slot {slot} is a cache entry, not a live source")
        src.tokens = tokens
        self._extend(slot, src, num_tokens)

    def release(self, slot: int, tokens: list[int], num_tokens: int) -> None:
        """The owner is done with ``slot``, whose KV holds ``tokens[:num_tokens]``: keep it as
        the most recently used entry (caching on, ``num_tokens > 0``) or free it."""
        if slot in self._lru:
            raise KVMemoryError(f"slot {slot} is already a cache entry")
        if not self.enabled or num_tokens == 0:
            self._unindex(slot)
            self.arena.free(slot)
            return
        src = self._sources.get(slot) or _Source([], 0)
        self._sources[slot] = src
        src.tokens = tokens[:num_tokens]  # a private copy: the sequence may go on growing
        self._extend(slot, src, num_tokens)
        self._lru[slot] = None

    # ------------------------------------------------------------------ lookup
    def lookup(self, tokens: list[int], max_tokens: int) -> tuple[int, int] | None:
        """``(source slot, n)`` of the longest prefix ``tokens[:n]`` (``n <= max_tokens``)
        whose KV some source holds, at least one full block long; None if there is none."""
        if not self.enabled:
            return None
        limit = min(len(tokens), max_tokens)
        candidates: dict[int, None] = {}
        matched = 0  # full blocks matched
        prev = _CHAIN_SEED
        bs = self.block_size
        for i in range(limit // bs):
            h = _chain(prev, tokens[i * bs:(i + 1) * bs])
            found = self._index.get(h)
            if not found:
                break
            candidates, prev, matched = found, h, i + 1
        best: tuple[int, int] | None = None
        for slot in candidates:
            n = self._extend_match(self._sources[slot], tokens, matched * bs, limit)
            if best is None or n > best[1]:
                best = (slot, n)
        if best is None or self._sources[best[0]].tokens[: matched * bs] != tokens[: matched * bs]:
            return None  # no block matched, or a hash collision
        return best

    def acquire(self, tokens: list[int], max_tokens: int) -> PrefixHit | None:
        """A slot for a new sequence whose first ``num_tokens`` tokens already have KV: the
        longest cached prefix of ``tokens`` (see `lookup`), or None.

        An entry that the new sequence extends entirely is adopted: its slot becomes the
        sequence's (no copy, no new slot) and stays indexed as a live source. Otherwise the
        slot is `KVArena.branch` of the source: shared full pages, one copied boundary page.
        Raises `NoFreeSlotError` / `PoolExhaustedError` from the branch (nothing changed);
        the caller may `evict_one` and retry.
        """
        found = self.lookup(tokens, max_tokens)
        if found is None:
            return None
        source, n = found
        if source in self._lru and n == self._sources[source].num_tokens:
            del self._lru[source]
            return PrefixHit(source, n, source)
        slot = self.arena.branch(source, n)
        if source in self._lru:
            self._lru.move_to_end(source)
        return PrefixHit(slot, n, source)

    # ------------------------------------------------------------------ eviction
    def evict_one(self) -> bool:
        """Free the least recently used entry; False if the cache holds none."""
        if not self._lru:
            return False
        slot, _ = self._lru.popitem(last=False)
        self._unindex(slot)
        self.arena.free(slot)
        return True

    def clear(self) -> int:
        """Free every entry; return how many. Live sources stay tracked."""
        n = 0
        while self.evict_one():
            n += 1
        return n

    def check_integrity(self) -> None:
        """Raise `KVMemoryError` if the index disagrees with the sources or the arena."""
        expected: dict[int, set[int]] = {}
        for slot, src in self._sources.items():
            if len(src.hashes) != src.num_tokens // self.block_size:
                raise KVMemoryError(f"slot {slot}: {len(src.hashes)} block hashes for "
                                    f"{src.num_tokens} tokens")
            if self.arena.num_tokens(slot) < src.num_tokens:
                raise KVMemoryError(f"slot {slot}: source of {src.num_tokens} tokens maps "
                                    f"{self.arena.num_tokens(slot)}")
            for h in src.hashes:
                expected.setdefault(h, set()).add(slot)
        actual = {h: set(slots) for h, slots in self._index.items()}
        if actual != expected:
            raise KVMemoryError("prefix index out of sync with its sources")
        if not set(self._lru) <= set(self._sources):
            raise KVMemoryError("an entry is not indexed")

    # ------------------------------------------------------------------ internals
    def _extend(self, slot: int, src: _Source, num_tokens: int) -> None:
        """Index the full blocks of ``src.tokens[:num_tokens]`` not indexed yet."""
        if num_tokens < src.num_tokens:
            raise KVMemoryError(f"slot {slot}: source shrank from {src.num_tokens} to {num_tokens}")
        bs = self.block_size
        prev = src.hashes[-1] if src.hashes else _CHAIN_SEED
        for i in range(len(src.hashes), num_tokens // bs):
            prev = _chain(prev, src.tokens[i * bs:(i + 1) * bs])
            src.hashes.append(prev)
            self._index.setdefault(prev, {})[slot] = None
        src.num_tokens = num_tokens

    def _unindex(self, slot: int) -> None:
        src = self._sources.pop(slot, None)
        if src is None:
            return
        for h in src.hashes:
            slots = self._index[h]
            del slots[slot]
            if not slots:
                del self._index[h]

    def _extend_match(self, src: _Source, tokens: list[int], start: int, limit: int) -> int:
        """``start`` plus the tokens after it that ``src`` shares with ``tokens`` (< 1 block)."""
        end = min(limit, src.num_tokens, start + self.block_size)
        n = start
        while n < end and src.tokens[n] == tokens[n]:
            n += 1
        return n


def _chain(prev: int, block: list[int]) -> int:
    """Hash of a block chained to the hash of every block before it."""
    return hash((prev, *block))
