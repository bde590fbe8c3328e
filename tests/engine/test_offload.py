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
from edmm.engine.prefix_cache import EntryRank
from edmm.engine.sequence import SlotHints
from edmm.memory import KVArena, KVMemoryError
from edmm.memory.offload import HostBlocks, HostKVStore

# 512 B per token, 8 tokens per 4 KiB page; 12 pages.
TOKENS = list(range(1, 41))  # 40 tokens: 5 pages


@pytest.fixture
def arena() -> Iterator[KVArena]:
    with host_arena(num_pages=12) as a:
        yield a


def _retain(cache: PrefixCache, arena: KVArena, tokens: list[int], tag: str) -> None:
    """A paused session's entry: ``tokens`` written to a fresh slot, released RETAINED."""
    cache.release(filled(arena, tokens), tokens, len(tokens), tag=tag, rank=EntryRank.RETAINED)


def test_store_round_trip_and_budget(arena: KVArena) -> None:
    store = HostKVStore(arena, capacity_bytes=40 * SPEC.token_bytes)
    slot = filled(arena, TOKENS)
    host = store.save(slot, 40)
    assert host is not None and host.nbytes == 40 * SPEC.token_bytes == store.used_bytes
    assert store.save(slot, 1) is None  # over budget: nothing copied
    other = arena.allocate()
    arena.grow(other, 40)
    store.load(host, other)
    assert kv_values(arena, other) == TOKENS
    store.release(host)
    assert store.used_bytes == 0 and store.num_held == 0
    with pytest.raises(KVMemoryError, match="released twice"):
        store.release(host)


def test_a_copy_over_fragmented_blocks_round_trips_in_one_ticket(arena: KVArena) -> None:
    """Three 2-block copies fill a 6-block budget; the first and last are released, so the
    4 free blocks are two runs apart: a 32-token (4-block) copy takes both runs, is one
    copy (one ticket, counted once) and comes back byte for byte."""
    store = HostKVStore(arena, capacity_bytes=6 * PAGE + 100)  # a partial block is not used
    assert store.blocks.num_blocks == 6 and store.block_bytes == PAGE
    slot = filled(arena, TOKENS)
    a, b, c = (store.save(slot, 16) for _ in range(3))
    assert a is not None and b is not None and c is not None
    assert store.save(slot, 1) is None and store.used_bytes == 6 * PAGE
    store.release(a)
    store.release(c)
    host = store.save(slot, 32)
    assert host is not None and host.runs == ((0, 2), (4, 2)) and host.num_blocks == 4
    assert store.counters.saves == 4 and host.ticket.nbytes == 32 * SPEC.token_bytes
    other = arena.allocate()
    arena.grow(other, 32)
    store.load(host, other)
    assert kv_values(arena, other) == TOKENS[:32]
    assert torch.equal(store.host_bytes(host), arena.token_bytes_view(slot, 0, 32))
    store.release(b)
    store.release(host)
    assert store.blocks.free == [(0, 6)] and store.used_bytes == 0


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
    store = HostKVStore(arena, capacity_bytes=1 << 20)
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
    assert cache.offloaded_tokens("s1") == 0 and store.used_bytes == 0
    assert cache.restored_total == 1
    cache.check_integrity()
    arena.free(hit.slot)


def test_restore_without_room_changes_nothing(arena: KVArena) -> None:
    store = HostKVStore(arena, capacity_bytes=1 << 20)
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
    store = HostKVStore(arena, capacity_bytes=48 * SPEC.token_bytes)
    cache = PrefixCache(arena, block_size=4, offload=store)
    for tag in ("a", "b"):
        _retain(cache, arena, TOKENS, tag)
    assert cache.evict_one() and cache.evict_one()
    assert cache.offloaded_tokens("a") == 40 and cache.offloaded_tokens("b") == 0  # no room
    cache.check_integrity()
    assert cache.discard(["a"]) == 0 and store.used_bytes == 0
    _retain(cache, arena, TOKENS, "c")
    assert cache.evict_one() and cache.offloaded_tokens("c") == 40
    assert cache.untag(["c"], EntryRank.PLAIN) == 0 and store.used_bytes == 0
    _retain(cache, arena, TOKENS, "d")
    assert cache.evict_one()
    _retain(cache, arena, TOKENS[:8], "d")
    assert cache.clear() == 1 and store.used_bytes == 0 and cache.offloaded_tokens("d") == 0
    cache.check_integrity()


def test_make_room_evicts_plain_entries_to_restore(arena: KVArena) -> None:
    store = HostKVStore(arena, capacity_bytes=1 << 20)
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
    """A session offloaded twice (24 tokens, later 40): the budget holds one 40-token copy,
    the older copy's bytes count as free for its successor, which replaces it; a successor
    that does not fit even so leaves the older copy in place."""
    store = HostKVStore(arena, capacity_bytes=40 * SPEC.token_bytes)
    cache = PrefixCache(arena, block_size=4, offload=store)
    _retain(cache, arena, TOKENS[:24], "s1")
    assert cache.evict_one() and cache.offloaded_tokens("s1") == 24
    _retain(cache, arena, TOKENS, "s1")
    assert cache.evict_one() and cache.offloaded_tokens("s1") == 40
    assert store.used_bytes == 40 * SPEC.token_bytes and store.num_held == 1
    cache.check_integrity()
    _retain(cache, arena, [*TOKENS, *range(41, 49)], "s1")  # 48 tokens: over the budget
    assert cache.evict_one() and cache.offloaded_tokens("s1") == 40  # the older copy stays
    cache.check_integrity()
    assert cache.restore("s1")
    hit = cache.acquire([*TOKENS, 99], max_tokens=100, claim=("s1",))
    assert hit is not None and hit.num_tokens == 40 and kv_values(arena, hit.slot) == TOKENS
    arena.free(hit.slot)


def test_a_resume_restore_evicts_other_sessions_to_the_host_never_its_own(
        arena: KVArena) -> None:
    """The pool full of another paused session: a resume's restore moves that one to the host
    (a copy each way, no recompute) instead of failing; a protected tag is never the victim."""
    store = HostKVStore(arena, capacity_bytes=1 << 20)
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
    store = HostKVStore(arena, capacity_bytes=1 << 20)
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

    store = HostKVStore(arena, capacity_bytes=1 << 20)
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
    cache = PrefixCache(arena, block_size=4, offload=HostKVStore(arena, capacity_bytes=1 << 20))
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
