"""The speculation gate and the costs it is fed: a branch runs only where its expected saving
(tokens x P(used) x seconds per token) exceeds its driver and prefill cost."""

from __future__ import annotations

import pytest
from kv_helpers import host_arena

from edmm.agent.gate import BranchPlan, SpeculationGate
from edmm.engine.step_cost import StepCostModel


def _plan(**kw: object) -> BranchPlan:
    base: dict[str, object] = dict(new_tokens=100, shared_pages=10, hits=0, partials=0,
                                   misses=0, engine_idle=False, padding_free=True,
                                   token_s=1e-4, page_s=(1e-5, 1e-5))
    return BranchPlan(**{**base, **kw})  # type: ignore[arg-type]


def test_gate_weighs_saving_against_driver_and_prefill_cost() -> None:
    gate = SpeculationGate()
    plan = _plan()  # saving 0.5 x 100 x 1e-4 = 5 ms; cost 10 x 2e-5 = 0.2 ms
    assert gate.saving_s(plan) == pytest.approx(5e-3) and gate.cost_s(plan) == pytest.approx(2e-4)
    assert gate.pays(plan)
    assert not gate.pays(_plan(new_tokens=3, shared_pages=200))  # 0.15 ms vs 4 ms of maps
    assert not gate.pays(_plan(padding_free=False))  # 5 ms saved vs 10 ms of prefill
    assert gate.pays(_plan(padding_free=False, engine_idle=True))
    assert not gate.pays(_plan(new_tokens=0))


def test_history_moves_the_probability() -> None:
    gate = SpeculationGate()
    assert gate.p_used(_plan()) == 0.5
    assert gate.p_used(_plan(hits=8)) == pytest.approx(0.9)
    assert gate.p_used(_plan(misses=8, partials=2)) == pytest.approx(2 / 12)
    marginal = _plan(new_tokens=10, shared_pages=20)  # saving 0.5 ms vs 0.4 ms
    assert gate.pays(marginal) and not gate.pays(_plan(new_tokens=10, shared_pages=20, misses=4))


def test_gate_falls_back_to_the_h200_numbers_until_measured() -> None:
    gate = SpeculationGate()
    plan = _plan(token_s=None, page_s=None, shared_pages=1)
    assert gate.saving_s(plan) == pytest.approx(0.5 * 100 * gate.prefill_token_s)
    assert gate.cost_s(plan) == pytest.approx(
        (gate.driver.map_page_us + gate.driver.unmap_page_us) * 1e-6)


def test_step_cost_model_recovers_a_linear_cost() -> None:
    model = StepCostModel(min_steps=4)
    for tokens in (8, 64, 512, 8, 64, 512):
        model.observe(tokens, 0.003 + 2e-5 * tokens)
    assert model.per_token_s() == pytest.approx(2e-5)
    flat = StepCostModel(min_steps=2)
    for _ in range(5):
        flat.observe(8, 0.004)
    assert flat.per_token_s() is None  # no spread of token counts: no slope
    assert StepCostModel().per_token_s() is None


def test_arena_times_its_driver_calls_per_page() -> None:
    with host_arena(num_pages=12) as arena:
        assert arena.driver.per_page_s() is None
        slot = arena.allocate()
        arena.grow(slot, 40)  # 5 pages
        arena.free(slot)
        got = arena.driver.per_page_s()
        assert got is not None and got[0] > 0 and got[1] > 0
        assert arena.driver.map_pages == 5 and arena.driver.unmap_pages == 5
