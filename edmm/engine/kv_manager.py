"""`KVCacheManager`: the one seam between the scheduler and KV memory.

The scheduler's whole view of memory is this object (as vLLM v1's ``KVCacheManager`` or
mini-sglang's ``CacheManager``): it asks it to *match* a prompt against the cached prefixes
(`match`: a slot that already holds the longest prefix, adopted or branched), to *allocate* a
fresh slot and map it for ``n`` tokens (`allocate`, `grow`), to *free* a slot (`free`: kept as a
prefix-cache entry or released) and to *make room* (`make_room`: reclaim the slots zero-copy
commits retired, else evict one entry up to an eviction class). Behind it, and touched by
nothing else, are the arena (slots -> pages), the page pool (refcounts, free list), the prefix
index (`PrefixCache`) and the host offload tier (`HostKVStore`, inside the index).

The choice between truncating a claimed entry in place and branching from it is made by one
named policy, `AdoptionCost`, which the index consults.

The agent layer reaches the tagged entries through the same object (`tagged`, `set_retention`,
`untag`, `retag`, `discard`, `restore`, `offloaded_tokens`; `lend` gives a speculation its
session's entry to extend in place) and asks it what a slot's tokens cost
(`layout`, `page_seconds`); a bench holds pages out of use through it (`hold_pages`,
`release_held`); `stats` returns a `KVStats` snapshot. Nothing outside the engine touches the
arena or the index: they are private to this object.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace

from edmm.engine.kv_policy import CachePolicy
from edmm.engine.prefix_cache import CacheTag, EntryRank, PrefixCache, PrefixHit
from edmm.memory import KVArena, KVMemoryError
from edmm.memory.arena import DriverTime
from edmm.memory.offload import CopyCounters


@dataclass(frozen=True)
class KVStats:
    """KV memory at one instant (pages of the pool, entries of the prefix index, host tier)."""

    pages_total: int
    pages_in_use: int  # mapped by at least one slot
    pages_free: int
    cached_pages: int  # distinct pages mapped by prefix-cache entries (evictable)
    cache_entries: int
    offload_bytes: int  # host bytes held now by offloaded KV
    offload_capacity_bytes: int  # 0: offload off
    offloads: int  # evictions whose KV went to the host, since start
    restores: int  # restores from the host (a session's, or an admission's blocks), since start
    offloaded_bytes_total: int  # bytes copied to the host, since start
    restored_bytes_total: int  # bytes copied back, since start
    offload_s: float  # seconds the copies to the host took, since start (those seen done)
    restore_s: float  # seconds the copies back took, since start (those seen done)
    copies_in_flight: int = 0  # side-stream copies not yet seen done
    write_behind: int = 0  # paused sessions copied to the host ahead of their eviction
    write_behind_hits: int = 0  # evictions that found that copy made (no copy then)
    pages_shared: int = 0  # of pages_in_use, those mapped by more than one slot
    pages_private: int = 0  # of pages_in_use, those mapped by one slot only
    host_blocks: int = 0  # KV blocks held in host memory (each once, however many share it)
    trimmed_pages: int = 0  # pages freed by tail-first evictions, since start
    spares_made: int = 0  # spare branches of hot prefixes mapped ahead, since start
    spares_used: int = 0  # admissions that adopted one (no page mapped for the prefix)


@dataclass(frozen=True)
class KVLayout:
    """What tokens cost in KV memory: the arena's page size, the bytes of one token's KV (all
    layers, K and V) and the most tokens one slot maps."""

    page_size: int
    token_bytes: int
    max_tokens: int

    def full_pages(self, num_tokens: int) -> int:
        """Pages that a slot's first ``num_tokens`` tokens fill entirely (those a branch of
        them shares with its source)."""
        return max(num_tokens, 0) * self.token_bytes // self.page_size


@dataclass(frozen=True)
class HeldPages:
    """Pages that `KVCacheManager.hold_pages` keeps out of use, mapped in ``slots``."""

    slots: tuple[int, ...]
    num_pages: int


class KVCacheManager:
    """The scheduler's and the agent layer's one handle on KV memory; see the module docstring.

    Args:
        arena: the KV arena (its pool comes with it).
        index: the prefix index over the arena (with its offload store, if any).
    """

    def __init__(self, arena: KVArena, index: PrefixCache) -> None:
        if index.arena is not arena:
            raise ValueError("the prefix index must index this arena")
        self._arena = arena
        self._index = index
        self._held: set[int] = set()  # slots of `hold_pages`: no sequence's, no entry's

    @property
    def caching(self) -> bool:
        """True when finished sequences' KV is kept for reuse (prefix caching on)."""
        return self._index.enabled

    @property
    def max_tokens(self) -> int:
        """Most tokens one slot can map."""
        return self._arena.max_tokens

    # ------------------------------------------------------------------ the scheduler's seam
    def match(self, tokens: list[int], max_tokens: int, claim: Collection[CacheTag] = (),
              own_tag: CacheTag | None = None, salt: str | None = None) -> PrefixHit | None:
        """A slot whose first ``hit.num_tokens`` tokens of ``tokens`` already have KV (at most
        ``max_tokens``), or None; see `PrefixCache.acquire`. Raises `NoFreeSlotError` /
        `PoolExhaustedError` (nothing changed): `make_room` and retry."""
        return self._index.acquire(tokens, max_tokens, claim, own_tag, salt)

    def make_spare(self) -> bool:
        """Map one spare branch of a prefix that admissions keep branching from, ahead of the
        next (`PrefixCache.make_spare`), while two slots and a tenth of the pages stay free;
        True when one was made."""
        return self._index.make_spare(min_free_slots=2,
                                      min_free_pages=self._arena.pool.capacity // 10)

    def cached_prefix(self, tokens: list[int], max_tokens: int) -> int:
        """Tokens of the longest prefix of ``tokens`` (at most ``max_tokens``) with KV in the
        pool now (host copies aside); nothing changes."""
        found = self._index.lookup(tokens, max_tokens)
        return found[1] if found is not None else 0

    def allocate(self) -> int:
        """A fresh empty slot (`NoFreeSlotError` when none is free)."""
        return self._arena.allocate()

    def grow(self, slot: int, num_tokens: int) -> None:
        """Map ``slot`` for its first ``num_tokens`` tokens (`PoolExhaustedError`: unchanged)."""
        self._arena.grow(slot, num_tokens)

    def track(self, slot: int, tokens: list[int], num_tokens: int,
              salt: str | None = None) -> None:
        """A live slot now holds KV of ``tokens[:num_tokens]`` (a source for prefix matches
        of the same cache ``salt``)."""
        self._index.track(slot, tokens, num_tokens, salt)

    def free(self, slot: int, tokens: list[int], num_tokens: int, tag: CacheTag | None = None,
             rank: EntryRank = EntryRank.PLAIN, priority: float = 0.0,
             salt: str | None = None) -> None:
        """The owner is done with ``slot`` (KV of ``tokens[:num_tokens]``): keep it as a cache
        entry with this tag and eviction class, or release it (caching off, or 0 tokens)."""
        self._index.release(slot, tokens, num_tokens, tag, rank, priority, salt)

    def drop(self, slot: int) -> None:
        """Release ``slot`` and its pages outright (never kept as an entry); a slot `lend`
        gave is given back as its entry, cut to its owner's KV."""
        self._index.release(slot, [], 0)

    def lendable(self, tag: CacheTag, tokens: list[int], keep: int,
                 salt: str | None = None) -> bool:
        """Whether `lend` would give a speculation of ``tokens`` the entry tagged ``tag``."""
        return self._index.lendable(tag, tokens, keep, salt)

    def lend(self, tag: CacheTag, tokens: list[int], keep: int,
             salt: str | None = None) -> PrefixHit:
        """The slot of the entry tagged ``tag`` for a speculation of ``tokens`` continuing it
        in place (its speculative tail cut back to the match, never below ``keep`` tokens nor
        its owner's KV); `free` gives it back as that entry, `drop` cut to its owner's KV. See
        `PrefixCache.lend`; `PoolExhaustedError` (nothing changed): `make_room` and retry."""
        return self._index.lend(tag, tokens, keep, salt)

    def tail_pages(self) -> int:
        """Pages that cache entries' speculative tails (speculated in place) map."""
        return self._index.tail_pages()

    def pages_for(self, num_tokens: int) -> int:
        """Pages a slot of ``num_tokens`` tokens maps."""
        return self._arena.pages_for(num_tokens)

    def make_room(self, max_rank: EntryRank = EntryRank.RETAINED,
                  protect: Collection[CacheTag] = (), pages: int | None = None,
                  spare: Collection[int] = ()) -> bool:
        """Free memory: the slots retired by zero-copy commits, else one entry of rank <=
        ``max_rank`` whose tag is not in ``protect`` and whose slot is not in ``spare``
        (lowest rank, then priority, then LRU; a retained session's KV goes to the host tier
        first if it fits). ``pages``: the pages the caller lacks (None: a slot), which a
        tail-first policy frees from the victim's tail (`CachePolicy`). False if nothing was
        freed."""
        return (self._arena.reclaim() > 0
                or self._index.evict_one(max_rank, protect, pages, spare))

    def set_cache_policy(self, policy: CachePolicy) -> None:
        """How entries are evicted and what the host tier takes, from now on (`CachePolicy`;
        a bench runs one engine under several)."""
        self._index.set_cache_policy(policy)

    @property
    def cache_policy(self) -> CachePolicy:
        """The `CachePolicy` in force."""
        return self._index.cache_policy

    def restore_claimed(self, tags: Collection[CacheTag]) -> bool:
        """Bring the host copies of ``tags`` back before a sequence claiming them is admitted,
        evicting any other entry for them if needed (retained ones go to the host tier in
        turn: the sequence would evict them anyway to recompute in the same pages). False if
        a copy stayed on the host (no room even so): the sequence should wait for memory
        rather than recompute what the host holds."""
        resident = True
        for tag in tags:
            if self._index.offloaded_tokens(tag):
                resident = self._index.restore(tag, evict=EntryRank.RETAINED,
                                              protect=tags) and resident
        return resident

    def mark_stale(self, tag: CacheTag, rank: EntryRank, stale_tag: CacheTag | None = None) -> None:
        """Entries still tagged ``tag`` once its sequence holds a slot: entries of ``rank``
        tagged ``stale_tag`` (None: untagged; valid KV, reused by lookups, evicted in turn,
        freed with ``stale_tag``)."""
        self._index.retag([tag], stale_tag, rank)

    def entry_slots(self, max_rank: EntryRank = EntryRank.RETAINED) -> list[int]:
        """Slots of cache entries of rank <= ``max_rank``, least recently used first."""
        return self._index.entry_slots(max_rank)

    def num_tokens(self, slot: int) -> int:
        """Tokens ``slot`` maps."""
        return self._arena.num_tokens(slot)

    def mapped_pages(self, slot: int) -> int:
        """Pages ``slot`` maps."""
        return len(self._arena.slot_pages(slot))

    def private_pages(self, slot: int) -> int:
        """Pages mapped by ``slot`` alone (freed with it)."""
        pool = self._arena.pool
        return sum(pool.refcount(p) == 1 for p in self._arena.slot_pages(slot))

    def layout(self) -> KVLayout:
        """The page size, the bytes of a token's KV and the most tokens of a slot."""
        arena = self._arena
        return KVLayout(arena.page_size, arena.spec.token_bytes, arena.max_tokens)

    def driver_time(self) -> DriverTime:
        """A copy of the arena's driver counters so far (pages mapped and unmapped, their host
        seconds)."""
        return replace(self._arena.driver)

    def page_seconds(self) -> tuple[float, float] | None:
        """Mean host seconds to map and to unmap one page, as measured on this arena so far;
        None until both were seen."""
        return self._arena.driver.per_page_s()

    def tokens_in_pages(self, num_pages: int) -> int:
        """Tokens that ``num_pages`` pages hold."""
        return max(num_pages, 0) * self._arena.page_size // self._arena.spec.token_bytes

    # ------------------------------------------------------------------ tagged entries
    def tagged(self, tag: CacheTag) -> list[int]:
        """Slots of the cache entries tagged ``tag``."""
        return self._index.tagged(tag)

    def tags(self) -> set[CacheTag]:
        """The tags of every cache entry and host copy."""
        return self._index.tags()

    def set_retention(self, tag: CacheTag, rank: EntryRank, priority: float = 0.0) -> int:
        """Eviction class and priority of the cache entries tagged ``tag``; return how many."""
        return self._index.set_retention(tag, rank, priority)

    def untag(self, tags: Iterable[CacheTag], rank: EntryRank) -> int:
        """Turn the entries tagged with any of ``tags`` into plain entries of ``rank`` (no
        memory touched: freed lazily, under pressure); return how many."""
        return self._index.untag(tags, rank)

    def retag(self, tags: Iterable[CacheTag], new_tag: CacheTag, rank: EntryRank) -> int:
        """Move the entries tagged with any of ``tags`` under ``new_tag``, of class ``rank``
        (no memory touched; `discard` of ``new_tag`` frees them); return how many."""
        return self._index.retag(tags, new_tag, rank)

    def discard(self, tags: Iterable[CacheTag]) -> int:
        """Free the cache entries tagged with any of ``tags`` (and host copies); how many."""
        return self._index.discard(tags)

    def restore(self, tag: CacheTag) -> bool:
        """Copy the host copy of ``tag``'s entry back into the arena ahead of its resume (a
        prefetch), into free pages or those of speculation entries only: never at the cost of
        another cache entry (a plain one, such as a turn that just ended, would be recomputed;
        a retained one copied out to come back later). False when there is none or no room."""
        return self._index.restore(tag, evict=EntryRank.SPECULATIVE)

    def offloaded_tokens(self, tag: CacheTag) -> int:
        """Tokens of the host copy of ``tag``'s entry (0: none)."""
        return self._index.offloaded_tokens(tag)

    # ------------------------------------------------------------------ held pages
    def hold_pages(self, num_pages: int) -> HeldPages:
        """Map ``num_pages`` pages (a few more where the arena's read alignment rounds a slot
        up) into fresh slots that no sequence or cache entry uses, until `release_held`: the
        pool the scheduler sees shrinks by as much (a bench runs one built engine at several
        memory sizes). Raises `NoFreeSlotError` / `PoolExhaustedError` (nothing held)."""
        arena = self._arena
        per_slot = arena.pages_for(arena.max_tokens)
        slots: list[int] = []
        left = num_pages
        try:
            while left > 0:
                k = min(left, per_slot)
                slot = arena.allocate()
                slots.append(slot)
                arena.grow(slot, min(arena.max_tokens,
                                     k * arena.page_size // arena.spec.token_bytes))
                left -= len(arena.slot_pages(slot))
        except KVMemoryError:
            for slot in slots:
                arena.free(slot)
            raise
        self._held.update(slots)
        return HeldPages(tuple(slots), num_pages - left)

    def release_held(self, held: HeldPages) -> None:
        """Give the slots and pages of ``held`` back (`KVMemoryError` if they are not held)."""
        if not self._held.issuperset(held.slots):
            raise KVMemoryError(f"slots {held.slots} are not held")
        for slot in held.slots:
            self._held.remove(slot)
            self._arena.free(slot)

    # ------------------------------------------------------------------ lifetime
    def reclaim(self) -> int:
        """Release the slots retired by zero-copy commits (driver unmaps: off the critical
        path) and count the host copies found done; return how many slots."""
        if self._index.offload is not None:
            self._index.offload.poll()
        return self._arena.reclaim()

    def pending_copies(self, slot: int) -> int:
        """Host copies that may still run on ``slot`` (side stream; 0 on the CPU)."""
        return self._index.pending_copies(slot)

    def restored_tokens(self) -> float:
        """Tokens' worth of host KV copied back so far (copies seen done)."""
        store = self._index.offload
        if store is None:
            return 0.0
        return store.counters.loaded_bytes / self._arena.spec.token_bytes

    def drain_copies(self) -> None:
        """Wait (host) for every host copy issued and count it (benches, shutdown)."""
        if self._index.offload is not None:
            self._index.offload.drain()

    def reset(self) -> int:
        """Free every cache entry and host copy (and retired slots); return how many entries."""
        self._arena.reclaim()
        return self._index.clear()

    def stats(self) -> KVStats:
        """A snapshot of the pool, the prefix index and the host tier."""
        pool, index, store = self._arena.pool, self._index, self._index.offload
        in_flight = store.poll() if store is not None else 0
        copies = store.counters if store is not None else CopyCounters()
        cached = {p for slot in index.entry_slots() for p in self._arena.slot_pages(slot)}
        return KVStats(
            pages_total=pool.capacity, pages_in_use=pool.num_used, pages_free=pool.num_free,
            cached_pages=len(cached), cache_entries=index.num_entries,
            offload_bytes=store.used_bytes if store is not None else 0,
            offload_capacity_bytes=store.capacity_bytes if store is not None else 0,
            offloads=index.offloaded_total, restores=index.restored_total,
            offloaded_bytes_total=copies.saved_bytes, restored_bytes_total=copies.loaded_bytes,
            offload_s=copies.save_s, restore_s=copies.load_s, copies_in_flight=in_flight,
            write_behind=index.shadowed_total, write_behind_hits=index.shadow_hits,
            pages_shared=pool.num_shared, pages_private=pool.num_used - pool.num_shared,
            host_blocks=store.num_held if store is not None else 0,
            trimmed_pages=index.trimmed_pages, spares_made=index.spares_made,
            spares_used=index.spares_used)

    def check_integrity(self) -> None:
        """Raise if the arena, the pool, the prefix index or the host tier breaks an
        invariant, or a held slot is not a live slot of its own."""
        self._arena.check_integrity()
        self._index.check_integrity()
        if self._held & set(self._index.entry_slots()):
            raise KVMemoryError("a held slot is a cache entry")
        for slot in self._held:
            self._arena.num_tokens(slot)  # raises unless the slot is live

    def close(self) -> None:
        """Free every entry, then the arena and the pool (the manager is unusable after)."""
        self.drain_copies()
        self._index.clear()
        self._held.clear()
        self._arena.close()  # frees every slot still in use (held ones included)
        self._arena.pool.close()
