"""The stage log (``$EDMM_STAGE_LOG``) of a live server: each chat's and text completion's
record holds the chain of stages in order, the scheduler's first admission (``scheduled``)
inside the engine's ``step_start->output_put``, and the steps it waited for memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_helpers import MODEL, serve, server_config

from edmm.server import ServerState
from edmm.server.stages import ENV, STAGES


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_stage_records_hold_the_scheduler_admission(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    log = tmp_path / "stages.jsonl"
    monkeypatch.setenv(ENV, str(log))
    for live in serve(ServerState(server_config(tiny_dir))):
        client = live.client()
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                  max_tokens=4, temperature=0)
        if stream:
            list(client.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
        else:
            client.chat.completions.create(**kw)  # type: ignore[call-overload]
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    marks = record["marks"]
    chain = [marks[s] for s in STAGES if s in marks]
    assert chain == sorted(chain) and {"step_start", "output_put", "first_event"} <= set(marks)
    assert marks["step_start"] <= marks["scheduled"] <= marks["output_put"]
    assert record["counts"] == {"memory_wait_steps": 0}  # nothing else held the pool
    assert record["stream"] is stream


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_completion_records_its_first_prompt(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    log = tmp_path / "stages.jsonl"
    monkeypatch.setenv(ENV, str(log))
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13]]
    for live in serve(ServerState(server_config(tiny_dir))):
        client = live.client()
        kw = dict(model=MODEL, prompt=prompts, max_tokens=4, temperature=0)
        if stream:
            list(client.completions.create(stream=True, **kw))  # type: ignore[call-overload]
        else:
            client.completions.create(**kw)  # type: ignore[call-overload]
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    marks = record["marks"]
    chain = [marks[s] for s in STAGES if s in marks]
    assert chain == sorted(chain)
    assert {"received", "arrive", "request_made", "step_start", "output_put", "first_output",
            "first_event"} <= set(marks)
    assert marks["step_start"] <= marks["scheduled"] <= marks["output_put"]
    assert record["id"].startswith("cmpl") and record["stream"] is stream
    assert record["prompt_tokens"] == len(prompts[0])


def test_engine_split_needs_every_mark() -> None:
    from edmm.server.stages import engine_split_ms

    marks = {"step_start": 1_000_000, "scheduled": 4_000_000, "output_put": 10_000_000}
    assert engine_split_ms(marks) == {"(step_start->scheduled)": 3.0,
                                      "(scheduled->output_put)": 6.0}
    del marks["scheduled"]  # a record from before the scheduler's mark
    assert engine_split_ms(marks) == {}
