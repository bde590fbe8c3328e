"""The named queries and commands code above the engine uses instead of its internals:
`KVCacheManager.layout`, `page_seconds`, `hold_pages` / `release_held`, and
`Engine.num_prefilling`, `memory_short`, `padding_free`, `reclaim`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edmm.engine import Engine, EngineConfig, EntryRank, SamplingParams, SlotHints
from edmm.memory import KVMemoryError, NoFreeSlotError, PoolExhaustedError

PAGE = 16384  # the tiny model's token holds 2 KiB of float32 KV: 8 tokens a page


@pytest.fixture
def make_engine(tiny_dir: Path) -> Iterator[Any]:
    engines: list[Engine] = []

    def make(**overrides: Any) -> Engine:
        kw: dict[str, Any] = {"model": str(tiny_dir), "dtype": "float32",
                              "host_page_size": PAGE, "max_model_len": 64, "num_pages": 40,
                              "num_slots": 8, "max_num_seqs": 4} | overrides
        engines.append(Engine(EngineConfig(**kw)))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_layout_is_what_a_slot_costs(make_engine: Any) -> None:
    engine = make_engine()
    cfg = engine.model_config
    layout = engine.kv.layout()
    token_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    assert (layout.page_size, layout.token_bytes, layout.max_tokens) == (PAGE, token_bytes, 64)
    per_page = PAGE // token_bytes
    assert [layout.full_pages(n) for n in (0, per_page - 1, per_page, 3 * per_page + 1)] == \
        [0, 0, 1, 3]


def test_page_seconds_once_maps_and_unmaps_were_seen(make_engine: Any) -> None:
    engine = make_engine()
    assert engine.kv.page_seconds() is None
    engine.add_request("r", list(range(1, 40)), _params(4))
    _run(engine)
    engine.reset_prefix_cache()  # the entry's pages are unmapped
    seconds = engine.kv.page_seconds()
    assert seconds is not None and seconds[0] > 0 and seconds[1] > 0


def test_held_pages_leave_the_pool_until_released(make_engine: Any) -> None:
    engine = make_engine()
    held = engine.kv.hold_pages(19)  # 8 pages a slot of 64 tokens: 3 slots
    assert held.num_pages == 19 and len(held.slots) == 3
    assert engine.stats().kv.pages_in_use == 19
    engine.check_integrity()
    engine.add_request("r", list(range(1, 40)), _params(8))  # runs in the pages left
    _run(engine)
    engine.check_integrity()
    engine.kv.release_held(held)
    with pytest.raises(KVMemoryError, match="not held"):
        engine.kv.release_held(held)
    engine.reset_prefix_cache()
    assert engine.stats().kv.pages_in_use == 0
    engine.check_integrity()


@pytest.mark.parametrize("pages, slots, error", [(41, 8, PoolExhaustedError),
                                                 (17, 2, NoFreeSlotError)])
def test_holding_what_is_not_there_holds_nothing(make_engine: Any, pages: int, slots: int,
                                                 error: type[Exception]) -> None:
    engine = make_engine(num_slots=slots, max_num_seqs=2)
    with pytest.raises(error):
        engine.kv.hold_pages(pages)
    assert engine.stats().kv.pages_in_use == 0
    engine.check_integrity()


def test_integrity_check_sees_a_held_slot_freed_behind_the_manager(make_engine: Any) -> None:
    engine = make_engine()
    held = engine.kv.hold_pages(8)
    engine.kv._arena.free(held.slots[0])
    with pytest.raises(KVMemoryError, match="not in use"):
        engine.check_integrity()


def test_num_prefilling_counts_prompts_not_yet_computed(make_engine: Any) -> None:
    engine = make_engine(max_num_batched_tokens=16)
    engine.add_request("a", list(range(1, 41)), _params(6))
    engine.add_request("b", list(range(41, 81)), _params(6))
    counts = [engine.num_prefilling()]
    while engine.has_unfinished():
        engine.step()
        counts.append(engine.num_prefilling())
    assert counts[:3] == [2, 2, 2]  # 16 tokens a step: both prompts take several
    assert counts == sorted(counts, reverse=True) and counts[-1] == 0
    assert counts.index(0) < len(counts) - 1  # decode steps ran with nothing to prefill


def test_memory_short_while_a_request_waits_for_pages(make_engine: Any) -> None:
    engine = make_engine(num_pages=8)  # one sequence of 64 tokens
    engine.add_request("a", list(range(1, 41)), _params(20))
    engine.add_request("b", list(range(41, 81)), _params(20))
    short = []
    while engine.has_unfinished():
        engine.step()
        short.append(engine.memory_short())
    assert short[0] and not short[-1]


def test_padding_free_follows_the_padded_sizes(make_engine: Any) -> None:
    engine = make_engine()
    assert not engine.padding_free  # no CUDA graphs on the CPU: nothing is padded
    engine.update_scheduler_config(padded_token_sizes=(16, 32))
    assert engine.padding_free


def test_reclaim_releases_the_slot_a_commit_retired(make_engine: Any) -> None:
    engine = make_engine()
    assert engine.reclaim() == 0
    prompt = list(range(1, 30))
    engine.add_request("t0", prompt, _params(2), SlotHints("s", EntryRank.RETAINED))
    _run(engine)
    branch = [*prompt, *range(100, 110)]
    engine.speculate("spec", branch, SlotHints("b", EntryRank.SPECULATIVE))
    while engine.has_speculation():
        engine.step()
    engine.add_request("t1", [*branch, 7], _params(2),
                       SlotHints("s", EntryRank.RETAINED, claim=("b",)))
    _run(engine)  # t1 adopted the branch: the session's old entry was retired, not freed
    assert engine.kv._arena.stats().slots_retired == 1
    assert engine.reclaim() == 1
    assert engine.reclaim() == 0 and engine.kv._arena.stats().slots_retired == 0
    engine.check_integrity()
