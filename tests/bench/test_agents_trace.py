"""The agent trace: format round trip, typed errors, the generator's calibration."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from edmm.bench.agents.trace import (
    GeneratorConfig,
    Job,
    ToolTimes,
    TraceError,
    Turn,
    as_forced_calls,
    generate,
    read_jsonl,
    scale,
    write_jsonl,
)
from edmm.bench.stats import mean, percentile


def test_tool_times_match_the_published_statistics() -> None:
    times = ToolTimes.fit(0.3, 13.6, 18.4)
    rng = random.Random(1)
    xs = [times.draw(rng) for _ in range(40_000)]
    assert percentile(xs, 50) == pytest.approx(0.3, rel=0.08)
    assert percentile(xs, 90) == pytest.approx(13.6, rel=0.1)
    assert mean(xs) == pytest.approx(18.4, rel=0.15)
    assert max(xs) <= times.cap_s


def test_generated_jobs_follow_the_config() -> None:
    cfg = GeneratorConfig(num_jobs=40)
    jobs = generate(cfg, seed=3)
    assert jobs == generate(cfg, seed=3)
    assert jobs != generate(cfg, seed=4)
    for job in jobs:
        assert 10 <= len(job.turns) <= 40
        assert 2048 <= job.system_tokens <= 8192
        for t in job.turns:
            assert 50 <= t.output_tokens <= 600
        for t in job.turns[:-1]:
            assert 1024 <= t.output_tokens + t.result_tokens <= 2560 or t.result_tokens == 1
    arrivals = [j.arrival_s for j in jobs]
    assert arrivals == sorted(arrivals)


def test_short_mix_keeps_every_tool_under_a_second() -> None:
    jobs = generate(GeneratorConfig(num_jobs=20, tool_mix="short"), seed=0)
    assert all(t.tool_s < 1.0 for j in jobs for t in j.turns if t.tool is not None)


def test_jsonl_round_trip_and_scale(tmp_path: Path) -> None:
    jobs = generate(GeneratorConfig(num_jobs=5, turns=(2, 4)), seed=0)
    assert read_jsonl(write_jsonl(jobs, tmp_path / "t.jsonl")) == jobs
    small = scale(jobs, tokens=0.01, time=0.5)
    for a, b in zip(jobs, small, strict=True):
        assert b.system_tokens == max(1, round(a.system_tokens * 0.01))
        assert [t.tool_s for t in b.turns] == [t.tool_s * 0.5 for t in a.turns]
        assert all(t.output_tokens >= 1 for t in b.turns)


def test_defaults_fill_missing_turn_fields(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"job_id": "a", "system_tokens": 10, "turns": [
        {"output_tokens": 3, "tool": "bash", "tool_s": 1.5, "result_tokens": 4},
        {"output_tokens": 2}]}) + "\n\n")
    (job,) = read_jsonl(path)
    assert job == Job("a", 10, (Turn(3, "bash", 1.5, 4), Turn(2)))


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    (json.dumps({"job_id": "a", "turns": [{"output_tokens": 1}]}), "missing field"),
    (json.dumps({"job_id": "a", "system_tokens": 5, "turns": [{"output_tokens": 1,
                                                               "tool": "x", "result_tokens": 1}]}),
     "null on the last turn"),
    (json.dumps({"job_id": "a", "system_tokens": 5, "turns": [{"output_tokens": 0}]}),
     "output_tokens"),
    (json.dumps({"job_id": "a", "system_tokens": 5, "turns": [{"output_tokens": 1,
                                                               "colour": 1}]}), "unknown"),
    (json.dumps({"job_id": "a", "system_tokens": 5, "turns": [
        {"output_tokens": 1, "tool": "x", "result_tokens": 1, "mid_prompt": 2},
        {"output_tokens": 1}]}), "mid_prompt"),
    (json.dumps({"job_id": "a", "system_tokens": "5", "turns": [{"output_tokens": 1}]}),
     "integer"),
])
def test_bad_lines_raise_a_trace_error_naming_the_line(tmp_path: Path, line: str,
                                                        message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"job_id": "ok", "system_tokens": 1,
                                "turns": [{"output_tokens": 1}]}) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=message) as err:
        read_jsonl(path)
    assert ":2:" in str(err.value)


def test_bad_generator_settings_are_typed_errors() -> None:
    with pytest.raises(TraceError, match="turns"):
        GeneratorConfig(turns=(5, 2))
    with pytest.raises(TraceError, match="tool_mix"):
        dataclasses.replace(GeneratorConfig(), tool_mix="medium")


def test_forced_calls_move_a_call_turns_output_beyond_the_call_into_its_result() -> None:
    job = Job("j", 100, (Turn(80, tool="grep", tool_s=0.1, result_tokens=30, reasoning_tokens=50),
                         Turn(20, tool="ls", result_tokens=5),
                         Turn(300, reasoning_tokens=100)))
    got = as_forced_calls([job], 56)[0]
    long, short, text = got.turns
    assert (long.output_tokens, long.result_tokens, long.reasoning_tokens) == (56, 54, 0)
    assert (short.output_tokens, short.result_tokens) == (56, 5)  # the call's own length
    assert text == job.turns[2]  # a text turn decodes its whole output, as over HTTP
    assert (long.tool, long.tool_s) == ("grep", 0.1) and got.system_tokens == 100
    with pytest.raises(TraceError, match="call_tokens"):
        as_forced_calls([job], 0)


def test_the_in_process_matrix_replays_forced_calls_when_asked() -> None:
    from edmm.bench.agents.matrix import AgentsBenchConfig, load_trace

    cfg = AgentsBenchConfig(jobs=3, token_scale=0.25, short_mix=False)
    plain = load_trace(cfg)["long"]
    forced = load_trace(dataclasses.replace(cfg, call_tokens=40))["long"]
    assert forced == as_forced_calls(plain, 40) != plain
    assert {t.output_tokens for j in forced for t in j.turns if t.tool} == {40}
    with pytest.raises(ValueError, match="call_tokens"):
        AgentsBenchConfig(call_tokens=-1)
