"""Prefix reuse on the KV arena: slots that hold KV of known tokens are sources of shared pages.

Sources are arena slots with the tokens whose KV they hold:

- **entries**: slots of finished or preempted sequences, kept instead of freed. The cache owns
  them: LRU order, freed (`KVArena.free`) or cut (`KVArena.truncate`) when `evict_one` is
  asked to make room.
- **live sources**: slots of running sequences, tracked as their KV grows (`track`). The
  scheduler owns them; the cache only reads them, and a branch never disturbs its source.

Entries carry an eviction class (`EntryRank`: speculation branches first, then plain LRU
entries, then retained sessions, each ordered by a priority and then LRU) and an optional tag (an
agent session or one of its speculation branches). A tagged entry is adopted only by a sequence
that claims its tag; a claimed entry is adopted even on a partial match and truncated after it,
and when it replaces the claimer's own tagged entry that one is retired by `KVArena.commit`: the
zero-copy commit of a speculation branch at resume. Nothing is ever pinned: every entry can be
evicted under memory pressure, and its owner then recomputes.

**One physical copy of a shared prefix.** A new sequence looks up the source with the longest
common token prefix and gets `KVArena.branch` of it: the same physical pages for the full pages
of that prefix, one copied boundary page, no recompute. Sources of different sessions are
alike here, so sessions whose prompts share a prefix (an agent's system prompt and tool
schemas) map the same pages for it; a page's reference count (`PagePool`) is the number of
slots mapping it, and evicting one slot's entry frees only the pages no other slot maps. The
share is page-granular: ``floor(n * token_bytes / page_size)`` pages of an ``n``-token prefix
are shared (a 2 MiB page holds ~36.6 tokens of a 7B model's KV, so up to 36 tokens of the
prefix sit on the copied boundary page). When the sequence extends an entry entirely (the next
turn of an agent loop, a preempted sequence resuming), it adopts the entry's slot instead: no
copy at all. A commit swaps slots, so the pages the session shared stay shared.

**Speculation in place.** A paused session's speculation that continues the session's own
tokens need not branch: `lend` hands the session's entry to the speculative prefill as its
slot (no page mapped but the new tokens'), cut back first to the tokens the speculation
shares with it (never below the tokens the session computed itself). When the prefill stops
its slot comes back as the same entry (tag, class, priority as they are then), its tokens
past the session's own marked as a speculative tail; `drop` (memory pressure) gives it back
cut to the session's own tokens. A tail is evicted before anything of rank above
``SPECULATIVE`` (`evict_one` cuts it off, keeping the session's KV), and a claim at resume
adopts the entry truncated to the match as any claimed entry: a miss cuts the tail back
exactly.

**Eviction** (`CachePolicy`): an evicted entry goes whole, or, ``tail_first``, loses only the
private pages asked for from its tail (vLLM's automatic prefix caching), keeping its prefix
indexed. Pages another slot still maps are never freed by an eviction.

**The host tier.** With a `HostKVStore` attached, KV leaving the GPU goes to host memory as
blocks of ``block_size`` tokens keyed by their chain hash (below), each held once however
many sequences share it, with its parent hash and tokens so a hash collision is detected on the
way back. What goes (`CachePolicy`): the KV of a tagged ``RETAINED`` entry (a paused agent
session) chosen for eviction, remembered by its tag (``session_records``), and, with
``offload_all``, whatever else an eviction removes; ``write_through`` copies every full
block as soon as it is computed. What comes back: `restore` of a tag branches from the
longest prefix of the session's tokens the GPU still holds (another session's slot, a live
one included) and loads from the host only the blocks after it, so a restored session maps
the shared prefix's pages again instead of a private copy; under ``offload_all`` an
admission (`acquire`) does the same for its prompt. Blocks stay on the
host after a restore (leaving it again copies nothing). The scheduler restores the tags a
request claims before admitting it, evicting any other entry for it (other paused sessions go
to the host in turn: a copy each way costs far less than the recompute the request would
otherwise do in the same pages); a prefetch before a tool's expected return takes free pages
and speculation entries only (`KVCacheManager.restore`). Without room the request waits for
memory (`Scheduler`). At most one host record per tag; discarding or untagging the tag drops
it (its blocks, unless another record holds them, are the first to leave the host).

With an asynchronous copier (a CUDA side stream, `edmm.memory.copies`) copies return before
the bytes have moved. The cache keeps, per slot, the copies still running on it, and a slot is
never unmapped, truncated, branched from or adopted before the compute stream waits for them
(`_await`): so a restored session's first step waits on the GPU for its restore, never the
host, and other sessions' steps run beside the copy. Such a cache also **writes behind**: when
a paused session's entry becomes ``RETAINED`` while the pool has fewer free pages than the
entry maps (its eviction is near), its blocks are copied to the host at once, beside the steps
that follow; evicting it later copies nothing.

Lookup is O(prompt length): every full block of ``block_size`` tokens of a source is indexed by
a hash chained over the blocks before it (as in vLLM), so walking the prompt's block hashes finds
the sources sharing the most full blocks; the match is then extended token by token inside the
next block (at most ``block_size - 1`` comparisons per candidate) and verified against the
source's tokens, so a hash collision can never reuse wrong KV.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from edmm.engine.kv_policy import AdoptionCost, CachePolicy
from edmm.memory import KVArena, KVMemoryError, NoFreeSlotError, PoolExhaustedError
from edmm.memory.copies import CopyTicket
from edmm.memory.errors import pages_short
from edmm.memory.offload import BlockSave, HostKVStore

_CHAIN_SEED = 0x45444D4D  # "EDMM": the hash chain's value before the first block
HOT_BRANCHES = 2  # branches of one prefix after which `make_spare` maps it ahead
MAX_BRANCH_POINTS = 16  # branch points remembered (the most recent)

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
    """A slot whose first ``num_tokens`` tokens already have KV: branched from ``source``,
    ``source`` itself when an entry was adopted, or a fresh slot (``source`` -1) when all of
    it came from the host.

    ``claimed``: the tag of a claimed entry that was adopted (None otherwise);
    ``source_tokens``: tokens the source held before the match (an adopted claimed entry is
    truncated to the match); ``committed``: slots retired by `KVArena.commit` in favour
    of the adopted one; ``rank``/``priority``: the eviction class an adopted entry had (it
    keeps it if it goes back to the cache unused); ``host_tokens``: of the ``num_tokens``,
    those loaded from the host tier (the last ones); ``seconds``: time spent finding,
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
    host_tokens: int = 0
    seconds: float = 0.0


@dataclass
class _Entry:
    tag: CacheTag | None = None
    rank: EntryRank = EntryRank.PLAIN
    priority: float = 0.0  # within a rank: lower is evicted first
    own: int | None = None  # tokens of its owner's KV; those after were speculated in place
    spare: bool = False  # mapped ahead by `make_spare`, no sequence's yet

    def eviction_key(self) -> tuple[int, float]:
        return int(self.rank), self.priority

    def tail_key(self) -> tuple[int, float] | None:
        """The eviction key of its speculative tail (None: it has none)."""
        return None if self.own is None else (int(EntryRank.SPECULATIVE), self.priority)


@dataclass
class _Offloaded:
    """A paused session's KV on the host: its tokens and the host blocks holding them (pinned
    in the store while the record lives)."""

    tokens: list[int]  # the KV's tokens
    keys: list[int]  # the blocks' keys (chain hashes), block 0 first (the last may be partial)
    priority: float  # the entry's (its rank is RETAINED: only those are recorded)
    seed: int = _CHAIN_SEED  # its source's (`chain_seed`)


@dataclass
class _Source:
    tokens: list[int]  # KV holds tokens[:num_tokens]; a live source's list may be longer
    num_tokens: int
    hashes: list[int] = field(default_factory=list)  # chained hash of each full block
    seed: int = _CHAIN_SEED  # the chain's first value: `chain_seed` of the cache salt


@dataclass
class _BranchPoint:
    """A prefix that admissions branched from: its tokens, their blocks' chain hashes, the
    chain seed, how often, and the slot of its spare (-1: none made, or used since)."""

    tokens: list[int]
    hashes: list[int]
    seed: int
    branches: int = 0
    spare: int = -1


@dataclass(frozen=True)
class _HostRun:
    """Blocks of the host tier that extend a prefix of ``start`` tokens to ``end``:
    ``(key, first token)`` of each."""

    blocks: list[tuple[int, int]]
    start: int
    end: int


class PrefixCache:
    """Index of reusable KV prefixes over the arena's slots; see the module docstring.

    With ``enabled=False`` nothing is indexed and `release` frees slots at once, so the
    scheduler runs one code path either way. ``policy`` decides whether a claimed entry is
    truncated or branched from on a partial match; ``cache_policy`` how entries are evicted
    and what the host tier ``offload`` (whose blocks hold ``block_size`` tokens) takes.
    """

    def __init__(self, arena: KVArena, block_size: int = 16, enabled: bool = True,
                 offload: HostKVStore | None = None,
                 policy: AdoptionCost | None = None,
                 cache_policy: CachePolicy | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if offload is not None and offload.block_tokens != block_size:
            raise ValueError(f"host blocks of {offload.block_tokens} tokens under an index of "
                             f"{block_size}-token blocks")
        self.arena = arena
        self.block_size = block_size
        self.enabled = enabled
        self.offload = offload
        self.policy = policy if policy is not None else AdoptionCost()
        self.cache_policy = cache_policy if cache_policy is not None else CachePolicy()
        self._offloaded: dict[CacheTag, _Offloaded] = {}  # tag -> its host record
        self.offloaded_total = 0  # evictions whose KV went to the host, over the cache's life
        self.restored_total = 0  # restores from the host (by tag or at admission)
        self.trimmed_pages = 0  # pages freed by tail-first evictions
        self._sources: dict[int, _Source] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # entries, least recently used first
        self._lent: dict[int, _Entry] = {}  # slot -> the entry it was, lent to a speculation
        self._index: dict[int, dict[int, None]] = {}  # block hash -> slots holding that chain
        self._pending: dict[int, list[CopyTicket]] = {}  # slot -> copies maybe running on it
        self._shadows: set[int] = set()  # entry slots written behind to the host
        self.shadowed_total = 0  # write-behind copies made
        self.shadow_hits = 0  # evictions that found their copy already made
        # branch points seen at admission, most recent last: (seed, n, hash of the block
        # before n) -> the prefix's tokens and how many branches it had (`make_spare`)
        self._branch_points: OrderedDict[tuple[int, int, int], _BranchPoint] = OrderedDict()
        self.spares_made = 0  # spare entries mapped ahead of an admission (`make_spare`)
        self.spares_used = 0  # admissions that adopted one

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
        """The tags of every entry and host record."""
        entries = [*self._lru.values(), *self._lent.values()]
        return {e.tag for e in entries if e.tag is not None} | set(self._offloaded)

    def offloaded_tokens(self, tag: CacheTag) -> int:
        """Tokens of ``tag``'s KV that `restore` would give its entry now (the longest
        prefix the GPU holds, then host blocks); 0 when there is no record or the host adds
        nothing to what the GPU holds."""
        off = self._offloaded.get(tag)
        if off is None:
            return 0
        run = self._record_run(off)
        return 0 if run is None else run[1].end

    def set_cache_policy(self, cache_policy: CachePolicy) -> None:
        """Evict and use the host tier by ``cache_policy`` from now on (what is cached stays)."""
        self.cache_policy = cache_policy

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
        if slot in self._lent:
            self._give_back(slot, tokens, num_tokens)
            return
        if not self.enabled or num_tokens == 0:
            self._unindex(slot)
            self._await(slot)
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
        lent = [e for e in self._lent.values() if e.tag == tag]
        for entry in lent:  # the class it has when the speculation gives it back
            entry.rank, entry.priority = rank, priority
        off = self._offloaded.get(tag)
        if off is not None:
            off.priority = priority  # what a prefetch of it may evict (`restore`)
        return len(slots) + len(lent)

    def untag(self, tags: Iterable[CacheTag], rank: EntryRank) -> int:
        """Make the entries tagged with any of ``tags`` plain untagged entries of ``rank`` (no
        memory is touched: stale but valid KV, reusable by lookups, evicted in turn)."""
        return self.retag(tags, None, rank)

    def retag(self, tags: Iterable[CacheTag], new_tag: CacheTag | None, rank: EntryRank) -> int:
        """Give the entries tagged with any of ``tags`` the tag ``new_tag`` (None: untagged)
        and eviction class ``rank``; their host records are dropped. No memory is touched."""
        wanted = set(tags)
        self._drop_offloaded(wanted)
        slots = [slot for slot, e in self._lru.items() if e.tag in wanted]
        for slot in slots:
            self._lru[slot] = _Entry(new_tag, rank, own=self._lru[slot].own)
            self._shadows.discard(slot)
        for entry in self._lent.values():  # as they will be given back
            if entry.tag in wanted:
                entry.tag, entry.rank, entry.priority = new_tag, rank, 0.0
        return len(slots)

    def discard(self, tags: Iterable[CacheTag]) -> int:
        """Free every entry tagged with one of ``tags`` (and drop their host records); return
        how many entries."""
        wanted = set(tags)
        if any(e.tag in wanted for e in self._lent.values()):
            raise KVMemoryError("discard of an entry lent to a speculation: stop it first")
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
        return self._lookup(tokens, max_tokens, chain_seed(salt))

    def _lookup(self, tokens: list[int], max_tokens: int, seed: int,
                keys: Sequence[int] = ()) -> tuple[int, int] | None:
        """`lookup` by the chain's seed; ``keys``: the chain hashes of ``tokens``' first
        blocks where the caller knows them (not computed again)."""
        limit = min(len(tokens), max_tokens)
        candidates: dict[int, None] = {}
        matched = 0  # full blocks matched
        prev = seed
        bs = self.block_size
        for i in range(limit // bs):
            h = keys[i] if i < len(keys) else _chain(prev, tokens[i * bs:(i + 1) * bs])
            found = self._index.get(h)
            if not found:
                break
            candidates, prev, matched = found, h, i + 1
        best: tuple[int, int] | None = None
        for slot in candidates:
            if self._sources[slot].seed != seed:
                continue  # another salt's (or a hash collision)
            n = self._extend_match(self._sources[slot], tokens, matched * bs, limit)
            if best is None or n > best[1] or (n == best[1] and self._adoptable(slot, n)):
                best = (slot, n)  # at a tie, an entry adopted whole maps no page
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
        boundary page. Under ``offload_all`` the host blocks of ``tokens`` that follow the
        GPU's match are mapped and loaded after it (into a fresh slot when the GPU holds
        none of it).
        Raises `NoFreeSlotError` / `PoolExhaustedError` from the branch or for the pages the
        host blocks need (nothing changed); the caller may `evict_one` and retry.
        """
        tags = set(claim) | ({own_tag} if own_tag is not None else set())
        seed = chain_seed(salt)
        limit = min(len(tokens), max_tokens)
        claimed = self._best_claimed(tokens, max_tokens, tags, own_tag, seed)
        if claimed is not None and claimed[1] >= limit:
            return self._adopt(claimed[0], claimed[1], own_tag)  # nothing can match more
        found = self.lookup(tokens, max_tokens, salt)
        if claimed is not None and claimed[1] > 0 and (found is None or claimed[1] >= found[1]):
            best: tuple[int, int] | None = claimed
        else:
            best = found
        run = self._host_run_for(tokens, seed, best, limit)
        if run is not None:
            self._check_room(run)
        if best is None:
            hit = None
        elif best is claimed:
            hit = self._adopt(best[0], best[1], own_tag)
        else:  # a plain request's branch points are remembered for spares (`make_spare`)
            hit = self._branch_or_adopt(*best, note=not tags)
        if run is None:
            return hit
        if hit is None:
            hit = PrefixHit(self.arena.allocate(), 0, -1)
        return self._load_run(hit, run)

    def _adoptable(self, slot: int, n: int) -> bool:
        """Whether ``slot`` is an untagged entry holding exactly ``n`` tokens (adopted whole)."""
        entry = self._lru.get(slot)
        return entry is not None and entry.tag is None and self._sources[slot].num_tokens == n

    def _branch_or_adopt(self, source: int, n: int, note: bool = False) -> PrefixHit:
        """The untagged entry ``source`` adopted when it holds exactly ``n`` tokens, else a
        branch of ``source`` at ``n`` (``note``: a branch point `make_spare` may map ahead
        next time)."""
        entry = self._lru.get(source)
        self._await(source)
        if self._adoptable(source, n):
            assert entry is not None
            del self._lru[source]
            self._shadows.discard(source)
            self.spares_used += entry.spare
            return PrefixHit(source, n, source, source_tokens=n, rank=entry.rank,
                             priority=entry.priority)
        slot = self.arena.branch(source, n)
        if entry is not None:
            self._lru.move_to_end(source)
        if note:
            self._note_branch(self._sources[source], n)
        return PrefixHit(slot, n, source, source_tokens=self._sources[source].num_tokens)

    # ------------------------------------------------------------------ spares
    def _note_branch(self, src: _Source, n: int) -> None:
        """Count a branch of ``src``'s first ``n`` tokens (the last `MAX_BRANCH_POINTS`
        points kept)."""
        full = n // self.block_size
        if not full:
            return
        key = (src.seed, n, src.hashes[full - 1])
        point = self._branch_points.pop(key, None) or _BranchPoint(
            src.tokens[:n], src.hashes[:full], src.seed)
        point.branches += 1
        self._branch_points[key] = point
        while len(self._branch_points) > MAX_BRANCH_POINTS:
            self._branch_points.popitem(last=False)

    def make_spare(self, min_free_slots: int = 2, min_free_pages: int = 0) -> bool:
        """Map one spare ahead of an admission: for the most recent prefix that plain
        admissions (no tag claimed or owned: not an agent session's turn, whose entries its
        session owns) branched from at least `HOT_BRANCHES` times and that no untagged entry
        holds exactly, a branch of it kept as a plain untagged entry, which the next admission
        on that prefix adopts whole (no page mapped then). Done only with more than
        ``min_free_slots`` slots and ``min_free_pages`` pages free; a spare is an ordinary
        entry, evicted in its LRU turn. A prefix no slot holds any more is forgotten. True
        when one was made."""
        hot = [(key, p) for key, p in self._branch_points.items()
               if p.branches >= HOT_BRANCHES and not self._spare_ready(p, key[1])]
        if (not hot or self.arena.free_slots() <= min_free_slots
                or self.arena.pool.num_free < max(min_free_pages, 1)):
            return False
        for key, point in reversed(hot):
            seed, n, _ = key
            found = self._lookup(point.tokens, n, seed, point.hashes)
            if found is None or found[1] < n:  # gone from the GPU: noted again if branched
                del self._branch_points[key]
                continue
            if self._adoptable(found[0], n):  # an entry of exactly this prefix is there
                point.spare = found[0]
                continue
            slot = self.arena.branch(found[0], n)
            src = self._sources[slot] = _Source(list(point.tokens), 0, seed=seed)
            self._extend(slot, src, n)
            self._lru[slot] = _Entry(None, EntryRank.PLAIN, spare=True)
            point.spare = slot
            self.spares_made += 1
            return True
        return False

    def _spare_ready(self, point: _BranchPoint, n: int) -> bool:
        """Whether ``point``'s spare is still an entry of exactly its prefix (no lookup)."""
        slot = point.spare
        return (slot >= 0 and self._adoptable(slot, n)
                and self._sources[slot].hashes[-1:] == point.hashes[-1:])

    # ------------------------------------------------------------------ speculation in place
    def lendable(self, tag: CacheTag, tokens: list[int], keep: int,
                 salt: str | None = None) -> bool:
        """Whether `lend` would give a speculation of ``tokens`` the entry tagged ``tag``."""
        return self._lendable(tag, tokens, keep, chain_seed(salt)) is not None

    def lend(self, tag: CacheTag, tokens: list[int], keep: int,
             salt: str | None = None) -> PrefixHit:
        """The slot of the entry tagged ``tag`` (the most recent one), for a speculative
        prefill of ``tokens`` that continues it in place: the entry leaves the index's LRU
        (nothing can evict or adopt it) and stays a source; tokens it holds past those it shares
        with ``tokens`` are cut first (`KVArena.truncate`). Only when the shared prefix keeps at
        least ``keep`` tokens and every token of its owner's own KV (none of those is ever cut:
        only a speculative tail): check with `lendable`, else `KVMemoryError`.
        `PoolExhaustedError` from the cut leaves everything unchanged. `release` gives the slot
        back as the entry it was (its tag, class and priority then), the tokens past its
        owner's marked as its speculative tail; `release` of 0 tokens (`drop`) gives it back
        with that tail cut off."""
        found = self._lendable(tag, tokens, keep, chain_seed(salt))
        if found is None:
            raise KVMemoryError(f"no entry tagged {tag!r} that {len(tokens)} tokens continue")
        slot, n = found
        held = self._sources[slot].num_tokens
        self._await(slot)
        if n < held:  # first: a pool too short for its copy-on-write raises, nothing changed
            self.arena.truncate(slot, n)
            self._shrink(slot, n)
        entry = self._lru.pop(slot)
        self._shadows.discard(slot)
        if entry.own is None:
            entry.own = held
        self._lent[slot] = entry
        return PrefixHit(slot, n, slot, tag, held, rank=entry.rank, priority=entry.priority)

    def _lendable(self, tag: CacheTag, tokens: list[int], keep: int,
                  seed: int) -> tuple[int, int] | None:
        """``(slot, n)`` of the entry `lend` would give and the tokens it keeps; None if
        there is none."""
        if not self.enabled:
            return None
        slot = next((s for s, e in reversed(self._lru.items()) if e.tag == tag), None)
        if slot is None or self._sources[slot].seed != seed:
            return None
        src, entry = self._sources[slot], self._lru[slot]
        n = common_prefix_len(src.tokens, tokens, src.num_tokens)
        own = src.num_tokens if entry.own is None else entry.own
        return (slot, n) if n >= max(keep, own) else None

    def _give_back(self, slot: int, tokens: list[int], num_tokens: int) -> None:
        """A lent slot comes back as its entry, holding ``tokens[:num_tokens]`` (0: its owner's
        KV only, the tail cut off if the pool allows the cut; else the tail stays, as the
        owner's)."""
        entry = self._lent.pop(slot)
        src = self._sources[slot]
        if num_tokens:
            src.tokens = tokens[:num_tokens]  # a private copy, as `release` keeps
            self._extend(slot, src, num_tokens)
        else:
            src.tokens = src.tokens[:src.num_tokens]
        self._lru[slot] = entry
        if not num_tokens:
            self._cut_tail(slot)
        if entry.own is not None and entry.own >= src.num_tokens:
            entry.own = None  # nothing was speculated after the owner's KV
        self._write_behind(slot)

    def _cut_tail(self, slot: int) -> None:
        """Cut entry ``slot`` back to its owner's KV (it has no speculative tail after);
        when the pool cannot give the copy-on-write page of the cut, the tail stays, counted
        as the owner's from now on (valid KV, evicted with the entry)."""
        entry = self._lru[slot]
        own, entry.own = entry.own, None
        assert own is not None
        if own >= self._sources[slot].num_tokens:
            return
        self._await(slot)
        try:
            self.arena.truncate(slot, own)
        except PoolExhaustedError:
            return
        self._shrink(slot, own)
        self._shadows.discard(slot)

    def tail_pages(self) -> int:
        """Pages that entries' speculative tails map past their owners' KV."""
        arena = self.arena
        return sum(len(arena.slot_pages(slot)) - arena.pages_for(e.own)
                   for slot, e in self._lru.items() if e.own is not None)

    # ------------------------------------------------------------------ eviction
    def evict_one(self, max_rank: EntryRank = EntryRank.RETAINED,
                  protect: Collection[CacheTag] = (), pages: int | None = None,
                  spare: Collection[int] = ()) -> bool:
        """Free memory held by one entry of rank <= ``max_rank`` (tag not in ``protect``,
        slot not in ``spare``): the lowest rank, then the lowest priority, then the least
        recently used. The entry goes whole, unless ``pages`` are asked for and the policy is
        ``tail_first``: then only that many of its private pages go, from its tail, when it
        has more. False if there is no such entry."""
        victim: int | None = None
        best: tuple[int, float] | None = None
        tail = False  # the victim is an entry's speculative tail, not the entry
        for slot, entry in self._lru.items():
            if slot in spare or (entry.tag is not None and entry.tag in protect):
                continue
            for key, is_tail in ((entry.tail_key(), True), (entry.eviction_key(), False)):
                if key is not None and key[0] <= max_rank and (best is None or key < best):
                    victim, best, tail = slot, key, is_tail
        if victim is None:
            return False
        if tail:
            self._cut_tail(victim)
            return True
        if pages is not None and self.cache_policy.tail_first and self._trim(victim, pages):
            return True
        self._offload(victim)
        self._free_entry(victim)
        return True

    def restore(self, tag: CacheTag, evict: EntryRank | None = None,
                protect: Collection[CacheTag] = ()) -> bool:
        """Bring ``tag``'s KV back as the entry it was (most recently used): a branch of the
        longest prefix of its tokens the GPU holds (its full pages shared), then the host
        blocks after that prefix loaded into it (the blocks stay on the host). Without a free
        slot or pages it fails (False, nothing changes), unless entries of rank <= ``evict``
        (tags not in ``protect``) are evicted for it first; False also when the host adds
        nothing to what the GPU holds."""
        off = self._offloaded.get(tag)
        if off is None or self.offload is None:
            return False
        planned = self._record_run(off)
        if planned is None:
            return False
        source, run = planned
        slot = self._restore_slot(source, run, evict, {tag, *protect})
        if slot is None:
            return False
        self._pend(slot, self.offload.load(slot, run.blocks, run.start, run.end))
        self._drop_offloaded({tag}, demote=False)  # its blocks stay on the host
        src = self._sources[slot] = _Source(off.tokens[: run.end], 0, seed=off.seed)
        self._extend(slot, src, run.end)
        self._lru[slot] = _Entry(tag, EntryRank.RETAINED, off.priority)
        self.restored_total += 1
        return True

    def _restore_slot(self, source: int | None, run: _HostRun, evict: EntryRank | None,
                      protect: Collection[CacheTag]) -> int | None:
        """A new slot of ``run.end`` tokens whose first ``run.start`` are a branch of
        ``source`` (None: a fresh slot), evicting as `evict_one` allows (never ``source``
        before it is branched from); None if there is no room."""
        spare = () if source is None else (source,)
        while True:
            try:
                if source is None:
                    slot = self.arena.allocate()
                else:
                    self._await(source)
                    slot = self.arena.branch(source, run.start)
                break
            except (NoFreeSlotError, PoolExhaustedError) as e:
                if evict is None or not self.evict_one(evict, protect, pages_short(e), spare):
                    return None
        while True:
            try:
                self.arena.grow(slot, run.end)
                return slot
            except PoolExhaustedError as e:
                if evict is None or not self.evict_one(evict, protect, e.shortfall):
                    self.arena.free(slot)
                    return None

    def clear(self) -> int:
        """Free every entry and every host block (nothing offloaded); return how many entries.
        Live sources stay tracked."""
        self._drop_offloaded(set(self._offloaded))
        self._shadows.clear()
        n = 0
        while self._lru:
            self._free_entry(next(iter(self._lru)))
            n += 1
        if self.offload is not None:
            self.offload.clear()
        return n

    def check_integrity(self) -> None:
        """Raise `KVMemoryError` if the index disagrees with the sources, the arena or the
        host store."""
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
        if not set(self._lru) | set(self._lent) <= set(self._sources):
            raise KVMemoryError("an entry is not indexed")
        if set(self._lru) & set(self._lent):
            raise KVMemoryError("a lent entry is in the LRU")
        for slot, entry in self._lru.items():
            if entry.own is not None and not 0 < entry.own < self._sources[slot].num_tokens:
                raise KVMemoryError(f"slot {slot}: speculative tail after {entry.own} of "
                                    f"{self._sources[slot].num_tokens} tokens")
        if not self._shadows <= set(self._lru):
            raise KVMemoryError("a write-behind mark outlived its entry")
        store = self.offload
        if store is None:
            if self._offloaded:
                raise KVMemoryError("host records without a host store")
            return
        store.check_integrity()
        pins: dict[int, int] = {}
        for off in self._offloaded.values():
            for key in off.keys:
                pins[key] = pins.get(key, 0) + 1
        for key, n in pins.items():
            if store.held(key) is None or store.pins(key) != n:
                raise KVMemoryError(f"host block {key!r}: {n} record(s) hold it, the store "
                                    f"pins it {store.pins(key)} time(s)")

    # ------------------------------------------------------------------ the host tier
    def offload_store(self) -> HostKVStore:
        """The host store (`KVMemoryError` when offload is off)."""
        if self.offload is None:
            raise KVMemoryError("no host store attached")
        return self.offload

    def _offload(self, slot: int) -> None:
        """Before entry ``slot`` is freed: its KV to the host if the policy takes it (budget
        allowing), recorded by its tag if it is a paused session's."""
        entry = self._lru[slot]
        store = self.offload
        shadowed = slot in self._shadows
        self._shadows.discard(slot)
        retained = entry.tag is not None and entry.rank == EntryRank.RETAINED
        if store is None or not (retained or self.cache_policy.offload_all):
            return
        src = self._sources[slot]
        record = retained and self.cache_policy.session_records
        older = self._offloaded.pop(entry.tag, None) if record else None
        if older is not None:
            store.unpin(older.keys)  # superseded: its blocks count as room for these
        keys, copied = self._save(slot, 0)
        if not keys:  # over budget: dropped (an older record stays), recomputed at resume
            if older is not None:
                store.pin(older.keys)
                self._offloaded[entry.tag] = older
            return
        self.offloaded_total += 1
        if shadowed and not copied:
            self.shadow_hits += 1
        if record:
            store.pin(keys)
            self._offloaded[entry.tag] = _Offloaded(src.tokens[: src.num_tokens], keys,
                                                    entry.priority, src.seed)
        if older is not None:
            kept = set(keys)
            store.demote([k for k in older.keys if k not in kept])

    def _save(self, slot: int, first_block: int, partial: bool = True
              ) -> tuple[list[int], bool]:
        """Copy the blocks of source ``slot`` from block ``first_block`` on (its last,
        partly filled block too if ``partial``) to the host, those held already excepted;
        return the keys of the blocks held from ``first_block`` on (the copy stops at the
        first that does not fit) and whether anything was copied."""
        store = self.offload
        assert store is not None
        src = self._sources[slot]
        bs = self.block_size
        keys = src.hashes[first_block:]
        blocks = [BlockSave(key, i * bs, bs, (src.hashes[i - 1] if i else src.seed,
                                              tuple(src.tokens[i * bs:(i + 1) * bs])))
                  for i, key in enumerate(keys, first_block)]
        full = len(src.hashes) * bs
        if partial and full < src.num_tokens:
            prev = src.hashes[-1] if src.hashes else src.seed
            part = src.tokens[full:src.num_tokens]
            keys = [*keys, _chain(prev, part)]
            blocks.append(BlockSave(keys[-1], full, len(part), (prev, tuple(part))))
        ticket, held = store.save(slot, blocks)
        if ticket is not None:
            self._pend(slot, ticket)
        return keys[:held], ticket is not None

    def _write_behind(self, slot: int) -> None:
        """Copy to the host now the blocks of a ``RETAINED`` tagged entry whose eviction is
        near (the pool has fewer free pages than it maps), with an asynchronous copier only."""
        entry = self._lru[slot]
        store = self.offload
        if (store is None or not store.copier.asynchronous or slot in self._shadows
                or entry.tag is None or entry.rank != EntryRank.RETAINED
                or self.arena.pool.num_free >= len(self.arena.slot_pages(slot))):
            return
        keys, copied = self._save(slot, 0)
        if keys:
            self._shadows.add(slot)
            self.shadowed_total += copied

    def _write_through(self, slot: int, first_block: int) -> None:
        """Copy source ``slot``'s full blocks from ``first_block`` on to the host (policy
        ``write_through``)."""
        if self.offload is not None and self.cache_policy.write_through:
            self._save(slot, first_block, partial=False)

    def _record_run(self, off: _Offloaded) -> tuple[int | None, _HostRun] | None:
        """Where a restore of record ``off`` would start (a source holding its longest prefix
        on the GPU, None: none) and the host blocks that extend it; None if they add
        nothing."""
        found = self._lookup(off.tokens, len(off.tokens), off.seed, off.keys)
        source, n = found if found is not None else (None, 0)
        run = self._host_run(off.tokens, off.seed, off.keys, n, len(off.tokens))
        return None if run is None else (source, run)

    def _host_run_for(self, tokens: list[int], seed: int, best: tuple[int, int] | None,
                      limit: int) -> _HostRun | None:
        """Under ``offload_all``: the host blocks extending the GPU's match ``best`` of
        ``tokens`` (at most ``limit``); None if none does."""
        if self.offload is None or not self.cache_policy.offload_all:
            return None
        if best is None:
            return self._host_run(tokens, seed, (), 0, limit)
        slot, n = best  # the source's hashes are the prompt's below the match only
        return self._host_run(tokens, seed, self._sources[slot].hashes[: n // self.block_size],
                              n, limit)

    def _host_run(self, tokens: list[int], seed: int, keys: Sequence[int], start: int,
                  limit: int) -> _HostRun | None:
        """The host blocks holding ``tokens[start:end]`` for the largest ``end <= limit``
        (``keys``: the chain hashes of the first blocks where known; those of the full blocks
        before ``start``'s that ``keys`` lacks are chained here, as when another source holds
        more of the prefix on the GPU than a record's host blocks cover); None if the host
        holds nothing past ``start``."""
        store = self.offload
        assert store is not None
        bs = self.block_size
        i = start // bs
        known = min(i, len(keys))
        prev = keys[known - 1] if known else seed
        for j in range(known, i):  # the chain up to start's block past the keys given
            prev = _chain(prev, tokens[j * bs:(j + 1) * bs])
        blocks: list[tuple[int, int]] = []
        end = start
        while i * bs < limit:
            block = tokens[i * bs:(i + 1) * bs]
            key = keys[i] if i < len(keys) and len(block) == bs else _chain(prev, block)
            if len(block) == bs and store.held(key) == (bs, (prev, tuple(block))):
                blocks.append((key, i * bs))
                end, prev, i = min((i + 1) * bs, limit), key, i + 1
                continue
            part = self._held_part(prev, block[:bs - 1])
            if part is not None:
                blocks.append((part[0], i * bs))
                end = min(i * bs + part[1], limit)
            break
        return _HostRun(blocks, start, end) if end > start else None

    def _held_part(self, prev: int, tokens: list[int]) -> tuple[int, int] | None:
        """``(key, n)`` of the longest partial block ``tokens[:n]`` after chain hash ``prev``
        that the host holds (a sequence's last block); None if none."""
        store = self.offload
        assert store is not None
        for n in range(len(tokens), 0, -1):
            part = tokens[:n]
            key = _chain(prev, part)
            if store.held(key) == (n, (prev, tuple(part))):
                return key, n
        return None

    def _check_room(self, run: _HostRun) -> None:
        """Raise `PoolExhaustedError` (nothing changed) unless the pool has the pages of a
        hit of ``run.end`` tokens whose first ``run.start`` the GPU holds: at most those past
        the shared full pages of that prefix (a branch's boundary page, or an adopted entry's
        copy-on-write, included)."""
        arena = self.arena
        shared = run.start * arena.spec.token_bytes // arena.page_size
        need = arena.pages_for(run.end) - shared
        if need > arena.pool.num_free:
            raise PoolExhaustedError(need, arena.pool.num_free)

    def _load_run(self, hit: PrefixHit, run: _HostRun) -> PrefixHit:
        """Map ``hit``'s slot for ``run.end`` tokens and load the host blocks into it (``hit``
        as it is if the pool is short after all)."""
        assert self.offload is not None and hit.num_tokens == run.start
        try:
            self.arena.grow(hit.slot, run.end)
        except PoolExhaustedError:
            return hit
        self._pend(hit.slot, self.offload.load(hit.slot, run.blocks, run.start, run.end))
        self._await(hit.slot)  # the sequence's first step runs after the copy (on the GPU)
        self.restored_total += 1
        return PrefixHit(hit.slot, run.end, hit.source, hit.claimed, hit.source_tokens,
                         hit.committed, hit.rank, hit.priority, run.end - run.start)

    def _drop_offloaded(self, tags: set[CacheTag], demote: bool = True) -> None:
        """Forget the host records of ``tags``; with ``demote`` their blocks no other record
        holds are the first to leave the host."""
        for tag in tags & self._offloaded.keys():
            off = self._offloaded.pop(tag)
            store = self.offload_store()
            store.unpin(off.keys)
            if demote:
                store.demote(off.keys)

    # ------------------------------------------------------------------ copies in flight
    def _pend(self, slot: int, ticket: CopyTicket) -> None:
        """Remember a copy that may still run on ``slot``."""
        if not ticket.done:
            running = [t for t in self._pending.get(slot, ()) if not t.done]
            self._pending[slot] = [*running, ticket]

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

    # ------------------------------------------------------------------ internals
    def _trim(self, slot: int, pages: int) -> bool:
        """Tail-first eviction: unmap the last ``pages`` pages of entry ``slot`` when they
        are private and some private page stays (its KV to the host first under
        ``offload_all``); False (nothing done) when the entry should go whole instead: it has
        no more private pages than asked for, or it is a paused session's whose KV goes to the
        host by its tag (``session_records``)."""
        entry = self._lru[slot]
        if (self.offload is not None and self.cache_policy.session_records
                and entry.tag is not None and entry.rank == EntryRank.RETAINED):
            return False
        arena = self.arena
        mapped = arena.slot_pages(slot)
        tail = 0
        for page in reversed(mapped):
            if arena.pool.refcount(page) != 1:
                break
            tail += 1
        if not 0 < pages < tail:
            return False
        src = self._sources[slot]
        n = min(self._tokens_within(len(mapped) - pages), src.num_tokens)
        if n <= 0 or n * arena.spec.token_bytes // arena.page_size < len(mapped) - tail:
            return False  # the new frontier would fall on a shared page
        if self.offload is not None and self.cache_policy.offload_all:
            self._save(slot, n // self.block_size)
        self._await(slot)
        before = len(mapped)
        arena.truncate(slot, n)
        self._shrink(slot, n)
        if entry.own is not None and entry.own >= n:
            entry.own = None  # the trim took the speculative tail
        self.trimmed_pages += before - len(arena.slot_pages(slot))
        return True

    def _tokens_within(self, num_pages: int) -> int:
        """The most tokens a slot may hold in ``num_pages`` pages (read alignment kept)."""
        arena = self.arena
        n = num_pages * arena.page_size // arena.spec.token_bytes
        n -= n % arena.read_align
        while n > 0 and arena.pages_for(n) > num_pages:
            n -= arena.read_align
        return max(n, 0)

    def _free_entry(self, slot: int) -> None:
        del self._lru[slot]
        self._shadows.discard(slot)
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
        if n < held:  # first: a pool too short for its copy-on-write raises, nothing changed
            self.arena.truncate(slot, n)
            self._shrink(slot, n)
        entry = self._lru.pop(slot)
        self._shadows.discard(slot)
        committed: list[int] = []
        if own_tag is not None and entry.tag != own_tag:
            for old in self.tagged(own_tag):
                del self._lru[old]
                self._shadows.discard(old)
                self._await(old)
                self._unindex(old)
                self.arena.commit(old, slot)  # retired: reclaimed after the step
                committed.append(old)
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
        """Index the full blocks of ``src.tokens[:num_tokens]`` not indexed yet (and, policy
        ``write_through``, copy them to the host)."""
        if num_tokens < src.num_tokens:
            raise KVMemoryError(f"slot {slot}: source shrank from {src.num_tokens} to {num_tokens}")
        bs = self.block_size
        first = len(src.hashes)
        prev = src.hashes[-1] if src.hashes else src.seed
        for i in range(first, num_tokens // bs):
            prev = _chain(prev, src.tokens[i * bs:(i + 1) * bs])
            src.hashes.append(prev)
            self._index.setdefault(prev, {})[slot] = None
        src.num_tokens = num_tokens
        if len(src.hashes) > first:
            self._write_through(slot, first)

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
