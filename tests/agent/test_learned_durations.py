"""Tool durations learned per tool name (a log-normal of each tool's seconds): the expected
duration of a window whose client gives none, the retention rank and the prefetch timer."""

from __future__ import annotations

import math

import pytest
from agent_helpers import FakeClock, MakeAgent, greedy, run

from edmm.agent import AgentConfig, AgentEngine, SessionTag, ToolCall, ToolResult, ToolSpec
from edmm.agent.learning import MIN_DURATION_S, ToolDurations
from edmm.agent.timers import TimerKind
from edmm.engine import EngineConfigError, EntryRank

# Log-normal samples at exactly known z-scores (sigma 1 of the log), the largest last: their
# log mean is the median's log, while a running average weighted to the newest is far off.
Z = (0.0, -1.0, 1.0, -1.5, -0.5, 0.5, 1.5)
MEDIANS = {"grep": 0.2, "pytest": 30.0}


def _window(agent: AgentEngine, clock: FakeClock, session_id: str, tools: list[str],
            seconds: float, first: int) -> float | None:
    """One turn of ``session_id`` calling ``tools``, resumed ``seconds`` later; the
    window's expected duration."""
    agent.add_request(f"{session_id}-t0", list(range(first, first + 30)), greedy(),
                      session_id=session_id)
    run(agent)
    calls = [ToolCall(f"c{i}", name) for i, name in enumerate(tools)]
    agent.await_tools(session_id, calls)
    expected = _expected(agent, session_id)
    clock.advance(seconds)
    agent.resume(session_id, f"{session_id}-t1", [ToolResult(c.id, [5, 6]) for c in calls],
                 greedy())
    run(agent)
    return expected


def _expected(agent: AgentEngine, session_id: str) -> float | None:
    window = agent._sessions[session_id].window
    assert window is not None
    return window.expected_s


def _learned(make_agent: MakeAgent, **overrides: object) -> tuple[AgentEngine, FakeClock]:
    clock = FakeClock()
    agent = make_agent(AgentConfig(speculation=()), clock=clock, **overrides)
    for i, z in enumerate(Z):
        for j, (tool, median) in enumerate(MEDIANS.items()):
            _window(agent, clock, f"{tool}{i}", [tool], median * math.exp(z), 100 + 40 * j)
            agent.close_session(f"{tool}{i}")
    return agent, clock


def test_durations_are_a_log_normal_per_tool_trusted_after_min_count() -> None:
    durations = ToolDurations(min_count=3)
    for s in (0.1, 0.4):
        durations.observe("grep", s)
    assert durations.median("grep") is None and durations.count("grep") == 2
    durations.observe("grep", 0.2)
    assert durations.median("grep") == pytest.approx(0.2)  # (0.1 * 0.4 * 0.2) ** (1 / 3)
    durations.observe("sleep", 0.0)  # a zero duration (a fake clock) is floored
    assert durations.count("sleep") == 1 and ToolDurations(min_count=1).median("x") is None
    one = ToolDurations(min_count=1)
    one.observe("sleep", 0.0)
    assert one.median("sleep") == pytest.approx(MIN_DURATION_S)
    with pytest.raises(EngineConfigError, match="min_count"):
        ToolDurations(min_count=0)


def test_a_new_windows_expected_duration_is_its_tools_learned_median(
        make_agent: MakeAgent) -> None:
    clock = FakeClock()
    agent = make_agent(AgentConfig(speculation=()), clock=clock)
    agent.declare_tool(ToolSpec("pytest", expected_duration_s=60.0))
    seen = [_window(agent, clock, f"g{i}", ["grep"], 0.2, 100) for i in range(3)]
    assert seen == [None, None, None]  # not trusted before 3 observations, none declared
    seen = [_window(agent, clock, f"p{i}", ["pytest"], 30.0, 200) for i in range(3)]
    assert seen == [60.0, 60.0, 60.0]  # the declared one until then
    for tool, median in MEDIANS.items():
        assert _window(agent, clock, f"{tool}-new", [tool], median, 300) == pytest.approx(median)
    # a window of both: the longest; not an observation of either (only the slowest's time)
    assert _window(agent, clock, "both", ["grep", "pytest"], 30.0, 400) == pytest.approx(30.0)
    assert agent._durations.count("grep") == 4 and agent._durations.count("pytest") == 4
    # the client's estimate goes first
    agent.add_request("hint-t0", list(range(500, 530)), greedy(), session_id="hint")
    run(agent)
    agent.await_tools("hint", [ToolCall("c0", "grep")], expected_duration_s=7.0)
    assert _expected(agent, "hint") == 7.0


def test_heavy_tailed_durations_give_the_median_not_the_latest(make_agent: MakeAgent) -> None:
    agent, clock = _learned(make_agent)
    for j, (tool, median) in enumerate(MEDIANS.items()):
        got = _window(agent, clock, f"{tool}-new", [tool], median, 300 + 40 * j)
        assert got == pytest.approx(median, rel=1e-6)


def test_retention_keeps_the_short_tools_session_over_the_long_ones(
        make_agent: MakeAgent) -> None:
    """Both paused at once with equal contexts and no client estimate: the cost policy keeps
    the session whose tool is learned to return soon (``grep``) when one must go."""
    agent, _ = _learned(make_agent)
    for j, tool in enumerate(MEDIANS):
        agent.add_request(f"{tool}-t0", list(range(300 + 40 * j, 330 + 40 * j)), greedy(),
                          session_id=tool)
        run(agent)
        agent.await_tools(tool, [ToolCall("c0", tool)])
    kv, cache = agent.engine.kv, agent.engine.kv._index
    grep, pytest_ = SessionTag.session("grep"), SessionTag.session("pytest")
    while kv.tagged(grep) and kv.tagged(pytest_):
        assert cache.evict_one(max_rank=EntryRank.RETAINED)
    assert kv.tagged(grep) and not kv.tagged(pytest_)


@pytest.mark.parametrize("tool", list(MEDIANS))
def test_the_prefetch_timer_is_set_from_the_learned_duration(make_agent: MakeAgent,
                                                             tool: str) -> None:
    agent, clock = _learned(make_agent)
    agent.add_request("s-t0", list(range(300, 330)), greedy(), session_id="s")
    run(agent)
    agent.await_tools("s", [ToolCall("c0", tool)])
    lead = agent.config.prefetch_lead_s
    due = agent._timers.pending("s", TimerKind.PREFETCH)
    assert due == pytest.approx(clock.now + MEDIANS[tool] - lead)



def test_without_learning_a_window_has_only_the_declared_duration(
        make_agent: MakeAgent) -> None:
    """``learn_tool_durations=False`` (the ``edmm-no-learned`` ablation): after the same
    windows, a new one of ``grep`` has no expected duration (none declared, no hint)."""
    clock = FakeClock()
    agent = make_agent(AgentConfig(speculation=(), learn_tool_durations=False), clock=clock)
    for i, z in enumerate(Z):
        _window(agent, clock, f"g{i}", ["grep"], MEDIANS["grep"] * math.exp(z), 100)
        agent.close_session(f"g{i}")
    assert _window(agent, clock, "new", ["grep"], 0.2, 100) is None
