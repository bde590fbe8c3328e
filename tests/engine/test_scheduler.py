"""The scheduler on a bare arena (no model): token budget, chunked prefill, admission order,
preemption victims and resume, exact slot mappings."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from kv_helpers import PAGE, SPEC

from edmm.engine import (
    IntegrityError,
    KVCacheManager,
    PrefixCache,
    SamplingParams,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
)
from edmm.memory import KVArena, PagePool, open_backend

PARAMS = SamplingParams(temperature=0.0, max_tokens=100)
MakeArena = Callable[..., KVArena]


@pytest.fixture
def make_arena() -> Iterator[MakeArena]:
    made: list[tuple[KVArena, PagePool]] = []

    def make(num_pages: int, num_slots: int = 4, max_tokens: int = 48) -> KVArena:
        pool = PagePool(open_backend("host", host_page_size=PAGE), num_pages)
        arena = KVArena(pool, SPEC, num_slots=num_slots, max_tokens=max_tokens)
        made.append((arena, pool))
        return arena

    yield make
    for arena, pool in made:
        arena.check_integrity()
        arena.close()
        pool.close()


def scheduler(arena: KVArena, budget: int = 64, max_seqs: int = 4,
              caching: bool = False) -> Scheduler:
    return Scheduler(KVCacheManager(arena, PrefixCache(arena, block_size=4, enabled=caching)),
                     SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs))


def add(sched: Scheduler, name: str, prompt_len: int, first: int = 0,
        priority: float = 0.0) -> Sequence:
    seq = Sequence.new(name, list(range(first, first + prompt_len)), PARAMS, priority=priority)
    sched.add(seq)
    return seq


def step(sched: Scheduler) -> ScheduledBatch:
    """Schedule, then account for a fake forward that samples token 7 where asked."""
    batch = sched.schedule()
    sched.update(batch, [7 if s.sample else None for s in batch.seqs])
    sched.check_integrity()
    return batch


def work(batch: ScheduledBatch) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.start, len(s.token_ids), s.sample) for s in batch.seqs]


def test_decodes_first_then_chunked_prefill_in_budget(make_arena: MakeArena) -> None:
    sched = scheduler(make_arena(32), budget=10)
    add(sched, "a", 6)
    add(sched, "b", 12)
    assert work(step(sched)) == [("a", 0, 6, True), ("b", 0, 4, False)]
    assert work(step(sched)) == [("a", 6, 1, True), ("b", 4, 8, True)]
    add(sched, "c", 20)
    assert work(step(sched)) == [("a", 7, 1, True), ("b", 12, 1, True), ("c", 0, 8, False)]
    assert work(step(sched)) == [("a", 8, 1, True), ("b", 13, 1, True), ("c", 8, 8, False)]
    for name, n in (("a", 9), ("b", 14), ("c", 16)):
        seq = sched.get(name)
        assert seq is not None and seq.slot is not None
        assert seq.num_computed_tokens == n == sched.kv.num_tokens(seq.slot)


def test_max_num_seqs_and_fifo_admission(make_arena: MakeArena) -> None:
    sched = scheduler(make_arena(32), max_seqs=2)
    for name in "abc":
        add(sched, name, 4)
    assert [s.request_id for s in step(sched).seqs] == ["a", "b"]
    c = sched.get("c")
    assert c is not None and c.status == SequenceStatus.WAITING and c.slot is None


def test_priority_orders_admission_and_the_head_is_never_overtaken(
        make_arena: MakeArena) -> None:
    sched = scheduler(make_arena(32), budget=12, max_seqs=4)
    add(sched, "late", 4, priority=2.0)
    add(sched, "big", 10, first=50, priority=1.0)
    add(sched, "first", 4, first=100, priority=1.0)
    add(sched, "urgent", 4, first=200, priority=-1.0)
    assert [s.request_id for s in sched.waiting] == ["urgent", "big", "first", "late"]
    # urgent (4 tokens) then big's first 8: "first" and "late" would fit the budget's rest
    # only by overtaking big, which they never do.
    assert work(step(sched)) == [("urgent", 0, 4, True), ("big", 0, 8, False)]
    assert work(step(sched))[:2] == [("urgent", 4, 1, True), ("big", 8, 2, True)]
    assert [s.request_id for s in sched.running] == ["urgent", "big", "first", "late"]


def test_a_preempted_sequence_keeps_its_place_by_priority(make_arena: MakeArena) -> None:
    arena = make_arena(6)  # 48 tokens
    sched = scheduler(arena, max_seqs=3)
    add(sched, "a", 16, priority=0.0)
    add(sched, "b", 16, first=100, priority=5.0)
    add(sched, "c", 15, first=200, priority=5.0)
    step(sched)
    add(sched, "d", 8, first=300, priority=1.0)  # queued before c is preempted
    add(sched, "e", 8, first=400, priority=5.0)  # same priority as c, queued later
    assert step(sched).preempted == ["c"]
    assert [s.request_id for s in sched.waiting] == ["d", "c", "e"]


def test_pool_pressure_preempts_the_latest_admitted(make_arena: MakeArena) -> None:
    arena = make_arena(6)  # 48 tokens
    sched = scheduler(arena)
    a, b, c = add(sched, "a", 16), add(sched, "b", 16), add(sched, "c", 15)
    step(sched)  # all three prefilled: 2 + 2 + 2 pages; a and b now need a third page
    assert arena.pool.num_free == 0

    batch = step(sched)

    assert batch.preempted == ["c"] and work(batch) == [("a", 16, 1, True), ("b", 16, 1, True)]
    assert c.status == SequenceStatus.WAITING and c.slot is None and c.num_computed_tokens == 0
    assert c.token_ids == [*range(15), 7] and sched.num_preemptions == 1
    assert list(sched.waiting) == [c] and sched.running == [a, b]
    # While memory is short the waiting sequence waits: it never preempts a running one.
    for _ in range(5):
        assert [s.request_id for s in step(sched).seqs] == ["a", "b"]
    sched.finish(b, "stop")
    assert work(step(sched)) == [("a", 22, 1, True), ("c", 0, 16, True)]  # recomputed


def test_memory_waits_count_steps_whose_admission_waited_and_what_ran(
        make_arena: MakeArena) -> None:
    arena = make_arena(6)  # 48 tokens, 8 a page
    sched = scheduler(arena)
    a, b, c = add(sched, "a", 16), add(sched, "b", 16), add(sched, "c", 15)
    before = time.time_ns()
    step(sched)
    assert all(s.first_scheduled_ns is not None and s.first_scheduled_ns >= before
               for s in (a, b, c))
    first_c = c.first_scheduled_ns
    assert step(sched).preempted == ["c"]  # c waits from here on
    assert sched.memory_waits.steps == 0  # a step that preempts admits nothing
    for i in range(1, 4):
        step(sched)
        held = arena.pool.capacity - arena.pool.num_free
        assert sched.memory_waits.steps == i == c.memory_wait_steps  # c headed the queue
        assert sched.memory_waits.running_pages == i * held == i * 6  # a and b: 3 pages each
    sched.finish(b, "stop")
    step(sched)  # c is admitted: no wait
    assert sched.memory_waits.steps == 3 and a.status == SequenceStatus.RUNNING
    assert c.first_scheduled_ns == first_c  # its first admission, not the re-admission
    assert a.memory_wait_steps == b.memory_wait_steps == 0


def test_a_self_preempted_sequence_resumes_from_its_kv(make_arena: MakeArena) -> None:
    arena = make_arena(5)  # 40 tokens
    sched = scheduler(arena, caching=True)
    a, b = add(sched, "a", 16), add(sched, "b", 16, first=100)
    step(sched)
    assert arena.pool.num_free == 1
    batch = step(sched)  # a takes the last page; b, the last admitted, preempts itself
    assert batch.preempted == ["b"] and work(batch) == [("a", 16, 1, True)]
    assert sched.kv.stats().cache_entries == 1  # b's KV is kept while nothing needs it
    b_slot = sched.kv.entry_slots()[0]
    sched.finish(a, "stop")  # a's slot becomes an entry too; b's is more recent

    batch = step(sched)

    assert work(batch) == [("b", 16, 1, True)]  # no recompute
    assert b.slot == b_slot and b.num_cached_tokens == 0  # counted at first admission only


def test_abort_waiting_and_running(make_arena: MakeArena) -> None:
    arena = make_arena(32)
    sched = scheduler(arena, max_seqs=1)
    add(sched, "a", 4)
    add(sched, "b", 4)
    step(sched)
    assert sched.abort("b") is not None and sched.abort("a") is not None
    assert sched.abort("a") is None and not sched.has_unfinished()
    assert arena.pool.num_free == arena.pool.capacity


def test_integrity_check_catches_a_slot_out_of_sync(make_arena: MakeArena) -> None:
    sched = scheduler(make_arena(32), caching=True)
    a = add(sched, "a", 6)
    add(sched, "b", 6, first=50)
    step(sched)
    slot = a.slot
    a.slot = None  # a running sequence that lost its slot
    with pytest.raises(IntegrityError, match="missing or shared"):
        sched.check_integrity()
    a.slot = sched.get("b").slot  # two sequences on one slot
    with pytest.raises(IntegrityError, match="missing or shared"):
        sched.check_integrity()
    a.slot = slot
    a.num_computed_tokens = 40  # more than its slot maps
    with pytest.raises(IntegrityError, match="maps fewer"):
        sched.check_integrity()
    a.num_computed_tokens = 6
    sched.check_integrity()
    sched.abort("a")
    sched.abort("b")
