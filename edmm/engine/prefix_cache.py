"""Prefix reuse on the KV arena: slots that hold KV of known tokens are sources of shared pages.

Sources are arena slots with the tokens whose KV they hold:

- **entries**: slots of finished or preempted sequences, kept instead of freed. The cache owns
  them: LRU order, freed (`KVArena.free`) when `evict_one` is asked to make room.
- **live sources**: slots of running sequences, tracked as their KV grows (`track`). The
  scheduler owns them; the cache only reads them, and a branch never disturbs its source.

Entries carry an eviction class (`EntryRank`: speculation branches first, then plain LRU
entries, then retained sessions, each ordered by a priority and then LRU) and an optional tag (an
agent session or one of its speculation branches). A tagged entry is adopted only by a sequence
that claims its tag; a claimed entry is adopted even on a partial match and truncated after it,
and when it replaces the claimer's own tagged entry that one is retired by `KVArena.commit`: the
zero-copy commit of a speculation branch at resume. Nothing is ever pinned: every entry can be
evicted under memory pressure, and its owner then recomputes.

With a `HostKVStore` attached, a tagged ``RETAINED`` entry (a paused agent session) chosen for
eviction is first copied to host memory (within the store's budget) and remembered by its tag;
`restore` copies it back into a fresh slot as the same entry. The scheduler restores the tags a
request claims before admitting it, evicting any other entry for it (other paused sessions go
to the host in turn: a copy each way costs far less than the recompute the request would
otherwise do in the same pages); a prefetch before a tool's expected return takes free pages
and speculation entries only (`KVCacheManager.restore`). Without room the request waits for
memory (`Scheduler`). At most one offloaded copy per tag; discarding or untagging the tag
drops it.

With an asynchronous copier (a CUDA side stream, `edmm.memory.copies`) copies return before
the bytes have moved. The cache keeps, per slot, the copies still running on it, and a slot is
never unmapped, branched from or adopted before the compute stream waits for them (`_await`):
so a restored session's first step waits on the GPU for its restore, never the host, and
other sessions' steps run beside the copy. Such a cache also **writes behind**: when a paused
session's entry becomes ``RETAINED`` while the pool has fewer free pages than the entry maps
(its eviction is near), its KV is copied to the host at once, beside the steps that follow
(a *shadow* copy, within the store's budget); evicting it later frees its pages without a
copy. A shadow is dropped when its entry is adopted, retagged or freed, and shadows give
their budget to real offloads.

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

import enum
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass, field

from edmm.engine.kv_policy import AdoptionCost
from edmm.memory import KVArena, KVMemoryError, NoFreeSlotError, PoolExhaustedError
from edmm.memory.copies import CopyTicket
from edmm.memory.offload import HostKV, HostKVStore

_CHAIN_SEED = 0x45444D4D  # "EDMM": the hash chain's value before the first block

# A cache entry's tag: any hashable value, compared by equality only (the index never looks
# inside one). The agent layer's are `edmm.agent.SessionTag`s.
CacheTag = Hashable


def chain_seed(salt: str | None) -> int:
    """The hash chain's first value for prompts of cache salt ``salt`` (None: unsalted).
    Blocks of different salts never match: lookups also compare the sources' seeds."""
    return _CHAIN_SEED if salt is None else hash((_CHAIN_SEED, salt))


class EntryRank(enum.IntEnum):
    """Eviction class of a cache entry: lower ranks are evicted first."""

    SPECULATIVE = 0  # a speculation branch: the first reclaimed under pressure
    PLAIN = 1  # a finished or preempted sequence's KV, plain LRU
    RETAINED = 2  # a paused agent session's KV: soft priority, never a hard pin


@dataclass(frozen=True)
class PrefixHit:
    """A slot whose first ``num_tokens`` tokens already have KV: branched from ``source``, or
    ``source`` itself when an entry was adopted.

    ``claimed``: the tag of a claimed entry that was adopted (None otherwise);
    ``source_tokens``: tokens the source held before the match (an adopted claimed entry is
    truncated to ``num_tokens``); ``committed``: slots retired by `KVArena.commit` in favour
    of the adopted one; ``rank``/``priority``: the eviction class an adopted entry had (it
    keeps it if it goes back to the cache unused); ``seconds``: time spent finding,
    committing and truncating.
    """

    slot: int
    num_tokens: int
    source: int
    claimed: CacheTag | None = None
    source_tokens: int = 0
    committed: tuple[int, ...] = ()
    rank: EntryRank = EntryRank.PLAIN
    priority: float = 0.0
    seconds: float = 0.0


@dataclass
class _Entry:
    tag: CacheTag | None = None
    rank: EntryRank = EntryRank.PLAIN
    priority: float = 0.0  # within a rank: lower is evicted first

    def eviction_key(self) -> tuple[int, float]:
        return int(self.rank), self.priority


@dataclass
class _Offloaded:
    tokens: list[int]  # the KV's tokens
    kv: HostKV
    priority: float  # the entry's (its rank is RETAINED: only those are offloaded)
    seed: int = _CHAIN_SEED  # its source's (`chain_seed`)


@dataclass
class _Source:
    tokens: list[int]  # KV holds tokens[:num_tokens]; a live source's list may be longer
    num_tokens: int
    hashes: list[int] = field(default_factory=list)  # chained hash of each full block
    seed: int = _CHAIN_SEED  # the chain's first value: `chain_seed` of the cache salt


class PrefixCache:
    """Index of reusable KV prefixes over the arena's slots; see the module docstring.

    With ``enabled=False`` nothing is indexed and `release` frees slots at once, so the
    scheduler runs one code path either way. ``policy`` decides whether a claimed entry is
    truncated or branched from on a partial match.
    """

    def __init__(self, arena: KVArena, block_size: int = 16, enabled: bool = True,
                 offload: HostKVStore | None = None,
                 policy: AdoptionCost | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.arena = arena
        self.block_size = block_size
        self.enabled = enabled
        self.offload = offload
        self.policy = policy if policy is not None else AdoptionCost()
        self._offloaded: dict[CacheTag, _Offloaded] = {}  # tag -> its host copy
        self.offloaded_total = 0  # entries copied to the host, over the cache's life
        self.restored_total = 0  # host copies brought back
        self._sources: dict[int, _Source] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # entries, least recently used first
        self._index: dict[int, dict[int, None]] = {}  # block hash -> slots holding that chain
        self._pending: dict[int, list[CopyTicket]] = {}  # slot -> copies maybe running on it
        self._shadows: dict[int, HostKV] = {}  # entry slot -> its written-behind host copy
        self.shadowed_total = 0  # write-behind copies made
        self.shadow_hits = 0  # evictions that found their copy already made

    @property
    def num_entries(self) -> int:
        """Slots held by the cache (evictable)."""
        return len(self._lru)

    def entry_slots(self, max_rank: EntryRank = EntryRank.RETAINED) -> list[int]:
        """Slots held by the cache with rank <= ``max_rank``, least recently used first."""
        return [slot for slot, e in self._lru.items() if e.rank <= max_rank]

    def tagged(self, tag: CacheTag) -> list[int]:
        """Entry slots tagged ``tag``, least recently used first."""
        return [slot for slot, e in self._lru.items() if e.tag == tag]

    def tags(self) -> set[CacheTag]:
        """The tags of every entry and host copy."""
        return {e.tag for e in self._lru.values() if e.tag is not None} | set(self._offloaded)

    def offloaded_tokens(self, tag: CacheTag) -> int:
        """Tokens of ``tag``'s host copy (0: none)."""
        off = self._offloaded.get(tag)
        return 0 if off is None else off.kv.num_tokens

    # ------------------------------------------------------------------ sources
    def track(self, slot: int, tokens: list[int], num_tokens: int,
              salt: str | None = None) -> None:
        """Record that live ``slot`` holds KV of ``tokens[:num_tokens]`` (``tokens`` may grow
        later, but its first ``num_tokens`` never change while the slot is live), found only
        by lookups of the same cache ``salt``."""
        if not self.enabled:
            return
        src = self._sources.get(slot)
        if src is None:
            src = self._sources[slot] = _Source(tokens, 0, seed=chain_seed(salt))
        elif slot in self._lru:
            raise KVMemoryError(f"slot {slot} is a cache entry, not a live source")
        src.tokens = tokens
        self._extend(slot, src, num_tokens)

    def release(self, slot: int, tokens: list[int], num_tokens: int, tag: CacheTag | None = None,
                rank: EntryRank = EntryRank.PLAIN, priority: float = 0.0,
                salt: str | None = None) -> None:
        """The owner is done with ``slot``, whose KV holds ``tokens[:num_tokens]``: keep it as
        the most recently used entry (caching on, ``num_tokens > 0``), with its tag and
        eviction class, or free it."""
        if slot in self._lru:
            raise KVMemoryError(f"slot {slot} is already a cache entry")
        if not self.enabled or num_tokens == 0:
            self._unindex(slot)
            self.arena.free(slot)
            return
        src = self._sources.get(slot) or _Source([], 0, seed=chain_seed(salt))
        self._sources[slot] = src
        src.tokens = tokens[:num_tokens]  # a private copy: the sequence may go on growing
        self._extend(slot, src, num_tokens)
        self._lru[slot] = _Entry(tag, rank, priority)
        self._write_behind(slot)

    def set_retention(self, tag: CacheTag, rank: EntryRank, priority: float = 0.0) -> int:
        """Set the eviction class and priority of every entry tagged ``tag``; return how many."""
        slots = self.tagged(tag)
        for slot in slots:
            self._lru[slot].rank, self._lru[slot].priority = rank, priority
            self._write_behind(slot)
        off = self._offloaded.get(tag)
        if off is not None:
            off.priority = priority  # what a prefetch of it may evict (`restore`)
        return len(slots)

    def untag(self, tags: Iterable[CacheTag], rank: EntryRank) -> int:
        """Make the entries tagged with any of ``tags`` plain untagged entries of ``rank`` (no
        memory is touched: stale but valid KV, reusable by lookups, evicted in turn)."""
        return self.retag(tags, None, rank)

    def retag(self, tags: Iterable[CacheTag], new_tag: CacheTag | None, rank: EntryRank) -> int:
        """Give the entries tagged with any of ``tags`` the tag ``new_tag`` (None: untagged)
        and eviction class ``rank``; their host copies are dropped. No memory is touched."""
        wanted = set(tags)
        self._drop_offloaded(wanted)
        slots = [slot for slot, e in self._lru.items() if e.tag in wanted]
        for slot in slots:
            self._lru[slot] = _Entry(new_tag, rank)
            self._drop_shadow(slot)
        return len(slots)

    def discard(self, tags: Iterable[CacheTag]) -> int:
        """Free every entry tagged with one of ``tags`` (and their host copies); return how
        many entries."""
        wanted = set(tags)
        self._drop_offloaded(wanted)
        slots = [slot for slot, e in self._lru.items() if e.tag in wanted]
        for slot in slots:
            self._free_entry(slot)
        return len(slots)

    # ------------------------------------------------------------------ lookup
    def lookup(self, tokens: list[int], max_tokens: int,
               salt: str | None = None) -> tuple[int, int] | None:
        """``(source slot, n)`` of the longest prefix ``tokens[:n]`` (``n <= max_tokens``)
        whose KV some source of the same cache ``salt`` holds, at least one full block long;
        None if there is none."""
        if not self.enabled:
            return None
        limit = min(len(tokens), max_tokens)
        candidates: dict[int, None] = {}
        matched = 0  # full blocks matched
        seed = prev = chain_seed(salt)
        bs = self.block_size
        for i in range(limit // bs):
            h = _chain(prev, tokens[i * bs:(i + 1) * bs])
            found = self._index.get(h)
            if not found:
                break
            candidates, prev, matched = found, h, i + 1
        best: tuple[int, int] | None = None
        for slot in candidates:
            if self._sources[slot].seed != seed:
                continue  # another salt's (or a hash collision)
            n = self._extend_match(self._sources[slot], tokens, matched * bs, limit)
            if best is None or n > best[1]:
                best = (slot, n)
        if best is None or self._sources[best[0]].tokens[: matched * bs] != tokens[: matched * bs]:
            return None  # no block matched, or a hash collision
        return best

    def acquire(self, tokens: list[int], max_tokens: int, claim: Collection[CacheTag] = (),
                own_tag: CacheTag | None = None, salt: str | None = None) -> PrefixHit | None:
        """A slot for a new sequence whose first ``num_tokens`` tokens already have KV: the
        longest cached prefix of ``tokens`` (see `lookup`), or None.

        An untagged entry that the new sequence extends entirely is adopted: its slot becomes
        the sequence's (no copy, no new slot) and stays indexed as a live source. An entry
        tagged with one of ``claim`` (or ``own_tag``) that matches at least as far as any
        source is adopted even on a partial match, truncated after it (or branched from, when
        unmapping its tail would cost more driver time than mapping the prefix); the entries
        tagged ``own_tag`` that an adopted one supersedes are retired by `KVArena.commit`
        (zero-copy commit).
        Otherwise the slot is `KVArena.branch` of the source: shared full pages, one copied
        boundary page. Raises `NoFreeSlotError` / `PoolExhaustedError` from the branch
        (nothing changed); the caller may `evict_one` and retry.
        """
        tags = set(claim) | ({own_tag} if own_tag is not None else set())
        claimed = self._best_claimed(tokens, max_tokens, tags, own_tag, chain_seed(salt))
        if claimed is not None and claimed[1] >= min(len(tokens), max_tokens):
            return self._adopt(claimed[0], claimed[1], own_tag)  # nothing can match more
        found = self.lookup(tokens, max_tokens, salt)
        if claimed is not None and claimed[1] > 0 and (found is None or claimed[1] >= found[1]):
            return self._adopt(claimed[0], claimed[1], own_tag)
        if found is None:
            return None
        source, n = found
        entry = self._lru.get(source)
        self._await(source)
        if entry is not None and entry.tag is None and n == self._sources[source].num_tokens:
            del self._lru[source]
            self._drop_shadow(source)
            return PrefixHit(source, n, source, source_tokens=n, rank=entry.rank,
                             priority=entry.priority)
        slot = self.arena.branch(source, n)
        if entry is not None:
            self._lru.move_to_end(source)
        return PrefixHit(slot, n, source, source_tokens=self._sources[source].num_tokens)

    # ------------------------------------------------------------------ eviction
    def evict_one(self, max_rank: EntryRank = EntryRank.RETAINED,
                  protect: Collection[CacheTag] = ()) -> bool:
        """Free one entry of rank <= ``max_rank`` (tag not in ``protect``): the lowest rank,
        then the lowest priority, then the least recently used. False if there is none."""
        victim: int | None = None
        best: tuple[int, float] | None = None
        for slot, entry in self._lru.items():
            key = entry.eviction_key()
            if (entry.rank <= max_rank and (best is None or key < best)
                    and (entry.tag is None or entry.tag not in protect)):
                victim, best = slot, key
        if victim is None:
            return False
        self._offload(victim)
        self._free_entry(victim)
        return True

    def restore(self, tag: CacheTag, evict: EntryRank | None = None,
                protect: Collection[CacheTag] = ()) -> bool:
        """Copy ``tag``'s host copy back into a fresh slot, as the entry it was (most recently
        used). Without a free slot or pages it fails (False, nothing changes), unless entries
        of rank <= ``evict`` (tags not in ``protect``) are evicted for it first."""
        off = self._offloaded.get(tag)
        if off is None or self.offload is None:
            return False
        slot = self._mapped_slot(off.kv.num_tokens, evict, {tag, *protect})
        if slot is None:
            return False
        self._pend(slot, self.offload.load(off.kv, slot))
        del self._offloaded[tag]
        self.offload.release(off.kv)
        src = self._sources[slot] = _Source(off.tokens, 0, seed=off.seed)
        self._extend(slot, src, off.kv.num_tokens)
        self._lru[slot] = _Entry(tag, EntryRank.RETAINED, off.priority)
        self.restored_total += 1
        return True

    def _mapped_slot(self, num_tokens: int, evict: EntryRank | None, protect: Collection[CacheTag]
                     ) -> int | None:
        """A new slot mapping ``num_tokens`` tokens, evicting as `evict_one` allows."""
        while True:
            try:
                slot = self.arena.allocate()
            except NoFreeSlotError:
                slot = None
            if slot is not None:
                try:
                    self.arena.grow(slot, num_tokens)
                    return slot
                except PoolExhaustedError:
                    self.arena.free(slot)
            if evict is None or not self.evict_one(evict, protect):
                return None

    def clear(self) -> int:
        """Free every entry (host copies dropped, nothing offloaded); return how many. Live
        sources stay tracked."""
        self._drop_offloaded(set(self._offloaded))
        for slot in list(self._shadows):
            self._drop_shadow(slot)
        n = 0
        while self._lru:
            self._free_entry(next(iter(self._lru)))
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
        if not set(self._shadows) <= set(self._lru):
            raise KVMemoryError("a write-behind copy outlived its entry")
        copies = [off.kv for off in self._offloaded.values()] + list(self._shadows.values())
        store = self.offload
        if store is None:
            return
        held = sum(kv.num_blocks for kv in copies) * store.block_bytes
        if store.used_bytes != held or store.num_held != len(copies):
            raise KVMemoryError(f"host store holds {store.used_bytes} bytes in "
                                f"{store.num_held} copies, the cache knows {held} in "
                                f"{len(copies)}")

    # ------------------------------------------------------------------ internals
    def _offload(self, slot: int) -> None:
        """Copy a paused session's entry to the host before it is freed (budget allowing),
        or adopt its write-behind copy."""
        entry = self._lru[slot]
        shadow = self._shadows.pop(slot, None)
        if self.offload is None or entry.tag is None or entry.rank != EntryRank.RETAINED:
            if shadow is not None:
                self.offload_store().release(shadow)
            return
        src = self._sources[slot]
        older = self._offloaded.get(entry.tag)  # superseded: its bytes count as free
        if shadow is not None:
            if older is not None:
                self.offload.release(older.kv)
            kv = shadow
            self.shadow_hits += 1
        else:
            nbytes = src.num_tokens * self.arena.spec.token_bytes
            self._make_budget(nbytes, older.kv.nbytes if older else 0)
            saved = self.offload.save(slot, src.num_tokens,
                                      replacing=older.kv if older else None)
            if saved is None:
                return  # over budget: dropped (an older copy stays), recomputed at resume
            kv = saved
            self._pend(slot, kv.ticket)
        self._offloaded[entry.tag] = _Offloaded(src.tokens[: src.num_tokens], kv, entry.priority,
                                                src.seed)
        self.offloaded_total += 1

    def offload_store(self) -> HostKVStore:
        """The host store (`KVMemoryError` when offload is off)."""
        if self.offload is None:
            raise KVMemoryError("no host store attached")
        return self.offload

    def _write_behind(self, slot: int) -> None:
        """Start a shadow host copy of a ``RETAINED`` tagged entry whose eviction is near
        (the pool has fewer free pages than it maps), with an asynchronous copier only."""
        entry = self._lru[slot]
        store = self.offload
        if (store is None or not store.copier.asynchronous or slot in self._shadows
                or entry.tag is None or entry.rank != EntryRank.RETAINED
                or self.arena.pool.num_free >= len(self.arena.slot_pages(slot))):
            return
        kv = store.save(slot, self._sources[slot].num_tokens)
        if kv is None:
            return  # no budget: the eviction copies it, if the budget allows then
        self._pend(slot, kv.ticket)
        self._shadows[slot] = kv
        self.shadowed_total += 1

    def _make_budget(self, nbytes: int, freed: int) -> None:
        """Drop write-behind copies (oldest first) until a copy of ``nbytes`` fits."""
        assert self.offload is not None
        for slot in list(self._shadows):
            if self.offload.fits(nbytes, freed):
                return
            self._drop_shadow(slot)

    def _drop_shadow(self, slot: int) -> None:
        """Forget ``slot``'s write-behind copy (its bytes back to the budget; a copy still
        running stays pending on the slot)."""
        shadow = self._shadows.pop(slot, None)
        if shadow is not None:
            self.offload_store().release(shadow)

    def _pend(self, slot: int, ticket: CopyTicket) -> None:
        """Remember a copy that may still run on ``slot``."""
        if not ticket.done:
            self._pending.setdefault(slot, []).append(ticket)

    def _await(self, slot: int) -> None:
        """Order the compute stream (and so the unmap fence) after the copies on ``slot``."""
        tickets = self._pending.pop(slot, None)
        if not tickets:
            return
        assert self.offload is not None
        copier = self.offload.copier
        for ticket in tickets:
            if not copier.poll(ticket):
                copier.compute_wait(ticket)

    def pending_copies(self, slot: int) -> int:
        """Copies that may still run on ``slot`` (not yet awaited)."""
        return len(self._pending.get(slot, ()))

    def _drop_offloaded(self, tags: set[CacheTag]) -> None:
        for tag in tags & self._offloaded.keys():
            off = self._offloaded.pop(tag)
            assert self.offload is not None
            self.offload.release(off.kv)

    def _free_entry(self, slot: int) -> None:
        del self._lru[slot]
        self._drop_shadow(slot)
        self._unindex(slot)
        self._await(slot)
        self.arena.free(slot)

    def _best_claimed(self, tokens: list[int], max_tokens: int, tags: set[CacheTag],
                      own_tag: CacheTag | None, seed: int) -> tuple[int, int] | None:
        """``(slot, n)`` of the claimed entry sharing the longest prefix with ``tokens``; on a
        tie the own-tagged entry wins (nothing to retire), then the most recent one. The
        longest entries are compared first, and one too short to reach the best match so far
        is not compared at all (a speculation hit's branch spares the session's own entry)."""
        limit = min(len(tokens), max_tokens)
        candidates = []  # (the most it can share, LRU order, slot, own-tagged)
        for order, (slot, entry) in enumerate(self._lru.items()):
            src = self._sources[slot]
            if entry.tag in tags and src.seed == seed:
                candidates.append((min(limit, src.num_tokens), order, slot, entry.tag == own_tag))
        candidates.sort(reverse=True)
        best: tuple[int, int] | None = None
        best_key = (-1, False, -1)
        for most, order, slot, own in candidates:
            if most < best_key[0]:
                break  # neither it nor any after it can match as far
            n = common_prefix_len(self._sources[slot].tokens, tokens, most)
            key = (n, own, order)
            if key > best_key:
                best, best_key = (slot, n), key
        return best

    def _adopt(self, slot: int, n: int, own_tag: CacheTag | None) -> PrefixHit:
        """Adopt claimed entry ``slot`` truncated to ``n`` tokens; retire the own-tagged
        entries it supersedes (`KVArena.commit`: an index swap, no copy, no driver call).
        When its tail is long, branch from it instead (the entry stays)."""
        held = self._sources[slot].num_tokens
        self._await(slot)
        if self._branch_is_cheaper(slot, n):
            new = self.arena.branch(slot, n)
            self._lru.move_to_end(slot)
            return PrefixHit(new, n, slot, self._lru[slot].tag, held)
        entry = self._lru.pop(slot)
        self._drop_shadow(slot)
        committed: list[int] = []
        if own_tag is not None and entry.tag != own_tag:
            for old in self.tagged(own_tag):
                del self._lru[old]
                self._drop_shadow(old)
                self._await(old)
                self._unindex(old)
                self.arena.commit(old, slot)  # retired: reclaimed after the step
                committed.append(old)
        if n < held:
            self.arena.truncate(slot, n)
            self._shrink(slot, n)
        return PrefixHit(slot, n, slot, entry.tag, held, tuple(committed), entry.rank,
                         entry.priority)

    def _branch_is_cheaper(self, slot: int, n: int) -> bool:
        """True when the policy finds truncating ``slot`` to ``n`` tokens (unmap its tail) dearer
        than a branch of it at ``n`` (map its full prefix pages)."""
        tail = len(self.arena.slot_pages(slot)) - self.arena.pages_for(n)
        prefix = n * self.arena.spec.token_bytes // self.arena.page_size
        return self.policy.prefer_branch(tail, prefix)

    def _shrink(self, slot: int, num_tokens: int) -> None:
        """Forget the tokens of source ``slot`` past ``num_tokens`` (after a truncate)."""
        src = self._sources[slot]
        keep = num_tokens // self.block_size
        for h in src.hashes[keep:]:
            slots = self._index[h]
            del slots[slot]
            if not slots:
                del self._index[h]
        del src.hashes[keep:]
        src.tokens, src.num_tokens = src.tokens[:num_tokens], num_tokens

    def _extend(self, slot: int, src: _Source, num_tokens: int) -> None:
        """Index the full blocks of ``src.tokens[:num_tokens]`` not indexed yet."""
        if num_tokens < src.num_tokens:
            raise KVMemoryError(f"slot {slot}: source shrank from {src.num_tokens} to {num_tokens}")
        bs = self.block_size
        prev = src.hashes[-1] if src.hashes else src.seed
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


def common_prefix_len(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (at most ``limit``).

    Two lists equal over the whole range (a resume whose prompt a speculation predicted,
    a session's own context) are compared in one pass at C speed, without a copy when both
    are equal throughout or a list holds exactly the range; otherwise slices of 256 tokens
    are compared, then the mismatching slice token by token.
    """
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    if n and a[n - 1] == b[n - 1] and ((len(a) == len(b) and a == b)
                                       or _head(a, n) == _head(b, n)):
        return n
    step = 256
    i = 0
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    end = min(i + step, n)
    while i < end and a[i] == b[i]:
        i += 1
    return i


def _head(tokens: list[int], n: int) -> list[int]:
    """``tokens[:n]``, without a copy when that is all of ``tokens``."""
    return tokens if len(tokens) == n else tokens[:n]


def _chain(prev: int, block: list[int]) -> int:
    """Hash of a block chained to the hash of every block before it."""
    return hash((prev, *block))
