"""The offload tier: paused sessions' KV copied to host memory on eviction, restored later."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import PAGE, SPEC, filled, host_arena, kv_values
from tiers import examples

from edmm.engine import (
    KVCacheManager,
    PrefixCache,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
)
from edmm.engine.kv_policy import CACHE_POLICIES
from edmm.engine.prefix_cache import EntryRank
from edmm.engine.sequence import SlotHints
from edmm.memory import KVArena, KVMemoryError
from edmm.memory.offload import BlockSave, HostBlocks, HostKVStore

# 512 B per token, 8 tokens per 4 KiB page; 12 pages.
TOKENS = list(range(1, 41))  # 40 tokens: 5 pages


@pytest.fixture
def arena() -> Iterator[KVArena]:
    with host_arena(num_pages=12) as a:
        yield a


def _retain(cache: PrefixCache, arena: KVArena, tokens: list[int], tag: str) -> None:
    """A paused session's entry: ``tokens`` written to a fresh slot, released RETAINED."""
    cache.release(filled(arena, tokens), tokens, len(tokens), tag=tag, rank=EntryRank.RETAINED)


def _blocks(tokens: list[int], bt: int = 4, key: str = "k") -> list[BlockSave]:
    """Blocks of ``bt`` tokens covering a slot of ``tokens`` (the last one partial), keyed
    ``(key, i)``, with the block's tokens as their meta."""
    return [BlockSave((key, i), start, min(bt, len(tokens) - start),
                      tuple(tokens[start:start + bt]))
            for i, start in enumerate(range(0, len(tokens), bt))]


def test_store_round_trip_dedup_and_budget(arena: KVArena) -> None:
    """Ten blocks fill a 40-token budget and come back byte for byte into another slot; a
    block held is never copied again; a save past the budget makes room from the least
    recently used unpinned block (a sequence's tail first), never a pinned one."""
    store = HostKVStore(arena, capacity_bytes=40 * SPEC.token_bytes, block_tokens=4)
    slot = filled(arena, TOKENS)
    blocks = _blocks(TOKENS)
    ticket, held = store.save(slot, blocks)
    assert ticket is not None and held == 10 and store.used_bytes == 40 * SPEC.token_bytes
    assert store.counters.saved_bytes == 40 * SPEC.token_bytes
    assert store.save(slot, blocks) == (None, 10)  # held: nothing copied
    assert store.counters.saves == 1 and store.held(("k", 3)) == (4, tuple(TOKENS[12:16]))
    other = arena.allocate()
    arena.grow(other, 40)
    store.load(other, [(b.key, b.start) for b in blocks[2:]], 10, 40)  # from inside a block
    assert kv_values(arena, other)[10:] == TOKENS[10:]
    store.pin([b.key for b in blocks])
    extra = [BlockSave("x", 0, 4)]
    assert store.save(slot, extra) == (None, 0)  # every block pinned: no room
    store.unpin([b.key for b in blocks])
    store.pin([b.key for b in blocks[:9]])
    ticket, held = store.save(slot, extra)
    assert held == 1 and store.held(("k", 9)) is None  # the tail's last block left
    assert store.evicted_blocks == 1 and store.pins(("k", 0)) == 1
    with pytest.raises(KVMemoryError, match="unpinned more than pinned"):
        store.unpin(["x"])
    with pytest.raises(KVMemoryError, match="no host block"):
        store.load(other, [(("k", 9), 36)], 36, 40)
    store.clear()
    assert store.used_bytes == 0 and store.num_held == 0
    store.check_integrity()


def test_consecutive_blocks_are_one_copy_and_scattered_ones_round_trip(arena: KVArena) -> None:
    """Blocks consecutive in the slot and in the buffer are one copy; a chain whose blocks
    land in two runs of the buffer (what evicted blocks leave free) is two copies under one
    ticket, counted once, and comes back byte for byte."""
    store = HostKVStore(arena, capacity_bytes=6 * PAGE + 100, block_tokens=8)  # 8 tokens: a page
    assert store.blocks.num_blocks == 6 and store.block_bytes == PAGE
    slot = filled(arena, TOKENS)
    for key in ("a", "b", "c"):
        assert store.save(slot, _blocks(TOKENS[:16], 8, key))[1] == 2
    assert store.num_held == 6 and store.blocks.num_free == 0
    store.demote([("a", 0), ("a", 1), ("c", 0), ("c", 1)])  # blocks 0-1 and 4-5 leave first
    chain = _blocks(TOKENS[:32], 8, "d")
    ticket, held = store.save(slot, chain)
    assert held == 4 and ticket is not None and ticket.nbytes == 32 * SPEC.token_bytes
    assert store.counters.saves == 4 and store.held(("b", 0)) is not None
    keys = [(b.key, b.start) for b in chain]
    assert len(store.load_pairs(slot, keys, 0, 32)) == 2  # blocks 0-1, then 4-5
    assert len(store.load_pairs(slot, keys[:2], 0, 16)) == 1
    other = arena.allocate()
    arena.grow(other, 32)
    store.load(other, keys, 0, 32)
    assert kv_values(arena, other) == TOKENS[:32]
    assert torch.equal(store.host_bytes(("d", 1)), arena.token_bytes_view(slot, 8, 16))
    store.check_integrity()


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(1, 24), st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=40))
def test_host_blocks_match_a_set_of_free_blocks(num_blocks: int,
                                                ops: list[tuple[bool, int]]) -> None:
    """`HostBlocks` against a plain set of free block indices: every take hands out exactly
    ``n`` blocks that were free (one run when a free run is long enough), every give returns
    them, and the free runs stay sorted, disjoint and maximal."""
    blocks, free, held = HostBlocks(num_blocks), set(range(num_blocks)), []
    for take, n in ops:
        if take or not held:
            runs = blocks.take(n)
            if n > len(free):
                assert runs is None
                continue
            assert runs is not None
            got = [b for first, count in runs for b in range(first, first + count)]
            assert len(got) == n and set(got) <= free and len(set(got)) == n
            longest = max((count for _, count in _runs(free)), default=0)
            assert runs == tuple(sorted(runs)) and (len(runs) == 1 or longest < n or n == 0)
            free -= set(got)
            if runs:
                held.append(runs)
        else:
            runs = held.pop(n % len(held))
            blocks.give(runs)
            free |= {b for first, count in runs for b in range(first, first + count)}
        assert blocks.num_free == len(free) and blocks.free == _runs(free)
    with pytest.raises(KVMemoryError, match="given back twice"):
        blocks.give(((0, num_blocks),)) if len(free) else blocks.give(held[0] + held[0])


def _runs(free: set[int]) -> list[tuple[int, int]]:
    """Maximal runs of a set of block indices, ascending."""
    out: list[tuple[int, int]] = []
    for b in sorted(free):
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def test_evicted_session_is_offloaded_and_restored(arena: KVArena) -> None:
    store = HostKVStore(arena, capacity_bytes=1 << 20, block_tokens=4)
    cache = PrefixCache(arena, block_size=4, offload=store)
    slot = filled(arena, TOKENS)
    cache.release(slot, TOKENS, 40, tag="s1", rank=EntryRank.RETAINED, priority=3.0)
    plain = filled(arena, [7] * 16)
    cache.release(plain, [7] * 16, 16)  # a plain entry goes first, and is not offloaded
    assert cache.evict_one() and cache.offloaded_tokens("s1") == 0
    assert cache.evict_one()  # the session: copied to the host, its pages freed
    assert cache.offloaded_tokens("s1") == 40 and arena.pool.num_used == 0
    assert cache.num_entries == 0 and cache.offloaded_total == 1
    cache.check_integrity()
    assert cache.restore("s1")  # what the scheduler does before admitting the resume
    hit = cache.acquire([*TOKENS, 99], max_tokens=100, claim=("s1",))
    assert hit is not None and hit.num_tokens == 40 and hit.claimed == "s1"
    assert kv_values(arena, hit.slot) == TOKENS
    assert cache.offloaded_tokens("s1") == 0 and cache.restored_total == 1
    assert store.used_bytes == 40 * SPEC.token_bytes  # the host copy stays: a later
    saves = store.counters.saves  # offload of the same KV copies nothing
    cache.release(hit.slot, TOKENS, 40, tag="s1", rank=EntryRank.RETAINED)
    assert cache.evict_one() and store.counters.saves == saves
    assert cache.offloaded_tokens("s1") == 40 and cache.restore("s1")
    (slot,) = cache.tagged("s1")
    assert kv_values(arena, slot) == TOKENS
    cache.check_integrity()


@pytest.mark.parametrize("policy", ["sessions", "tiered"])
def test_a_session_waiting_for_its_user_comes_back_from_the_host_under_tiered(
        arena: KVArena, policy: str) -> None:
    """A session whose turn ended without a tool call (its KV a plain entry while the user
    writes) and a paused session are both evicted. ``sessions`` takes only the paused one to
    the host (by its tag); ``tiered`` takes both: the paused one by its tag, the other by its
    blocks, which the user's next turn (a prompt sharing its first 32 tokens, the earlier
    reasoning dropped after them) loads back instead of recomputing."""
    store = HostKVStore(arena, capacity_bytes=1 << 20, block_tokens=4)
    cache = PrefixCache(arena, block_size=4, offload=store, cache_policy=CACHE_POLICIES[policy])
    ended = list(range(100, 140))
    cache.release(filled(arena, ended), ended, 40)
    _retain(cache, arena, TOKENS, "paused")
    while cache.evict_one():
        pass
    assert arena.pool.num_used == 0 and cache.offloaded_tokens("paused") == 40
    user_turn = [*ended[:32], 7, 8, 9]
    hit = cache.acquire(user_turn, max_tokens=len(user_turn))
    if policy == "sessions":
        assert hit is None  # recomputed from its first token
    else:
        assert hit is not None and hit.num_tokens == 32
        assert kv_values(arena, hit.slot)[:32] == ended[:32]
        cache.release(hit.slot, user_turn[:32], 32)
    assert cache.restore("paused")
    (slot,) = cache.tagged("paused")
    assert kv_values(arena, slot) == TOKENS
    cache.check_integrity()


def test_restore_without_room_changes_nothing(arena: KVArena) -> None:
    store = HostKVStore(arena, capacity_bytes=1 << 20, block_tokens=4)
    cache = PrefixCache(arena, block_size=4, offload=store)
    _retain(cache, arena, TOKENS, "s1")
    assert cache.evict_one()
    hog = arena.allocate()
    arena.grow(hog, 64)  # 8 of 12 pages: 4 left, the session needs 5
    assert not cache.restore("s1", evict=EntryRank.PLAIN) and cache.offloaded_tokens("s1") == 40
    cache.check_integrity()
    arena.free(hog)
    assert cache.restore("s1") and cache.num_entries == 1
    assert kv_values(arena, cache.tagged("s1")[0]) == TOKENS


def test_budget_discard_and_clear_release_host_copies(arena: KVArena) -> None:
    """A 48-token budget holds one 40-token session, the blocks of a second one fit only as
    far as the budget goes (its records cover that prefix); a discarded or untagged session's
    blocks are the first to leave; `clear` empties the host."""
    store = HostKVStore(arena, capacity_bytes=48 * SPEC.token_bytes, block_tokens=4)
    cache = PrefixCache(arena, block_size=4, offload=store)
    other = [t + 100 for t in TOKENS]
    _retain(cache, arena, TOKENS, "a")
    _retain(cache, arena, other, "b")
    assert cache.evict_one() and cache.evict_one()
    assert cache.offloaded_tokens("a") == 40 and cache.offloaded_tokens("b") == 8  # no room
    cache.check_integrity()
    assert cache.discard(["a"]) == 0 and cache.offloaded_tokens("a") == 0
    assert store.used_bytes == 48 * SPEC.token_bytes and store.pins(cache_key(TOKENS, 0)) == 0
    _retain(cache, arena, [t + 200 for t in TOKENS], "c")
    assert cache.evict_one() and cache.offloaded_tokens("c") == 40  # a's blocks made room
    assert cache.offloaded_tokens("b") == 8  # b's are pinned by its record
    assert cache.untag(["c"], EntryRank.PLAIN) == 0 and cache.offloaded_tokens("c") == 0
    _retain(cache, arena, TOKENS, "d")
    assert cache.evict_one() and cache.offloaded_tokens("d") == 40
    _retain(cache, arena, TOKENS[:8], "d")
    assert cache.clear() == 1 and store.used_bytes == 0 and cache.offloaded_tokens("d") == 0
    cache.check_integrity()


def cache_key(tokens: list[int], block: int, bs: int = 4) -> int:
    """The prefix index's chain hash of block ``block`` of unsalted ``tokens``."""
    from edmm.engine.prefix_cache import _chain, chain_seed

    key = chain_seed(None)
    for i in range(block + 1):
        key = _chain(key, tokens[i * bs:(i + 1) * bs])
    return key


def test_make_room_evicts_plain_entries_to_restore(arena: KVArena) -> None:
    store = HostKVStore(arena, capacity_bytes=1 << 20, block_tokens=4)
    cache = PrefixCache(arena, block_size=4, offload=store)
    _retain(cache, arena, TOKENS, "s1")
    assert cache.evict_one()
    other = [5] * 64
    cache.release(filled(arena, other), other, 64)  # a plain entry: 8 of 12 pages
    assert not cache.restore("s1")  # a prefetch makes no room
    assert cache.restore("s1", evict=EntryRank.PLAIN)  # a resume does
    hit = cache.acquire(TOKENS, max_tokens=39, claim=("s1",))
    assert hit is not None and hit.num_tokens == 39 and cache.num_entries == 0
    assert kv_values(arena, hit.slot) == TOKENS[:39]
    cache.check_integrity()
    arena.free(hit.slot)


def test_newer_copy_replaces_the_older_within_the_budget(arena: KVArena) -> None:
    """A session offloaded twice (24 tokens, later 40): the budget holds one 40-token copy;
    the later copy copies only its 4 new blocks (the first 6 are held) and replaces the older
    record; a successor that does not fit keeps what fits, its first 40 tokens."""
    store = HostKVStore(arena, capacity_bytes=40 * SPEC.token_bytes, block_tokens=4)
    cache = PrefixCache(arena, block_size=4, offload=store)
    _retain(cache, arena, TOKENS[:24], "s1")
    assert cache.evict_one() and cache.offloaded_tokens("s1") == 24
    _retain(cache, arena, TOKENS, "s1")
    assert cache.evict_one() and cache.offloaded_tokens("s1") == 40
    assert store.counters.saved_bytes == 40 * SPEC.token_bytes and store.num_held == 10
    cache.check_integrity()
    _retain(cache, arena, [*TOKENS, *range(41, 49)], "s1")  # 48 tokens: over the budget
    assert cache.evict_one() and cache.offloaded_tokens("s1") == 40
    cache.check_integrity()
    assert cache.restore("s1")
    hit = cache.acquire([*TOKENS, 99], max_tokens=100, claim=("s1",))
    assert hit is not None and hit.num_tokens == 40 and kv_values(arena, hit.slot) == TOKENS
    arena.free(hit.slot)


def test_a_resume_restore_evicts_other_sessions_to_the_host_never_its_own(
        arena: KVArena) -> None:
    """The pool full of another paused session: a resume's restore moves that one to the host
    (a copy each way, no recompute) instead of failing; a protected tag is never the victim."""
    store = HostKVStore(arena, capacity_bytes=1 << 20, block_tokens=4)
    cache = PrefixCache(arena, block_size=4, offload=store)
    _retain(cache, arena, TOKENS, "s1")
    assert cache.evict_one() and cache.offloaded_tokens("s1") == 40
    other = [9] * 56  # 7 of 12 pages: 5 left, s1 needs 5 ... plus the boundary page
    _retain(cache, arena, other, "s2")
    hog = arena.allocate()
    arena.grow(hog, 8)  # one more page: s1 no longer fits beside s2
    assert not cache.restore("s1", evict=EntryRank.RETAINED, protect=("s2",))
    assert cache.offloaded_tokens("s1") == 40 and cache.offloaded_tokens("s2") == 0
    assert cache.restore("s1", evict=EntryRank.RETAINED)
    assert cache.offloaded_tokens("s2") == 56 and cache.offloaded_tokens("s1") == 0
    assert kv_values(arena, cache.tagged("s1")[0]) == TOKENS
    cache.check_integrity()
    arena.free(hog)


def test_a_prefetch_takes_free_pages_and_speculation_entries_only(arena: KVArena) -> None:
    """`KVCacheManager.restore` (a prefetch) never evicts a plain or retained entry for the
    copy it brings back: a plain one (a turn that just ended) would be recomputed."""
    store = HostKVStore(arena, capacity_bytes=1 << 20, block_tokens=4)
    cache = PrefixCache(arena, block_size=4, offload=store)
    kv = KVCacheManager(arena, cache)
    _retain(cache, arena, TOKENS, "soon")
    assert cache.evict_one()
    for rank in (EntryRank.PLAIN, EntryRank.RETAINED):
        other = [9] * 56
        cache.release(filled(arena, other), other, 56, tag="other", rank=rank, priority=0.0)
        hog = arena.allocate()
        arena.grow(hog, 8)
        assert not kv.restore("soon") and cache.offloaded_tokens("soon") == 40
        assert cache.tagged("other") and cache.offloaded_tokens("other") == 0
        cache.discard(["other"])
        arena.free(hog)
    branch = [9] * 56
    cache.release(filled(arena, branch), branch, 56, tag="b", rank=EntryRank.SPECULATIVE)
    hog = arena.allocate()
    arena.grow(hog, 8)
    assert kv.restore("soon") and not cache.tagged("b")
    cache.check_integrity()
    arena.free(hog)


def test_restore_claimed_pushes_other_paused_sessions_out_for_a_resume(
        arena: KVArena) -> None:
    """What the scheduler calls before admitting a resume (`KVCacheManager.restore_claimed`):
    with the pool full of other paused sessions the claimed copy still comes back."""
    from edmm.engine.kv_manager import KVCacheManager

    store = HostKVStore(arena, capacity_bytes=1 << 20, block_tokens=4)
    kv = KVCacheManager(arena, PrefixCache(arena, block_size=4, offload=store))
    _retain(kv._index, arena, TOKENS, "s1")
    assert kv.make_room() and kv.offloaded_tokens("s1") == 40
    _retain(kv._index, arena, [9] * 56, "s2")
    _retain(kv._index, arena, [8] * 32, "s3")  # 7 + 4 of 12 pages: s1's 5 do not fit
    assert not kv.restore("s1")  # a prefetch does not outrank sessions of its own priority
    kv.restore_claimed({"s1", "s3"})  # a resume claiming s1 (and s3, protected)
    assert kv.offloaded_tokens("s1") == 0 and kv.offloaded_tokens("s2") == 56
    assert kv.offloaded_tokens("s3") == 0 and kv.tagged("s3")
    kv.check_integrity()


def _scheduler(arena: KVArena, budget: int) -> tuple[Scheduler, PrefixCache]:
    store = HostKVStore(arena, capacity_bytes=1 << 20, block_tokens=4)
    cache = PrefixCache(arena, block_size=4, offload=store)
    return Scheduler(KVCacheManager(arena, cache),
                     SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4)), cache


def _step(sched: Scheduler) -> list[tuple[str, int, int]]:
    batch = sched.schedule()
    sched.update(batch, [7 if s.sample else None for s in batch.seqs])
    sched.check_integrity()
    return [(s.request_id, s.start, len(s.token_ids)) for s in batch.seqs]


def test_a_resume_waits_for_its_host_copy_rather_than_recomputing(arena: KVArena) -> None:
    """While others run, a resume whose copy does not fit yet is not admitted into a fresh
    slot (a chunk would fit there): it waits, then restores and computes only what is new."""
    sched, cache = _scheduler(arena, budget=16)
    _retain(cache, arena, TOKENS, "s")  # 40 tokens: 5 of the 12 pages
    assert cache.evict_one() and cache.offloaded_tokens("s") == 40
    a = Sequence.new("a", [9] * 60, SamplingParams(max_tokens=2))  # 8 pages once prefilled
    sched.add(a)
    while a.num_computed_tokens < 60:
        _step(sched)
    resume = Sequence.new("r", [*TOKENS, 1, 2, 3, 4], SamplingParams(max_tokens=2),
                          hints=SlotHints(tag="s"))
    sched.add(resume)
    assert _step(sched) == [("a", 60, 1)]  # 4 pages free: the copy (5) does not fit
    assert resume.status == SequenceStatus.WAITING and cache.offloaded_tokens("s") == 40
    sched.finish(a, "stop")
    assert _step(sched) == [("r", 40, 4)]  # restored: only the new tokens computed
    assert resume.num_cached_tokens == 40 and cache.offloaded_tokens("s") == 0


def test_an_adopted_session_entry_given_back_unused_stays_retained(arena: KVArena) -> None:
    sched, cache = _scheduler(arena, budget=64)
    _retain(cache, arena, TOKENS, "s")  # 5 pages
    a = Sequence.new("a", [9] * 55, SamplingParams(max_tokens=2))  # 7 pages: the pool is full
    sched.add(a)
    _step(sched)
    resume = Sequence.new("r", [*TOKENS, 1, 2, 3, 4], SamplingParams(max_tokens=2),
                          hints=SlotHints(tag="s"))
    sched.add(resume)
    assert _step(sched) == [("a", 55, 1)]  # r adopted s's entry, could not grow it: gave it back
    (slot,) = cache.tagged("s")
    assert resume.status == SequenceStatus.WAITING
    assert slot not in cache.entry_slots(EntryRank.PLAIN)  # still a retained session's KV


@pytest.mark.parametrize(("policy", "resumed_at"),
                         [("sessions", 0), ("apc", 40), ("blocks", 48), ("tiered", 48)])
def test_a_preempted_turn_comes_back_from_where_the_policy_kept_it(
        arena: KVArena, policy: str, resumed_at: int) -> None:
    """Two decoding sequences outgrow the 12 pages; the later one is preempted with 48 tokens
    computed. ``sessions`` evicts its entry whole (recomputed from 0); ``apc`` frees only the
    page the other sequence lacks, from its tail, and keeps the rest while it waits (40
    tokens reused); ``blocks`` wrote every block through to the host, so the readmission loads
    all 48 and recomputes nothing; ``tiered`` copies to the host what an eviction takes, as it
    takes it, so the readmission loads all 48 too."""
    store = HostKVStore(arena, capacity_bytes=1 << 20, block_tokens=4)
    cache = PrefixCache(arena, block_size=4, offload=store, cache_policy=CACHE_POLICIES[policy])
    sched = Scheduler(KVCacheManager(arena, cache),
                      SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4))
    a = Sequence.new("a", list(range(1, 41)), SamplingParams(max_tokens=20))
    b = Sequence.new("b", list(range(100, 142)), SamplingParams(max_tokens=12))
    sched.add(a)
    sched.add(b)
    steps = [_step(sched) for _ in range(9)]
    assert steps[-1] == [("a", 47, 1)] and b.num_preemptions == 1  # b held 48 tokens
    assert _step(sched) == [("a", 48, 1)] and _step(sched) == [("a", 49, 1)]  # b waits
    sched.finish(a, "stop")
    (readmitted,) = _step(sched)
    assert readmitted == ("b", resumed_at, 49 - resumed_at)
    loaded = 48 if policy in ("blocks", "tiered") else 0
    assert store.counters.loaded_bytes == loaded * SPEC.token_bytes


def test_an_admission_never_trims_the_kv_it_loaded_even_with_nothing_running(
        arena: KVArena, monkeypatch: pytest.MonkeyPatch) -> None:
    """``blocks``, nothing running: a prompt's 56 host tokens fill the 7 free pages, and its
    first chunk needs one page more. The slot it loaded goes back to the cache as a plain
    entry, the lowest class; trimming its tail would only have the retry load that page
    again (for ever). The paused session's entry is evicted instead, and the retry adopts the
    loaded KV: no block is loaded twice."""
    store = HostKVStore(arena, capacity_bytes=1 << 20, block_tokens=4)
    cache = PrefixCache(arena, block_size=4, offload=store,
                        cache_policy=CACHE_POLICIES["blocks"])
    prompt = list(range(100, 160))  # 60 tokens: 7.5 pages
    cache.release(filled(arena, prompt[:56]), prompt[:56], 56)
    assert cache.evict_one() and arena.stats().slots_in_use == 0  # its KV: on the host only
    _retain(cache, arena, TOKENS, "paused")  # 5 pages; 7 free
    kv = KVCacheManager(arena, cache)
    calls = 0
    make_room = kv.make_room

    def counted(*args: object, **kwargs: object) -> bool:
        nonlocal calls
        calls += 1
        assert calls < 10, "admission loops: evicting what it reloads"
        return make_room(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kv, "make_room", counted)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4))
    sched.add(Sequence.new("r", prompt, SamplingParams(max_tokens=2)))
    assert _step(sched) == [("r", 56, 4)]
    assert store.counters.loaded_bytes == 56 * SPEC.token_bytes
    (paused,) = cache.tagged("paused")  # tail-first: its last page went (to the host)
    assert arena.num_tokens(paused) == 32 and kv_values(arena, paused) == TOKENS[:32]
