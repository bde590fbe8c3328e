"""Engine support for agent sessions: tagged cache entries, claimed zero-copy adoption,
eviction ranks, and speculative prefill scheduled only in capacity requests leave free."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import greedy
from engine_helpers import run_to_completion as run
from kv_helpers import filled, host_arena, kv_values
from kv_helpers import tiny_engine_config as engine_config

from edmm.engine import Engine, EngineConfig, EntryRank, PrefixCache, SlotHints
from edmm.memory import KVArena


@pytest.fixture
def arena() -> Iterator[KVArena]:
    with host_arena(32, num_slots=6) as a:
        yield a


def test_claimed_branch_is_committed_by_slot_swap_and_truncated(arena: KVArena) -> None:
    cache = PrefixCache(arena, block_size=4)
    a = list(range(1, 21))
    b = [*a[:12], *range(100, 110)]  # a speculation branch of a at 12
    sa = filled(arena, a)
    sb = filled(arena, b, src=sa, at=12)
    cache.release(sa, a, 20, tag="s", rank=EntryRank.RETAINED)
    cache.release(sb, b, 22, tag="b", rank=EntryRank.SPECULATIVE)
    shared = arena.slot_pages(sa)[0]
    prompt = [*b[:17], 7, 7, 7]

    hit = cache.acquire(prompt, len(prompt) - 1, claim=("b",), own_tag="s")

    assert hit is not None
    assert (hit.slot, hit.num_tokens, hit.claimed, hit.source_tokens) == (sb, 17, "b", 22)
    assert hit.committed == (sa,) and arena.stats().slots_retired == 1
    assert arena.slot_pages(sb)[0] == shared  # the same physical page: nothing copied
    assert kv_values(arena, sb) == b[:17]
    assert cache.tagged("s") == [] and cache.tagged("b") == []
    assert arena.reclaim() == 1
    cache.release(sb, prompt, 17, tag="s")
    assert cache.untag(["s"], EntryRank.PLAIN) == 1 and cache.tagged("s") == []
    assert cache.entry_slots() == [sb] and arena.stats().pages_used == 3  # nothing freed
    cache.check_integrity()


def test_own_entry_is_adopted_and_truncated_at_a_late_change(arena: KVArena) -> None:
    cache = PrefixCache(arena, block_size=4)
    a = list(range(1, 31))  # 4 pages
    sa = filled(arena, a)
    cache.release(sa, a, 30, tag="s")
    prompt = [*a[:17], 99, *a[17:]]  # a result inserted at position 17

    hit = cache.acquire(prompt, len(prompt) - 1, own_tag="s")

    assert hit is not None and (hit.slot, hit.num_tokens, hit.committed) == (sa, 17, ())
    assert arena.num_tokens(sa) == 17 and kv_values(arena, sa) == a[:17]
    assert arena.stats().pages_used == 3  # ceil(17 tokens / 8 per page): the tail unmapped
    cache.release(sa, prompt, 17)
    cache.check_integrity()


def test_own_entry_with_a_long_tail_is_branched_from(arena: KVArena) -> None:
    """Unmapping 3 tail pages (3 x 40 us) costs more than mapping 1 prefix page (28 us)."""
    cache = PrefixCache(arena, block_size=4)
    a = list(range(1, 31))
    sa = filled(arena, a)
    cache.release(sa, a, 30, tag="s")
    prompt = [*a[:9], 99, *a[9:]]  # a result inserted at position 9

    hit = cache.acquire(prompt, len(prompt) - 1, own_tag="s")

    assert hit is not None and hit.slot != sa and (hit.num_tokens, hit.source) == (9, sa)
    assert hit.claimed == "s" and cache.tagged("s") == [sa]  # the entry stays, whole
    assert arena.slot_pages(hit.slot)[0] == arena.slot_pages(sa)[0]  # shared, not copied
    assert kv_values(arena, hit.slot) == a[:9] and kv_values(arena, sa) == a
    cache.release(hit.slot, prompt, 9)
    cache.check_integrity()


def test_tagged_entry_is_only_branched_from_by_others(arena: KVArena) -> None:
    cache = PrefixCache(arena, block_size=4)
    a = list(range(1, 17))
    sa = filled(arena, a)
    cache.release(sa, a, 16, tag="s")

    hit = cache.acquire([*a, 5], 16)  # extends the entry entirely, but does not claim it

    assert hit is not None and hit.slot != sa and hit.num_tokens == 16 and hit.claimed is None
    assert cache.tagged("s") == [sa]
    cache.release(hit.slot, [*a, 5], 16)
    cache.check_integrity()


def test_eviction_goes_by_rank_then_priority_then_lru(arena: KVArena) -> None:
    cache = PrefixCache(arena, block_size=4)
    slots = {}
    for name, rank, prio in [("keep-high", EntryRank.RETAINED, 5.0), ("plain", EntryRank.PLAIN, 0),
                             ("keep-low", EntryRank.RETAINED, 1.0),
                             ("spec", EntryRank.SPECULATIVE, 9.0)]:
        tokens = [len(slots) + 1] * 8
        slots[name] = filled(arena, tokens)
        cache.release(slots[name], tokens, 8, tag=name, rank=rank, priority=prio)
    order = []
    assert cache.evict_one(EntryRank.SPECULATIVE) and cache.tagged("spec") == []
    order.append("spec")
    assert not cache.evict_one(EntryRank.SPECULATIVE)  # none of that rank is left
    while cache.num_entries:
        before = set(cache.entry_slots())
        assert cache.evict_one()
        (gone,) = before - set(cache.entry_slots())
        order.append(next(k for k, v in slots.items() if v == gone))
    assert order == ["spec", "plain", "keep-low", "keep-high"]
    assert arena.stats().pages_used == 0


def test_set_retention_and_discard_by_tag(arena: KVArena) -> None:
    cache = PrefixCache(arena, block_size=4)
    for i, tag in enumerate(["x", "y", "x"]):
        tokens = [i + 1] * 8
        cache.release(filled(arena, tokens), tokens, 8, tag=tag)
    assert cache.set_retention("x", EntryRank.RETAINED, 3.0) == 2
    assert cache.discard(["x"]) == 2 and cache.num_entries == 1
    assert cache.evict_one() and arena.stats().pages_used == 0


# ---------------------------------------------------------------------- scheduling
def spec_hints(tag: str) -> SlotHints:
    return SlotHints(tag=tag, rank=EntryRank.SPECULATIVE)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_speculation_only_uses_the_budget_requests_leave(tiny_dir: Path,
                                                         async_scheduling: bool) -> None:
    """With async scheduling too: a step whose only request waits for its last token (still
    on the device) is not idle, and the engine is done once the request is."""
    engine = Engine(engine_config(tiny_dir, max_num_batched_tokens=64,
                                  speculative_tokens_when_busy=16,
                                  async_scheduling=async_scheduling))
    prompt = list(range(50, 90))
    engine.add_request("r", prompt, greedy(8))
    engine.step()  # the prompt's prefill
    engine.speculate("sp", list(range(300, 500)), spec_hints("b"))
    done = []
    while engine.has_unfinished():
        before = engine.speculation_progress("sp")
        outs = engine.step()
        after = engine.speculation_progress("sp")
        assert before is not None and after is not None
        assert after[0] - before[0] <= 16  # a decode step carries at most 16 spec tokens
        assert all(not o.request_id.startswith("sp") for o in outs)
        done += [o for o in outs if o.finished]
    progress = engine.speculation_progress("sp")
    assert progress is not None and progress[0] < 200
    engine.step()  # idle: the whole budget goes to speculation
    after = engine.speculation_progress("sp")
    assert after is not None and after[0] == progress[0] + 64
    run(engine)
    while engine.has_speculation():
        engine.step()
    assert len(engine.kv.tagged("b")) == 1 and engine.take_speculated_tokens("b") == 200

    reference = Engine(engine_config(tiny_dir, enable_prefix_caching=False))
    reference.add_request("r", prompt, greedy(8))
    assert run(reference)["r"].outputs[0].token_ids == done[0].outputs[0].token_ids
    for e in (engine, reference):
        e.check_integrity()
        e.close()


def test_memory_pressure_drops_speculation_before_preempting(tiny_dir: Path) -> None:
    # 40 pages of 8 tokens; max_model_len 256 = 32 pages.
    engine = Engine(engine_config(tiny_dir, num_pages=40, max_num_batched_tokens=64,
                                  max_speculative_pages=40))
    engine.speculate("sp", list(range(300, 500)), spec_hints("b"))  # 25 pages
    engine.step()
    engine.step()
    assert engine.speculation_progress("sp") == (128, 200)
    engine.add_request("r", list(range(10, 210)), greedy(8))  # 200 + 8 tokens: 26 pages
    out = run(engine)["r"]
    assert engine._scheduler.num_preemptions == 0  # the request never lost its KV
    assert not engine.has_speculation() and engine.kv.tagged("b") == []  # the branch was dropped
    assert len(out.outputs[0].token_ids) == 8
    engine.check_integrity()
    engine.close()


def test_speculation_pages_are_capped(tiny_dir: Path) -> None:
    engine = Engine(engine_config(tiny_dir, max_speculative_pages=6))
    engine.speculate("a", list(range(300, 340)), spec_hints("a"))  # 5 pages
    engine.speculate("b", list(range(400, 480)), spec_hints("b"))  # 10 pages: over the cap
    while engine.has_speculation():
        engine.step()
        assert engine._scheduler.speculative_pages() <= 6
    # "b" evicted "a" (older speculation) and then stopped at the cap
    assert engine.kv.tagged("a") == [] and len(engine.kv.tagged("b")) == 1
    (slot,) = engine.kv.tagged("b")
    assert engine.kv.num_tokens(slot) == 48  # 6 pages x 8 tokens
    engine.check_integrity()
    engine.close()


def test_idle_speculation_steps_are_capped(tiny_dir: Path) -> None:
    # A resume arriving while speculation runs waits for at most one capped step on the device.
    engine = Engine(engine_config(tiny_dir, max_num_batched_tokens=256,
                                  speculative_tokens_when_idle=48))
    engine.speculate("sp", list(range(300, 500)), spec_hints("b"))
    steps = []
    while engine.has_speculation():
        before = engine.speculation_progress("sp")
        engine.step()
        after = engine.speculation_progress("sp")
        if before is not None and after is not None:
            steps.append(after[0] - before[0])
    assert steps == [48, 48, 48, 48]  # then a last step of 8 finishes it
    assert engine.take_speculated_tokens("b") == 200
    engine.check_integrity()
    engine.close()


def test_busy_speculation_default_follows_cuda_graphs() -> None:
    # Measured on an H200: a speculative chunk in a decode step forfeits the decode graph (5x).
    assert EngineConfig(device="cuda").busy_speculation_tokens == 0
    assert EngineConfig(device="cuda", enforce_eager=True).busy_speculation_tokens == 64
    assert EngineConfig(device="cpu").busy_speculation_tokens == 64
    assert EngineConfig(device="cuda", speculative_tokens_when_busy=16).busy_speculation_tokens \
        == 16


def test_busy_speculation_fills_a_prefill_steps_padding_only(tiny_dir: Path) -> None:
    """With no busy speculation budget (CUDA's default), speculation still fills the padding
    of a step that prefills (to the next padded size: a mixed CUDA graph), never a decode
    step, and the requests' greedy tokens do not change."""
    engine = Engine(engine_config(tiny_dir, max_num_batched_tokens=128,
                                  speculative_tokens_when_busy=0))
    engine.update_scheduler_config(padded_token_sizes=(64, 128), padded_max_seqs=8)
    engine.speculate("sp", list(range(300, 500)), spec_hints("b"))
    engine.add_request("r", list(range(50, 90)), greedy(6))  # 40 tokens: padded to 64
    rides = []

    def step() -> list:  # type: ignore[type-arg]
        before = engine.speculation_progress("sp")
        outs = engine.step()
        after = engine.speculation_progress("sp")
        assert before is not None and after is not None
        rides.append(after[0] - before[0])
        return outs

    done = {o.request_id: o for o in step() if o.finished}
    assert rides == [24]
    for _ in range(2):
        step()  # decode steps: nothing rides
    assert rides == [24, 0, 0]
    engine.add_request("q", list(range(10, 110)), greedy(3))  # 1 decode + 100: padded to 128
    step()
    assert rides[-1] == 27
    while engine.has_unfinished():
        done.update({o.request_id: o for o in step() if o.finished})
    reference = Engine(engine_config(tiny_dir, enable_prefix_caching=False))
    reference.add_request("r", list(range(50, 90)), greedy(6))
    reference.add_request("q", list(range(10, 110)), greedy(3))
    ref = run(reference)
    for rid in ("r", "q"):
        assert ref[rid].outputs[0].token_ids == done[rid].outputs[0].token_ids
    for e in (engine, reference):
        e.check_integrity()
        e.close()


def test_speculation_whose_base_kv_is_gone_is_dropped_not_recomputed(tiny_dir: Path) -> None:
    """A speculation extending a session's KV (``min_cached``) is dropped at admission when
    pressure took that KV away, instead of prefilling it again from token 0."""
    engine = Engine(engine_config(tiny_dir))
    context = list(range(50, 90))
    engine.add_request("r", context, greedy(1))
    run(engine)  # 40 tokens of KV left as an entry
    hints = SlotHints("b", EntryRank.SPECULATIVE, min_cached=40)
    engine.speculate("kept", [*context, 7, 8], hints)
    engine.step()
    assert engine.take_speculated_tokens("b") == 2  # extended the entry: 2 new tokens
    engine.reset_prefix_cache()  # the base KV is gone
    engine.speculate("gone", [*context, 7, 9], SlotHints("c", EntryRank.SPECULATIVE,
                                                          min_cached=40))
    engine.step()
    assert not engine.has_speculation() and engine.take_speculated_tokens("c") == 0
    assert engine.kv.tagged("c") == []
    engine.check_integrity()
    engine.close()
