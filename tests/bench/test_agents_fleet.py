"""Trace v2 (fleets of agent types) and the trace importers: the generated statistics within
tolerance of the published ones, the structure each session must have, the JSONL and TraceLab
CSV round trips, typed errors."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from pathlib import Path

import pytest

from edmm.bench.agents.fleet import AGENTS, FleetConfig, generate_fleet
from edmm.bench.agents.trace import (
    Job,
    TraceError,
    Turn,
    check_jobs,
    job_to_dict,
    read_jsonl,
    scale,
    top_level,
    turn_shapes,
    write_jsonl,
)
from edmm.bench.agents.trace_stats import stats_table, trace_statistics
from edmm.bench.agents.tracelab import parse_tracelab, read_tracelab, write_tracelab
from edmm.bench.stats import percentile

# Tolerance of each statistic with a published number: (relative, or absolute where noted).
TOLERANCE = {
    "first request, largest agent type, median": 0.1,
    "model calls per session, median [min-max]": 0.15,
    "context at call 30, median": 0.15,
    "input : output tokens": 0.15,
    "tool latency median, claude-code": 0.2,
    "tool latency median, codex": 0.2,
    "share of tool time in calls of 1-10 min": 0.2,
    "sessions compacting at least once": 0.5,
    "prefix hit rate, unbounded retention": 0.02,
    "idle / active KV time, 5-min horizon": 0.2,
}


@pytest.fixture(scope="module")
def fleet() -> list[Job]:
    return generate_fleet(FleetConfig(num_jobs=500), seed=0)


@pytest.fixture(scope="module")
def small() -> list[Job]:
    return generate_fleet(FleetConfig(num_jobs=16), seed=3)


def test_statistics_are_within_tolerance_of_the_published_ones(fleet: list[Job]) -> None:
    stats = {s.name: s for s in trace_statistics(fleet)}
    for name, tol in TOLERANCE.items():
        s = stats[name]
        assert s.goal is not None and s.number is not None, name
        assert s.number == pytest.approx(s.goal, rel=tol), (name, s.value, s.target)
    assert stats["compactions mid tool loop"].number is not None
    assert stats["compactions mid tool loop"].number > 0.5  # "most"
    table = stats_table(list(stats.values()))
    assert table.count("\n") == len(stats) + 1 and "| ~33 [20-60] |" in table


def test_every_session_has_the_published_shape(fleet: list[Job]) -> None:
    cfg = FleetConfig()
    check_jobs(fleet)
    top = top_level(fleet)
    assert len(top) == 500 and len(fleet) > 500  # subagents beside
    assert [j.arrival_s for j in top] == sorted(j.arrival_s for j in top)
    prefixes: dict[str, set[int]] = defaultdict(set)
    for job in fleet:
        prefixes[job.agent].add(job.prefix_tokens)
        lo, hi = cfg.subagent_turns if job.parent else cfg.turns
        assert lo <= len(job.turns) <= hi
        assert job.peak_context <= cfg.context_limit
        for t, s in zip(job.turns, turn_shapes(job), strict=True):
            assert s.kept <= s.prompt and t.reasoning_tokens <= t.output_tokens
            if t.keep_tokens is not None:  # a compaction keeps the shared prefix, no more
                assert t.keep_tokens == job.prefix_tokens
    # One shared prefix per type, 6-25K, subagents ~13K.
    assert all(len(v) == 1 for v in prefixes.values())
    sizes = {a: next(iter(v)) for a, v in prefixes.items()}
    assert set(sizes) == {a.name for a in AGENTS}
    assert all(6000 <= n <= 25000 for n in sizes.values())
    assert sizes["claude-code-subagent"] == 13000
    kinds = {("user" if t.user_tokens else "tool") for j in fleet for t in j.turns[:-1]}
    assert kinds == {"user", "tool"}


def test_a_tools_time_follows_its_name(fleet: list[Job]) -> None:
    """Durations are drawn per tool name (log-normal around the profile's median), so an
    engine can learn a tool's time from its name."""
    by_tool: dict[tuple[str, str], list[float]] = defaultdict(list)
    for job in fleet:
        for t in job.turns:
            if t.tool is not None and t.subagent is None:
                by_tool[(job.agent, t.tool)].append(t.tool_s)
    for agent in AGENTS:
        for tool in agent.tools:
            xs = by_tool.get((agent.name, tool.name), [])
            if len(xs) < 300:
                continue
            assert percentile(xs, 50) == pytest.approx(tool.median_s, rel=0.25), tool.name
            spread = math.log(percentile(xs, 84) / percentile(xs, 50))
            assert spread == pytest.approx(tool.sigma, abs=0.25), tool.name


def test_subagent_calls_run_their_subagent(fleet: list[Job]) -> None:
    by_id = {j.job_id: j for j in fleet}
    calls = [t for j in fleet for t in j.turns if t.subagent is not None]
    assert calls and all(t.tool == "Task" for t in calls)
    for t in calls:
        child = by_id[t.subagent]
        assert child.agent == "claude-code-subagent" and child.parent is not None
        assert t.tool_s > child.tool_time_s  # its time: the child's tools and turns


def test_generation_is_seeded_and_checked() -> None:
    cfg = FleetConfig(num_jobs=6)
    assert generate_fleet(cfg, 1) == generate_fleet(cfg, 1) != generate_fleet(cfg, 2)
    short = generate_fleet(dataclasses.replace(cfg, tool_mix="short"), 1)
    assert all(t.tool_s < 1 for j in short for t in j.turns if t.tool and not t.subagent)
    only = generate_fleet(dataclasses.replace(cfg, names=("codex",)), 1)
    assert {j.agent for j in only} == {"codex"}
    with pytest.raises(TraceError, match="turns"):
        FleetConfig(turns=(30, 20))
    with pytest.raises(TraceError, match="names"):
        FleetConfig(names=("gemini",))


def test_scaling_keeps_the_invariants(small: list[Job]) -> None:
    scaled = scale(small, tokens=0.02, time=0.1)
    check_jobs(scaled)
    for a, b in zip(small, scaled, strict=True):
        assert b.prefix_tokens == max(1, round(a.prefix_tokens * 0.02))
        assert b.agent == a.agent and b.parent == a.parent
        for ta, tb in zip(a.turns, b.turns, strict=True):
            assert tb.user_s == pytest.approx(ta.user_s * 0.1)
            assert tb.reasoning_tokens <= tb.output_tokens
            assert (tb.keep_tokens is None) == (ta.keep_tokens is None)
        assert b.peak_context <= a.peak_context * 0.02 + 3 * len(a.turns)
    # The same agent type still shares one prefix length after scaling.
    assert len({j.prefix_tokens for j in scaled if j.agent == "codex"}) <= 1


def test_jsonl_round_trip_of_fleet_fields(small: list[Job], tmp_path: Path) -> None:
    assert read_jsonl(write_jsonl(small, tmp_path / "f.jsonl")) == small
    # A trace without fleet fields writes the same keys as before they existed.
    v1 = Job("a", 10, (Turn(3, "bash", 1.5, 4), Turn(2)))
    d = job_to_dict(v1)
    assert list(d) == ["job_id", "arrival_s", "system_tokens", "turns"]
    assert set(d["turns"][0]) == {"output_tokens", "tool", "tool_s", "result_tokens",
                                  "arguments", "mid_prompt", "reasoning_stripped", "cacheable",
                                  "predictable", "streamed"}


def test_turn_shapes_follow_compaction_and_reasoning_drops() -> None:
    job = Job("j", 100, (
        Turn(10, "t", 1.0, 20, reasoning_tokens=4),   # ctx 110 -> +20
        Turn(10, reasoning_tokens=6, user_tokens=5, user_s=3.0),  # ctx 140: drop 10 at user
        Turn(10, "t", 1.0, 30, keep_tokens=50),       # ctx 145: keep 50 -> +30
        Turn(10)), agent="a", prefix_tokens=50)
    shapes = turn_shapes(job)
    assert [(s.prompt, s.kept) for s in shapes] == [(100, 0), (130, 110), (135, 100), (80, 50)]
    assert job.peak_context == 145 and job.final_context == 100 + 40 + 20 + 5 + 30


# ---------------------------------------------------------------- TraceLab CSV

CSV = """id,input_len,output_len,arrival_time,round_idx,tool_wait_after_ms,prefix_len
s1,400,20,0.000000,0,1500.000000,1000
s1,60,30,0.000000,1,250.500000,1420
s1,200,10,0.000000,2,0.000000,1100
s2,100,5,2500.000000,1,0.000000,1600
s2,600,8,2500.000000,0,3000.000000,1000
"""


def test_tracelab_csv_reads_as_jobs() -> None:
    s1, s2 = parse_tracelab(CSV)
    assert s1 == Job("s1", 1400, (
        Turn(20, "tool", 1.5, 60),
        Turn(30, "tool", 0.2505, 200, keep_tokens=1100),  # prefix 1100 < context 1510
        Turn(10)), 0.0, "prefix-1000", 1000)
    assert s2.arrival_s == 2.5 and s2.system_tokens == 1600 and s2.agent == s1.agent
    assert s2.turns[0].result_tokens == 100  # rounds sorted; 1600 + 100 - (1600 + 8) + 8
    assert [(s.prompt, s.kept) for s in turn_shapes(s1)] == [(1400, 0), (1480, 1420),
                                                             (1300, 1100)]


def test_tracelab_round_trips(small: list[Job], tmp_path: Path) -> None:
    jobs = parse_tracelab(CSV)
    assert read_tracelab(write_tracelab(jobs, tmp_path / "a.csv")) == jobs
    assert (tmp_path / "a.csv").read_text().splitlines()[0] == CSV.splitlines()[0]
    # A fleet folds into the CSV (user messages, subagents) and then round-trips exactly.
    once = read_tracelab(write_tracelab(small, tmp_path / "b.csv"))
    assert len(once) == len(small) and sum(len(j.turns) for j in once) == sum(
        len(j.turns) for j in small)
    again = write_tracelab(once, tmp_path / "c.csv")
    assert again.read_text() == (tmp_path / "b.csv").read_text()
    assert read_tracelab(again) == once
    for a, b in zip(small, once, strict=True):  # the prompts are the same lengths
        assert [s.prompt for s in turn_shapes(a)] == [s.prompt for s in turn_shapes(b)]


@pytest.mark.parametrize("text, message", [
    ("id,input_len\ns,1\n", "missing columns"),
    (CSV.replace("s1,60,30,0.000000,1", "s1,60,30,0.000000,5"),
     ":4: session s1: round_idx 2, expected 1"),
    (CSV.replace("s1,60,30", "s1,x,30"), ":3: input_len must be a number"),
    (CSV.replace("s1,60,30", "s1,6.5,30"), ":3: input_len must be an integer"),
    (CSV.replace("s2,100,5,2500", "s2,100,5,2600"), "arrival_time"),
    (CSV.replace("s1,60,30,0.000000,1,250.500000,1420",
                 "s1,0,30,0.000000,1,250.500000,1420"), "appends no token"),
])
def test_bad_tracelab_csv_is_a_typed_error(text: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        parse_tracelab(text, "t.csv")


def test_session_id_column_is_accepted() -> None:
    jobs = parse_tracelab(CSV.replace("id,input_len", "session_id,input_len", 1))
    assert [j.job_id for j in jobs] == ["s1", "s2"]


def test_subagent_references_are_checked(tmp_path: Path) -> None:
    parent = Job("p", 10, (Turn(2, "Task", 1.0, 3, subagent="c"), Turn(1)))
    child = Job("c", 10, (Turn(1),), parent="p")
    check_jobs([parent, child])
    with pytest.raises(TraceError, match="called by no tool call"):
        check_jobs([Job("p", 10, (Turn(1),)), child])
    with pytest.raises(TraceError, match="not a job whose parent"):
        check_jobs([parent])
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(job_to_dict(parent)) + "\n")
    with pytest.raises(TraceError, match="subagent 'c'"):
        read_jsonl(path)
