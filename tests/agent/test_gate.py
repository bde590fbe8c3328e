"""The speculation gate and the costs it is fed: a branch runs only where its expected saving
(tokens x P(used) x seconds per token) exceeds its driver and prefill cost."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from agent_helpers import MakeAgent, drain, greedy, run
from kv_helpers import host_arena

from edmm.agent import AgentConfig, AgentEngine, ToolCall, ToolResult
from edmm.agent.gate import BranchPlan, SpeculationGate
from edmm.agent.learning import Outcome, Outcomes, UsageStats
from edmm.engine.step_cost import StepCostModel


def _plan(**kw: object) -> BranchPlan:
    base: dict[str, object] = dict(new_tokens=100, shared_pages=10, others=Outcomes(),
                                   own=Outcomes(), engine_idle=False, padding_free=True,
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
    """The session's own history alone: one hit in two resumes as the prior."""
    gate = SpeculationGate()
    assert gate.p_used(_plan()) == 0.5
    assert gate.p_used(_plan(own=Outcomes(hits=8))) == pytest.approx(0.9)
    assert gate.p_used(_plan(own=Outcomes(misses=8, partials=2))) == pytest.approx(2 / 12)
    marginal = _plan(new_tokens=10, shared_pages=20)  # saving 0.5 ms vs 0.4 ms
    assert gate.pays(marginal)
    assert not gate.pays(_plan(new_tokens=10, shared_pages=20, own=Outcomes(misses=4)))


def test_the_pool_of_other_sessions_is_the_sessions_prior() -> None:
    """20 misses on other sessions: a new session's branch is judged by them (it would pay
    at the old per-session prior of 0.5); the session's own hits then move it back (the
    pool's rate weighs as much as `SpeculationGate.session_weight` of its own branches)."""
    gate = SpeculationGate()
    others = Outcomes(misses=20)
    marginal = dict(new_tokens=10, shared_pages=20)  # saving 0.5 ms at P 0.5 vs 0.4 ms
    assert gate.p_used(_plan(others=others)) == pytest.approx(1 / 22)
    assert not gate.pays(_plan(others=others, **marginal)) and gate.pays(_plan(**marginal))
    own_hits = _plan(others=others, own=Outcomes(hits=6), **marginal)
    assert gate.p_used(own_hits) == pytest.approx((6 + 2 / 22) / 8)
    assert gate.pays(own_hits)
    assert gate.p_used(_plan(others=Outcomes(hits=40))) == pytest.approx(41 / 42)


def test_usage_stats_are_per_source_and_tool_pooled_across_sessions() -> None:
    stats = UsageStats()
    for i in range(5):
        stats.record(f"s{i}", "predicted", "grep", Outcome.MISS)
        stats.record(f"s{i}", "template", "grep", Outcome.HIT)
    stats.record("s0", "predicted", "ls", Outcome.PARTIAL)
    assert stats.others("new", "predicted", "grep") == Outcomes(misses=5)
    assert stats.others("s0", "predicted", "grep") == Outcomes(misses=4)  # not its own
    assert stats.own("s0", "predicted", "grep") == Outcomes(misses=1)
    assert stats.others("new", "template", "grep") == Outcomes(hits=5)
    assert stats.others("new", "predicted", "ls") == Outcomes(partials=1)
    assert stats.others("new", "streamed", "grep") == Outcomes()
    stats.forget("s0")  # closed: its counts stay in the pool only
    assert stats.own("s0", "predicted", "grep") == Outcomes()
    assert stats.others("s0", "predicted", "grep") == Outcomes(misses=5)


def test_usage_stats_forget_the_least_recently_updated_key_past_the_cap() -> None:
    stats = UsageStats(max_keys=2)
    stats.record("s", "predicted", "a", Outcome.MISS)
    stats.record("s", "predicted", "b", Outcome.MISS)
    stats.record("s", "predicted", "a", Outcome.HIT)  # "a" updated last: "b" goes next
    stats.record("s", "predicted", "c", Outcome.MISS)
    assert stats.others("x", "predicted", "b") == Outcomes()
    assert stats.others("x", "predicted", "a") == Outcomes(hits=1, misses=1)
    assert stats.own("s", "predicted", "b") == Outcomes(misses=1)  # the session's own stay
    stats.record("t", "predicted", "b", Outcome.HIT)  # back in the pool, without s's miss
    assert stats.others("s", "predicted", "b") == Outcomes(hits=1)


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


@dataclass(frozen=True)
class ThresholdGate(SpeculationGate):
    """Pays where P(used) > 0.3, whatever the costs: the test is of the counts fed to it."""

    def pays(self, plan: BranchPlan) -> bool:
        return self.p_used(plan) > 0.3


RESULT = list(range(600, 620))


def _miss_one(agent: AgentEngine, session_id: str, tool: str, first: int) -> int:
    """A turn of ``session_id`` calling ``tool``: a result predicted at the wrong place (the
    predicted branch misses, the template's prefix hits); its branches gated off."""
    agent.add_request(f"{session_id}-t0", list(range(first, first + 40)), greedy(),
                      session_id=session_id)
    run(agent)
    context = agent.session_context(session_id)
    agent.await_tools(session_id, [ToolCall("c1", tool)])
    agent.predict_tool_result(session_id, "c1", RESULT, position=10)
    drain(agent)
    gated = agent.session_metrics(session_id).spec_gated
    agent.resume(session_id, f"{session_id}-t1",
                 [ToolResult("c1", RESULT, position=len(context))], greedy())
    run(agent)
    return gated


def test_a_sources_misses_on_other_sessions_gate_it_for_that_tool_only(
        make_agent: MakeAgent) -> None:
    """Predicted results of ``grep`` missed on two sessions: a third session's predicted
    branch for ``grep`` is gated off, its template branch (which hit every time) is not,
    and a predicted branch for ``ls`` still runs."""
    agent = make_agent(AgentConfig(speculation=("template", "predicted"),
                                   speculation_gate=ThresholdGate()))
    assert [_miss_one(agent, f"s{i}", "grep", 100 + 50 * i) for i in range(2)] == [0, 0]
    m = agent.session_metrics("s1")
    assert (m.spec_hits, m.spec_partial, m.spec_misses) == (1, 0, 0)  # the template won
    assert _miss_one(agent, "s2", "grep", 200) == 1  # P(predicted, grep) = 1/4
    assert agent.session_metrics("s2").spec_hits == 1  # its template branch ran
    assert _miss_one(agent, "s3", "ls", 250) == 0  # P(predicted, ls) = 1/2
    agent.close_session("s0")  # a closed session's outcomes stay in the pool
    assert _miss_one(agent, "s4", "grep", 300) == 1


def test_without_pooling_only_the_sessions_own_branches_count() -> None:
    """``pool_sessions=False`` (the ``edmm-no-pooled`` ablation): the other sessions' outcomes
    are ignored, the estimate is the session's own history over a prior of one in two."""
    gate, alone = SpeculationGate(), SpeculationGate(pool_sessions=False)
    plan = _plan(others=Outcomes(misses=40), own=Outcomes(hits=1))
    assert alone.p_used(plan) == pytest.approx(2 / 3)
    assert gate.p_used(plan) < 0.5 < alone.p_used(plan)
