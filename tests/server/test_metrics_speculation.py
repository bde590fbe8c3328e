"""Speculation in /metrics: outcomes, tokens, and what never became a branch (in place, or
gated), the counters the HTTP fleet reads to tell "no speculation offered" from "offered and
refused"."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from edmm.agent import AgentConfig, AgentEngine, SessionState, TokenLayout, ToolCall
from edmm.bench.agents.http_metrics import COUNTERS, parse_metrics
from edmm.engine import Engine, EngineConfig, SamplingParams
from edmm.server.metrics import EngineSnapshot, ServerMetrics
from edmm.server.sessions import ServerSessions


def _drain(agent: AgentEngine) -> None:
    while agent.has_unfinished() or agent.has_speculation():
        agent.step()


def test_in_place_and_gated_speculations_are_counted(tiny_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=256,
                                 num_slots=8, max_num_seqs=4, num_pages=64))
    agent = AgentEngine(engine, AgentConfig(speculation=("predicted",)))
    sessions = ServerSessions(agent)
    metrics = ServerMetrics("tiny")
    got = parse_metrics(metrics.render(EngineSnapshot.take(sessions, 0, 0)).decode())
    assert got["edmm_speculation_in_place"] == 0
    assert got["edmm_speculation_gated"] == 0
    agent.add_request("t0", list(range(100, 160)), SamplingParams(max_tokens=6, temperature=0),
                      session_id="s")
    _drain(agent)
    # The predicted result continues the session's own KV: prefilled in its slot.
    agent.await_tools("s", [ToolCall("c1", "f")], layout=TokenLayout(suffix=(2, 10)),
                      predictions={"c1": list(range(600, 620))})
    _drain(agent)
    snap = EngineSnapshot.take(sessions, 0, 0)
    got = parse_metrics(metrics.render(snap).decode())
    assert got["edmm_speculation_in_place"] == 1
    assert got["edmm_speculated_tokens"] > 0
    assert got["edmm_speculation_gated"] == 0
    gated = dataclasses.replace(snap, sessions=dataclasses.replace(snap.sessions, spec_gated=3))
    assert parse_metrics(metrics.render(gated).decode())["edmm_speculation_gated"] == 3
    engine.close()


def test_the_fleet_reads_them() -> None:
    text = "\n".join(['edmm_speculation_gated_total{model_name="m"} 4.0',
                      'edmm_speculation_in_place_total{model_name="m"} 7.0'])
    got = parse_metrics(text)
    assert {COUNTERS[k]: v for k, v in got.items()} == {"spec_gated": 4.0, "spec_in_place": 7.0}


def test_an_end_the_session_moved_past_is_logged_not_awaited(
        tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=256,
                                 num_slots=8, max_num_seqs=4, num_pages=64))
    agent = AgentEngine(engine, AgentConfig(speculation=("template",)))
    sessions = ServerSessions(agent)
    agent.add_request("t1", list(range(100, 140)), SamplingParams(max_tokens=4, temperature=0),
                      session_id="s")
    _drain(agent)
    # The end of an older request t0 of session s, with a tool call, arrives after t1 ended.
    stale = SimpleNamespace(session_key="s", request=SimpleNamespace(request_id="t0"),
                            calls=(SimpleNamespace(id="c1", name="f", arguments="{}"),))
    with caplog.at_level(logging.INFO, logger="edmm.server.sessions"):
        sessions.end(stale)  # type: ignore[arg-type]
    assert agent.session_state("s") == SessionState.FINISHED  # no tool window opened
    assert "end of request t0 ignored" in caplog.text
    assert "FINISHED, last finished t1" in caplog.text
    engine.close()
