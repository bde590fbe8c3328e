"""The session state machine, and bad input: typed errors that leave the session intact."""

from __future__ import annotations

import itertools

import pytest
from agent_helpers import FakeClock, MakeAgent, drain, greedy, run

from edmm.agent import (
    AgentConfig,
    AgentEngine,
    InsertionPositionError,
    SessionState,
    SessionStateError,
    TokenLayout,
    ToolCall,
    ToolResult,
    UnknownSessionError,
    UnknownToolCallError,
)
from edmm.agent.session import Session
from edmm.engine import EngineConfigError, InvalidRequestError

S = SessionState
ALLOWED = {  # written out by hand: the state machine
    (S.GENERATING, S.FINISHED), (S.GENERATING, S.ABANDONED),
    (S.AWAITING_TOOL, S.RESUMING), (S.AWAITING_TOOL, S.ABANDONED),
    (S.RESUMING, S.GENERATING), (S.RESUMING, S.FINISHED), (S.RESUMING, S.ABANDONED),
    (S.FINISHED, S.GENERATING), (S.FINISHED, S.AWAITING_TOOL), (S.FINISHED, S.ABANDONED),
}
PROMPT = list(range(40, 100))
CALL = ToolCall("c1", "lookup", '{"q": 1}')


def test_states_are_ordered_by_lifecycle() -> None:
    assert S.GENERATING < S.AWAITING_TOOL < S.RESUMING < S.FINISHED < S.ABANDONED


@pytest.mark.parametrize("src,dst", list(itertools.product(S, S)))
def test_only_allowed_transitions_pass(src: SessionState, dst: SessionState) -> None:
    session = Session("s", state=src)
    if (src, dst) in ALLOWED:
        session.transition(dst)
        assert session.state == dst
    else:
        with pytest.raises(SessionStateError):
            session.transition(dst)
        assert session.state == src


def paused(agent: AgentEngine, session_id: str = "s") -> list[int]:
    """Run a first turn and open a tool window with one call; the session's context."""
    agent.add_request(f"{session_id}-t0", PROMPT, greedy(), session_id=session_id)
    run(agent)
    agent.await_tools(session_id, [CALL])
    return agent.session_context(session_id)


def test_agent_loop_walks_the_states(make_agent: MakeAgent) -> None:
    agent = make_agent()
    agent.add_request("t0", PROMPT, greedy(), session_id="s")
    assert agent.session_state("s") == S.GENERATING
    run(agent)
    assert agent.session_state("s") == S.FINISHED
    assert len(agent.session_context("s")) == len(PROMPT) + 6
    agent.await_tools("s", [CALL])
    assert agent.session_state("s") == S.AWAITING_TOOL
    agent.resume("s", "t1", [ToolResult("c1", [7, 8, 9])], greedy())
    assert agent.session_state("s") == S.RESUMING
    while agent.session_state("s") == S.RESUMING:
        agent.step()
    assert agent.session_state("s") == S.GENERATING
    run(agent)
    assert agent.session_state("s") == S.FINISHED
    agent.add_request("t2", [*agent.session_context("s"), 11], greedy(), session_id="s")
    assert agent.session_state("s") == S.GENERATING
    run(agent)
    agent.check_integrity()


def test_resume_of_a_session_not_awaiting_a_tool_is_refused(make_agent: MakeAgent) -> None:
    agent = make_agent()
    agent.add_request("t0", PROMPT, greedy(), session_id="s")
    with pytest.raises(SessionStateError):  # still generating
        agent.resume("s", "t1", [ToolResult("c1", [1])])
    run(agent)
    context = agent.session_context("s")
    with pytest.raises(SessionStateError) as err:  # finished, no tool call reported
        agent.resume("s", "t1", [ToolResult("c1", [1])])
    assert err.value.state == S.FINISHED
    assert agent.session_state("s") == S.FINISHED and agent.session_context("s") == context
    with pytest.raises(SessionStateError):
        agent.feed_tool_output("s", "c1", [1])
    with pytest.raises(UnknownSessionError):
        agent.resume("nope", "t1", [])
    agent.check_integrity()


def test_new_turn_while_awaiting_a_tool_is_refused(make_agent: MakeAgent) -> None:
    agent = make_agent()
    paused(agent)
    with pytest.raises(SessionStateError):
        agent.add_request("t1", PROMPT, greedy(), session_id="s")
    with pytest.raises(SessionStateError):
        agent.await_tools("s", [CALL])
    assert agent.session_state("s") == S.AWAITING_TOOL
    agent.check_integrity()


def test_unknown_tool_call_id_leaves_the_session_intact(make_agent: MakeAgent) -> None:
    agent = make_agent()
    context = paused(agent)
    with pytest.raises(UnknownToolCallError) as err:
        agent.resume("s", "t1", [ToolResult("c1", [5]), ToolResult("zz", [6])], greedy())
    assert err.value.call_id == "zz"
    with pytest.raises(UnknownToolCallError):
        agent.predict_tool_result("s", "zz", [1])
    with pytest.raises(UnknownToolCallError):
        agent.feed_tool_output("s", "zz", [1])
    assert agent.session_state("s") == S.AWAITING_TOOL
    assert not agent.has_unfinished()
    agent.check_integrity()
    agent.resume("s", "t1", [ToolResult("c1", [5])], greedy())  # the right one still works
    out = run(agent)["t1"]
    assert out.prompt_token_ids == [*context, 5]
    assert out.num_cached_tokens == len(context) - 1  # the retained KV: only new tokens run


def test_insertion_outside_the_prompt_leaves_the_session_intact(make_agent: MakeAgent) -> None:
    agent = make_agent()
    context = paused(agent)
    for bad in (-1, len(context) + 1):
        with pytest.raises(InsertionPositionError) as err:
            agent.resume("s", "t1", [ToolResult("c1", [5], position=bad)], greedy())
        assert err.value.length == len(context)
        with pytest.raises(InsertionPositionError):
            agent.predict_tool_result("s", "c1", [5], position=bad)
    with pytest.raises(InvalidRequestError):  # a token outside the vocabulary
        agent.resume("s", "t1", [ToolResult("c1", [10**6])], greedy())
    assert agent.session_state("s") == S.AWAITING_TOOL and not agent.has_unfinished()
    agent.check_integrity()
    agent.resume("s", "t1", [ToolResult("c1", [5, 6], position=10)], greedy())
    out = run(agent)["t1"]
    assert out.prompt_token_ids == [*context[:10], 5, 6, *context[10:]]
    assert out.num_cached_tokens == 10  # recomputed from the insertion point only


def test_bad_predicted_prompt_leaves_the_session_intact(make_agent: MakeAgent) -> None:
    agent = make_agent()
    context = paused(agent)
    drain(agent)  # the template source's speculation
    for bad in ([], [10**6], [0] * (agent.engine.max_model_len + 1)):
        with pytest.raises(InvalidRequestError):
            agent.predict_prompt("s", bad)
    with pytest.raises(UnknownSessionError):
        agent.predict_prompt("nobody", [5])
    assert agent.session_state("s") == S.AWAITING_TOOL and not agent.has_speculation()
    agent.check_integrity()
    agent.resume("s", "t1", [ToolResult("c1", [5])], greedy())
    with pytest.raises(SessionStateError):  # resuming: the window is closed
        agent.predict_prompt("s", [*context, 5])
    assert run(agent)["t1"].num_cached_tokens == len(context)  # the template branch
    with pytest.raises(SessionStateError):  # finished
        agent.predict_prompt("s", [*context, 5])
    agent.check_integrity()


def test_layout_positions_are_checked_at_await(make_agent: MakeAgent) -> None:
    agent = make_agent()
    agent.add_request("t0", PROMPT, greedy(), session_id="s")
    run(agent)
    n = len(agent.session_context("s"))
    with pytest.raises(InsertionPositionError):
        agent.await_tools("s", [CALL], layout=TokenLayout(positions={"c1": n + 1}))
    with pytest.raises(UnknownToolCallError):
        agent.await_tools("s", [CALL], layout=TokenLayout(positions={"c9": 0}))
    with pytest.raises(UnknownToolCallError):
        agent.await_tools("s", [CALL], predictions={"c9": [1]})
    assert agent.session_state("s") == S.FINISHED
    agent.check_integrity()


def test_deadline_abandons_the_session_and_reclaims_its_kv(make_agent: MakeAgent) -> None:
    clock = FakeClock()
    agent = make_agent(clock=clock)
    paused(agent)
    agent.predict_tool_result("s", "c1", list(range(200, 230)))
    agent.step()  # speculation starts
    assert agent.engine.stats().kv.pages_in_use > 0
    clock.advance(599.0)
    agent.step()
    assert agent.session_state("s") == S.AWAITING_TOOL
    clock.advance(2.0)  # past the default 600 s deadline
    agent.step()
    assert agent.session_state("s") == S.ABANDONED
    assert agent.session_metrics("s").abandoned
    assert agent.engine.stats().kv.pages_in_use == 0 and not agent.has_speculation()
    with pytest.raises(SessionStateError):
        agent.resume("s", "t1", [ToolResult("c1", [5])], greedy())
    with pytest.raises(SessionStateError):
        agent.add_request("t1", PROMPT, greedy(), session_id="s")
    agent.check_integrity()


def test_close_session_while_speculating_frees_everything(make_agent: MakeAgent) -> None:
    agent = make_agent(max_num_batched_tokens=32)  # the speculation takes several steps
    paused(agent)
    agent.predict_tool_result("s", "c1", list(range(200, 260)))
    agent.step()
    assert agent.has_speculation()
    agent.close_session("s")
    assert not agent.has_speculation() and agent.engine.stats().kv.pages_in_use == 0
    with pytest.raises(UnknownSessionError):
        agent.session_state("s")
    agent.check_integrity()


def test_abort_of_a_resume_finishes_the_session(make_agent: MakeAgent) -> None:
    agent = make_agent()
    paused(agent)
    agent.predict_tool_result("s", "c1", [5, 6, 7])
    drain(agent)
    agent.resume("s", "t1", [ToolResult("c1", [5, 6, 7])], greedy())
    assert agent.abort("t1")
    assert agent.session_state("s") == S.FINISHED
    agent.check_integrity()


def test_abort_of_a_generating_turn_finishes_the_session(make_agent: MakeAgent) -> None:
    agent = make_agent()
    agent.add_request("t0", PROMPT, greedy(), session_id="s")
    agent.step()
    assert agent.abort("t0") and not agent.abort("t0")
    assert agent.session_state("s") == S.FINISHED and not agent.has_unfinished()
    agent.add_request("t1", PROMPT, greedy(), session_id="s")  # the next user turn
    run(agent)
    agent.check_integrity()


def test_find_session_by_conversation_prefix(make_agent: MakeAgent) -> None:
    agent = make_agent()
    agent.add_request("a0", PROMPT, greedy(), session_id="a")
    agent.add_request("b0", list(range(500, 540)), greedy(), session_id="b")
    assert agent.find_session([*PROMPT, 1]) is None  # "a" is generating
    run(agent)
    a = agent.session_context("a")
    assert agent.find_session([*a, 1, 2, 3]) == "a"
    assert agent.find_session([*PROMPT, 9, 9]) == "a"  # the reply re-rendered differently
    assert agent.find_session(PROMPT[:-1]) is None  # shorter than a's last prompt
    assert agent.find_session(list(range(700, 760))) is None
    assert agent.session_ids() == ["a", "b"]
    agent.add_request("b1", [*agent.session_context("b"), 5], greedy(), session_id="b")
    run(agent)
    assert agent.session_ids() == ["a", "b"]  # least recently used first
    agent.add_request("a1", [*a, 5], greedy(), session_id="a")
    assert agent.session_ids() == ["b", "a"]
    run(agent)


def test_stats_sum_sessions_also_closed_ones(make_agent: MakeAgent) -> None:
    agent = make_agent()
    agent.add_request("a0", PROMPT, greedy(), session_id="a")
    agent.add_request("b0", list(range(500, 540)), greedy(), session_id="b")
    run(agent)
    stats = agent.stats()
    assert stats.sessions == {"finished": 2} and stats.turns == 2
    agent.close_session("a")
    assert agent.stats().sessions == {"finished": 1} and agent.stats().turns == 2


def test_oldest_idle_sessions_are_closed_past_max_sessions(make_agent: MakeAgent) -> None:
    agent = make_agent(AgentConfig(max_sessions=2))
    for i in range(3):
        agent.add_request(f"r{i}", list(range(10 * i + 1, 10 * i + 30)), greedy(),
                          session_id=f"s{i}")
        run(agent)
    assert agent.session_ids() == ["s1", "s2"]
    agent.check_integrity()


def test_agent_needs_prefix_caching(make_agent: MakeAgent) -> None:
    with pytest.raises(EngineConfigError):
        make_agent(enable_prefix_caching=False)


def test_a_lost_context_is_counted_when_the_turn_ends(make_agent: MakeAgent) -> None:
    """The next turn repeats the session's context: only its last token (sampled, never fed
    back) is computed again while its KV is kept; all of it once the KV is gone (counted from
    the prompts when the turn ends)."""
    agent = make_agent()
    agent.add_request("t0", PROMPT, greedy(), session_id="s")
    run(agent)
    context = agent.session_context("s")
    agent.add_request("t1", [*context, 7, 8], greedy(), session_id="s")
    run(agent)
    assert agent.session_metrics("s").context_tokens_recomputed == 1
    context = agent.session_context("s")
    agent.engine.reset_prefix_cache()  # the context's KV is lost
    agent.add_request("t2", [*context, 9], greedy(), session_id="s")
    run(agent)
    assert agent.session_metrics("s").context_tokens_recomputed == 1 + len(context)


@pytest.mark.parametrize("admission,first", [("program", "old-t1"), ("arrival", "new-t0"),
                                             ("resumes-first", "old-t1")])
def test_admission_order_of_a_resume_and_a_later_sessions_turn(
        make_agent: MakeAgent, admission: str, first: str) -> None:
    agent = make_agent(AgentConfig(admission=admission), max_num_seqs=1)
    paused(agent, "old")
    agent.add_request("new-t0", [*range(60, 90)], greedy(), session_id="new")  # queued first
    agent.resume("old", "old-t1", [ToolResult("c1", [7, 8, 9])], greedy())
    assert next(out.request_id for out in agent.step()) == first  # one request at a time
    assert set(run(agent)) >= {"new-t0", "old-t1"} - {first}


def test_resumes_first_puts_a_later_sessions_resume_ahead_of_a_new_turn(
        make_agent: MakeAgent) -> None:
    """Program order admits the older session's new turn first; resumes-first the resume."""
    for admission, first in (("program", "old-t1"), ("resumes-first", "young-t1")):
        agent = make_agent(AgentConfig(admission=admission), max_num_seqs=1)
        agent.add_request("old-t0", PROMPT, greedy(), session_id="old")
        run(agent)  # old finished its turn: its next one is a new user turn, not a resume
        paused(agent, "young")
        agent.add_request("old-t1", [*agent.session_context("old"), 5], greedy(),
                          session_id="old")
        agent.resume("young", "young-t1", [ToolResult("c1", [7, 8, 9])], greedy())
        assert next(out.request_id for out in agent.step()) == first
        run(agent)


@pytest.mark.parametrize("jump,first", [(0, "young-t1"), (1, "young-t1"), (2, "old-t1"),
                                        (None, "old-t1")])
def test_a_turn_jumps_at_most_admission_jump_turns(make_agent: MakeAgent, jump: int | None,
                                                   first: str) -> None:
    """Program order admits the older session's later turn ahead of the younger session's
    resume that arrived one turn before it, only where `AgentConfig.admission_jump` lets it
    jump that far (the resume itself is ordered as its session's first turn, one turn
    back)."""
    agent = make_agent(AgentConfig(admission="program", admission_jump=jump), max_num_seqs=1)
    agent.add_request("old-t0", PROMPT, greedy(), session_id="old")  # turn 0
    run(agent)
    paused(agent, "young")  # turn 1
    blocker = "block"
    agent.add_request(blocker, [*range(200, 240)], greedy(40))  # holds the only running seat
    agent.step()
    agent.resume("young", "young-t1", [ToolResult("c1", [7, 8, 9])], greedy())  # turn 2
    agent.add_request("old-t1", [*agent.session_context("old"), 5], greedy(),
                      session_id="old")  # turn 3
    agent.abort(blocker)
    assert next(out.request_id for out in agent.step()) == first
    run(agent)


def _admission_order(agent: AgentEngine) -> list[str]:
    """Step until every request finished; request ids in the order of their first token."""
    order: list[str] = []
    while agent.has_unfinished():
        order += [out.request_id for out in agent.step() if out.request_id not in order]
    return order


@pytest.mark.parametrize("admission", ["program", "resumes-first"])
@pytest.mark.parametrize("jump,place", [(0, 0), (3, 3), (None, 6)])
def test_a_first_turn_waits_behind_at_most_admission_jump_later_resumes(
        make_agent: MakeAgent, admission: str, jump: int | None, place: int) -> None:
    """A new session's first turn queued while older sessions' resumes keep arriving after it
    (memory or seats short: one request at a time) is admitted behind at most
    `AgentConfig.admission_jump` of them, however long the stream and whatever the clock
    says; without a bound, behind all of them."""
    clock = FakeClock()  # time stands still: no bound in seconds would promote it
    agent = make_agent(AgentConfig(speculation=(), admission=admission, admission_jump=jump),
                       clock=clock, max_num_seqs=1)
    for i in range(6):
        paused(agent, f"old{i}")
    agent.add_request("block", [*range(200, 240)], greedy(40))  # holds the only running seat
    agent.step()
    agent.add_request("new-t0", [*range(60, 90)], greedy(), session_id="new")
    for i in range(6):
        agent.resume(f"old{i}", f"old{i}-t1", [ToolResult("c1", [7, 8, 9])], greedy())
    agent.abort("block")
    order = _admission_order(agent)
    assert order.index("new-t0") == place and len(order) == 7
    resumes = [r for r in order if r != "new-t0"]
    assert resumes == [f"old{i}-t1" for i in range(6)]  # arrival order among themselves


def test_an_unknown_admission_order_or_jump_is_refused() -> None:
    with pytest.raises(EngineConfigError, match="admission"):
        AgentConfig(admission="lifo")
    with pytest.raises(EngineConfigError, match="admission_jump"):
        AgentConfig(admission_jump=-1)


def test_find_session_reported_skips_a_turn_whose_end_is_not_reported(
        make_agent: MakeAgent) -> None:
    """A turn that just finished may yet await tools: ``reported`` finds its session only
    once `end_turn` says it has none (never after `await_tools`); an aborted turn awaits
    nothing, so its session is found at once."""
    agent = make_agent()
    for sid in ("plain", "calls", "aborted"):
        agent.add_request(f"{sid}-0", PROMPT, greedy(), session_id=sid)
    agent.step()
    assert agent.abort("aborted-0")
    assert agent.find_session([*PROMPT, 1], reported=True) == "aborted"
    agent.close_session("aborted")
    run(agent)
    assert agent.find_session([*PROMPT, 1], reported=True) is None
    assert agent.find_session([*PROMPT, 1]) in ("plain", "calls")  # the library's default
    agent.await_tools("calls", [CALL])
    assert agent.find_session([*PROMPT, 1], reported=True) is None
    agent.end_turn("plain")
    assert agent.find_session([*PROMPT, 1], reported=True) == "plain"
