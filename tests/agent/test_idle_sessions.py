"""Sessions that sit idle cost a step nothing: thousands of sessions awaiting tools (their KV
long evicted) leave another owner's decode as fast as with none, and the lookups a request
makes (by tool call id, by prompt prefix) find what they did before."""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
from agent_helpers import MakeAgent, greedy, run

from edmm.agent import AgentConfig, AgentEngine, ToolCall

IDLE = 2000
DECODE_TOKENS = 100
RATIO = 1.2  # the decode beside the idle sessions, at most this times the one without
BATCH = 64
ROUNDS = 5


def _pause(agent: AgentEngine, n: int, owner: str) -> list[str]:
    """``n`` sessions of ``owner`` whose one-token turns ended in a tool call they await."""
    ids = []
    for start in range(0, n, BATCH):
        batch = [f"{owner}-{i}" for i in range(start, min(n, start + BATCH))]
        for i, sid in enumerate(batch, start):
            prompt = [1 + i % 97, 2 + i % 89, 3, 4, 5, 6, 7, 8, 9, 10 + i % 83]
            agent.submit(agent.engine.make_request(f"t-{sid}", prompt, greedy(1)), sid,
                         owner=owner)
        run(agent)
        for sid in batch:
            agent.await_tools(sid, [ToolCall(f"call-{sid}", "lookup", "{}")],
                              expected_duration_s=30.0)
        ids += batch
    return ids


def _decode(agent: AgentEngine, tag: str) -> tuple[float, int]:
    """CPU seconds of another owner's `DECODE_TOKENS`-token turn, and its steps."""
    prompt = list(range(20, 36))
    agent.submit(agent.engine.make_request(f"decode-{tag}", prompt,
                                           greedy(DECODE_TOKENS)), f"decode-{tag}",
                 owner="B")
    t0, steps = time.process_time(), 0
    while agent.has_unfinished():
        agent.step()
        steps += 1
    return time.process_time() - t0, steps


def _spied(agent: AgentEngine) -> list[Any]:
    """Every `set_retention` call the agent makes from now on."""
    calls: list[Any] = []
    kv = agent.engine.kv
    original = kv.set_retention

    def spy(*args: Any, **kwargs: Any) -> int:
        calls.append(args)
        return original(*args, **kwargs)

    kv.set_retention = spy  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("speculation", [(), ("template",)], ids=["off", "template"])
def test_idle_awaiting_sessions_cost_another_owners_decode_nothing(
        make_agent: MakeAgent, speculation: tuple[str, ...]) -> None:
    """Two agent engines, one with `IDLE` sessions of owner A awaiting tools, one with none;
    owner B's decode on each, in alternating rounds (the CPU is shared: neighbours weigh on
    both alike), the median of the rounds' ratios compared."""
    config = AgentConfig(speculation=speculation)
    alone_agent, busy_agent = make_agent(config), make_agent(config)
    ids = _pause(busy_agent, IDLE, "A")
    while busy_agent.has_speculation():
        busy_agent.step()
    alone, beside = [], []
    for r in range(ROUNDS):
        for agent, times in ((alone_agent, alone), (busy_agent, beside))[::1 - 2 * (r % 2)]:
            times.append(_decode(agent, str(r)))
    calls = _spied(busy_agent)
    _, steps = _decode(busy_agent, "spied")
    # each round's two decodes ran back to back: their ratio cancels what the neighbours did
    ratio = statistics.median(b / a for (a, _), (b, _) in zip(alone, beside, strict=True))
    print(f"\n{DECODE_TOKENS}-token decode beside {IDLE} idle sessions: {ratio:.2f}x its time "
          "alone (median over rounds)")
    assert ratio <= RATIO, (alone, beside)
    assert len(calls) <= steps  # ranks follow what memory holds: not one per session
    assert busy_agent.stats().sessions["awaiting_tool"] == IDLE
    assert busy_agent.session_awaiting(f"call-{ids[-1]}", "A") == ids[-1]
    assert busy_agent.session_awaiting(f"call-{ids[-1]}", "B") is None


def test_lookups_find_the_same_sessions_through_their_indexes(make_agent: MakeAgent) -> None:
    """By call id (only the owner's, only while awaiting), and by prompt prefix (the
    longest last prompt of the owner's finished sessions), among many sessions."""
    agent = make_agent(AgentConfig(speculation=()))
    ids = _pause(agent, 150, "A")
    assert agent.session_awaiting(f"call-{ids[7]}", "A") == ids[7]
    assert agent.session_awaiting(f"call-{ids[7]}", "B") is None
    assert agent.find_session([*agent.session_context(ids[3]), 5], "A") is None  # awaiting
    long = [11, 12, 13] * 50  # 150 tokens: a few hashed blocks
    for sid, prompt in (("short", long[:70]), ("long", long[:140]), ("other", [9, *long])):
        agent.submit(agent.engine.make_request(f"t-{sid}", prompt, greedy(1)), sid,
                     owner="A")
    agent.submit(agent.engine.make_request("t-b", long[:140], greedy(1)), "b", owner="B")
    run(agent)
    assert agent.find_session([*long, 1], "A") == "long"
    assert agent.find_session(long[:100], "A") == "short"
    assert agent.find_session(long[:60], "A") is None
    assert agent.find_session(long, "B") == "b"
    agent.close_session("long")
    assert agent.find_session(long, "A") == "short"
    agent.submit(agent.engine.make_request("t-short-2", long[:80], greedy(1)), "short")
    assert agent.find_session(long, "A") is None  # generating
