"""Prefix reuse, preemption and page accounting of the engine, on a tiny random Qwen2/Llama."""

from __future__ import annotations

import pytest
from engine_helpers import TOKENS_PER_PAGE, HFCase, MakeEngine, greedy, run_to_completion

from edmm.engine import Engine, EngineConfigError


def check_memory(engine: Engine) -> None:
    """Arena/pool/index invariants; each running sequence maps exactly its computed tokens,
    never a page beyond its tokens."""
    engine.check_integrity()
    arena = engine.kv._arena
    for seq in engine._scheduler.running:
        assert seq.slot is not None
        assert arena.num_tokens(seq.slot) == seq.num_computed_tokens
        assert len(arena.slot_pages(seq.slot)) <= arena.pages_for(seq.num_tokens)


def assert_all_pages_free(engine: Engine) -> None:
    engine.reset_prefix_cache()
    engine.check_integrity()
    kv = engine.stats().kv
    assert kv.pages_free == kv.pages_total
    assert engine.kv._arena.stats().slots_in_use == 0


def test_next_turn_adopts_the_finished_turn(qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    engine = make_engine(qwen2_case.folder)
    first = qwen2_case.prompts[3]  # 65 tokens
    engine.add_request("turn1", first, greedy(8))
    out1 = run_to_completion(engine)["turn1"].outputs[0].token_ids
    (entry,) = engine.kv.entry_slots()
    entry_pages = engine.kv._arena.slot_pages(entry)
    # The entry holds KV of 65 + 7 tokens (the last sampled token was never computed).
    assert engine.kv.num_tokens(entry) == 72

    # Next turn of an agent loop: the whole first turn, then a tool result. It extends the
    # entry entirely, so it adopts the entry's slot: no copy, no recompute.
    turn2 = [*first, *out1, 11, 12, 13, 14, 15]
    engine.add_request("turn2", turn2, greedy(16))
    engine.step()
    seq = engine._scheduler.get("turn2")
    assert seq is not None and seq.slot == entry
    assert seq.num_cached_tokens == 72 and engine.stats().kv.cache_entries == 0
    assert engine.kv._arena.slot_pages(entry)[:9] == entry_pages
    check_memory(engine)

    out = run_to_completion(engine, check_memory)["turn2"]
    assert out.num_cached_tokens == 72
    assert out.outputs[0].token_ids == qwen2_case.greedy(turn2, 16)
    assert_all_pages_free(engine)


def test_partial_prefix_reuse_copies_only_the_boundary_page(
        qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    engine = make_engine(qwen2_case.folder)
    base = qwen2_case.prompts[3]
    engine.add_request("a", base, greedy(4))
    run_to_completion(engine)
    (entry,) = engine.kv.entry_slots()
    entry_pages = engine.kv._arena.slot_pages(entry)

    prompt = [*base[:50], 1, 2, 3]  # diverges mid-page: 6 full pages + 2 tokens of the 7th
    engine.add_request("b", prompt, greedy(8))
    engine.step()
    seq = engine._scheduler.get("b")
    assert seq is not None and seq.slot is not None
    assert seq.num_cached_tokens == 50
    pages = engine.kv._arena.slot_pages(seq.slot)
    full = 50 // TOKENS_PER_PAGE
    assert pages[:full] == entry_pages[:full] and pages[full] not in entry_pages

    out = run_to_completion(engine, check_memory)["b"].outputs[0].token_ids
    cold = make_engine(qwen2_case.folder, enable_prefix_caching=False)
    cold.add_request("b", prompt, greedy(8))
    cold_out = run_to_completion(cold)["b"]
    assert cold_out.num_cached_tokens == 0
    assert out == cold_out.outputs[0].token_ids == qwen2_case.greedy(prompt, 8)
    assert_all_pages_free(engine)


def test_prefix_reuse_from_a_running_sequence(qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    engine = make_engine(qwen2_case.folder)
    a = qwen2_case.prompts[3]
    engine.add_request("a", a, greedy())
    engine.step()
    engine.step()
    b = [*a[:40], 7, 8, 9]
    engine.add_request("b", b, greedy())
    engine.step()
    seq_a, seq_b = engine._scheduler.get("a"), engine._scheduler.get("b")
    assert seq_a is not None and seq_b is not None and seq_a.slot is not None
    assert seq_b.slot is not None and seq_b.num_cached_tokens == 40
    shared = 40 // TOKENS_PER_PAGE
    assert engine.kv._arena.slot_pages(seq_b.slot)[:shared] == \
        engine.kv._arena.slot_pages(seq_a.slot)[:shared]

    final = run_to_completion(engine, check_memory)
    assert final["a"].outputs[0].token_ids == qwen2_case.reference[3]
    assert final["b"].outputs[0].token_ids == qwen2_case.greedy(b)
    assert_all_pages_free(engine)


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_preemption_under_a_tiny_pool_gives_identical_tokens(
        hf_case: HFCase, make_engine: MakeEngine, caching: bool) -> None:
    # The four sequences end at 34, 48, 71 and 96 tokens: 32 pages, in a pool of 16 (the
    # least that holds one sequence of max_model_len).
    engine = make_engine(hf_case.folder, num_pages=16, max_model_len=128,
                         enable_prefix_caching=caching)
    for i, prompt in enumerate(hf_case.prompts):
        engine.add_request(str(i), prompt, greedy())

    final = run_to_completion(engine, check_memory)

    assert engine._scheduler.num_preemptions > 0
    assert [final[str(i)].outputs[0].token_ids for i in range(4)] == hf_case.reference
    assert_all_pages_free(engine)


def test_pool_too_small_for_one_sequence_is_a_config_error(
        qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    with pytest.raises(EngineConfigError, match="cannot hold one sequence"):
        make_engine(qwen2_case.folder, num_pages=15, max_model_len=128)
