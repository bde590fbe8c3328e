"""A fleet trace replayed in process on the tiny model: every policy's greedy outputs equal a
plain engine running each job alone on prompts built here independently (shared prefixes,
subagents, user messages dropping reasoning, compaction); what users feel computed right on
a hand-made replay (each turn's kind, prompt, truly new tokens; pages by state); the summary
columns and the all-turn knee on hand-made rows."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from edmm.bench.agents.fleet import AgentProfile, FleetConfig, ToolProfile
from edmm.bench.agents.matrix import AgentsBenchConfig, Matrix, RunRecord
from edmm.bench.agents.replay import AFTER, BEFORE, SUFFIX, USER_AFTER, USER_BEFORE, Replayer
from edmm.bench.agents.report import prefill_columns, state_columns, summary_rows, ttft_columns
from edmm.bench.agents.targets import ALL_TURN_P90, check_targets, knee_line, knees
from edmm.bench.agents.trace import Job, Turn, write_jsonl
from edmm.engine import Engine, EngineConfig, SamplingParams

READ = ToolProfile("read", 1.0, 0.05, 0.5, 40, cacheable=True)
AGENTS = (
    AgentProfile("a", 30, 40, 1.0, (READ, ToolProfile("run", 1.0, 0.2, 1.0, 60),
                                    ToolProfile("Task", 0.4, 1.0, 0.0, 1)),
                 task_tokens=30, turns_median=8, output_median=6, reasoning_share=0.5,
                 user_messages_mean=2.0, subagent="sub"),
    AgentProfile("b", 50, 30, 1.0, (READ,), task_tokens=20, turns_median=8, output_median=5,
                 reasoning_share=0.3, user_messages_mean=1.0),
    AgentProfile("sub", 20, 20, 0.0, (READ,), task_tokens=10, turns_median=3, output_median=5,
                 user_messages_mean=0.0))
FLEET = FleetConfig(num_jobs=4, agents=AGENTS, turns=(6, 9), subagent_turns=(2, 3),
                    context_limit=1024, compact_at=0.4, summary_tokens=40, user_s=1.0)
POLICY_NAMES = ("lru", "offload", "edmm", "rewarm")


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    from edmm.model.tiny import ensure_tiny_model

    return ensure_tiny_model()


def bench(tiny_dir: Path, **kw: object) -> AgentsBenchConfig:
    base = AgentsBenchConfig(model=str(tiny_dir), jobs=4, generator=FLEET, seed=1,
                             time_scale=0.2, loads=(2,), oversubscription=2.0,
                             host_page_size=16384, warmup=False, policies=POLICY_NAMES,
                             clock="model")  # deterministic: the host's load does not count
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def run(cfg: AgentsBenchConfig) -> tuple[Matrix, list[RunRecord]]:
    import torch

    torch.set_num_threads(1)
    matrix = Matrix(cfg)
    try:
        return matrix, matrix.run(matrix.plan_main())
    finally:
        matrix.close()


@pytest.fixture(scope="module")
def fleet_runs(tiny_dir: Path) -> tuple[Matrix, list[RunRecord]]:
    return run(bench(tiny_dir))


def reference(tiny_dir: Path, jobs: list[Job], ids: Replayer) -> dict[str, str]:
    """Each job alone on a plain engine (no prefix caching), its prompts built from the
    trace's rules here, not by the replayer."""
    engine = Engine(EngineConfig(model=str(tiny_dir), dtype="float32", host_page_size=16384,
                                 enable_prefix_caching=False, max_model_len=1024))
    out: dict[str, str] = {}
    try:
        for job in jobs:
            prompt = ids._ids(job.agent, "prefix", job.prefix_tokens) + ids._ids(
                job.job_id, "system", job.system_tokens - job.prefix_tokens)
            spans: list[tuple[int, int]] = []
            for i, turn in enumerate(job.turns):
                n = turn.output_tokens
                engine.add_request("r", prompt, SamplingParams(
                    temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True))
                done = {}
                while engine.has_unfinished():
                    done.update({o.request_id: o for o in engine.step() if o.finished})
                tokens = list(done["r"].outputs[0].token_ids)
                out[f"{job.job_id}/{i}"] = hashlib.sha1(repr(tokens).encode()).hexdigest()[:16]
                if not turn.continues:
                    break
                if turn.reasoning_tokens:
                    spans.append((len(prompt), len(prompt) + turn.reasoning_tokens))
                ctx = prompt + tokens
                if turn.keep_tokens is not None and turn.keep_tokens < len(ctx):
                    ctx, spans = ctx[:turn.keep_tokens], []
                if turn.tool is not None:
                    salt = "cacheable" if turn.cacheable else job.job_id
                    result = ids._ids(f"{turn.tool}{turn.arguments}", salt, turn.result_tokens)
                    prompt = [*ctx, *BEFORE, *result, *AFTER, *SUFFIX]
                else:
                    for s, e in reversed(spans):
                        del ctx[s:e]
                    spans = []
                    message = ids._ids(f"user{i}", job.job_id, turn.user_tokens)
                    prompt = [*ctx, *USER_BEFORE, *message, *USER_AFTER, *SUFFIX]
    finally:
        engine.close()
    return out


def test_every_policy_gives_the_reference_outputs(fleet_runs, tiny_dir) -> None:
    matrix, records = fleet_runs
    jobs = matrix.mixes["long"]
    assert sum(j.parent is not None for j in jobs) >= 2  # subagents in the trace
    assert any(t.keep_tokens is not None for j in jobs for t in j.turns)  # compactions
    assert any(t.user_tokens for j in jobs for t in j.turns)  # user messages
    probe = Replayer.__new__(Replayer)
    probe.vocab = 1024
    want = reference(tiny_dir, jobs, probe)
    assert {r.condition.policy for r in records} == set(POLICY_NAMES)
    for r in records:
        assert r.result.outputs == want, r.condition.label
        assert len(r.result.jobs) == len(jobs)  # subagents too


def test_fleet_summary_columns(fleet_runs) -> None:
    matrix, records = fleet_runs
    jobs = matrix.mixes["long"]
    rows = summary_rows(records)
    kinds = {t["turn_kind"] for t in records[0].result.turns}
    assert kinds == {"first", "tool", "user"}
    for row, rec in zip(rows, records, strict=True):
        assert row["jobs"] == 4  # top-level jobs; subagents are part of theirs
        assert row["ttft_p50_ms"] <= row["ttft_p90_ms"] <= row["ttft_p99_ms"]
        for kind in ("first", "tool", "user"):
            assert row[f"{kind}_ttft_p50_ms"] > 0
        assert row["new_tokens"] == sum(t["new_tokens"] for t in rec.result.turns)
        assert row["prefill_amp"] >= 0.95  # nothing is served that was never computed
        states = [row[f"{k}_mean"] for k in ("running_pages", "paused_gpu_pages",
                                             "free_pages")]
        assert all(x is not None and x >= 0 for x in states)
        for sample in rec.result.timeline:  # running + paused on the GPU + free = the pool
            assert sample["running_pages"] + sample["paused_gpu_pages"] + \
                sample["free_pages"] == sample["pages_total"]
        parents = {j.job_id: j for j in jobs}
        for job in rec.result.jobs:  # a parent waited on its subagents' tools too
            own = sum(t.wait_s for t in parents[job["job"]].turns if not t.subagent)
            assert job["tool_s"] >= own * 0.99
    by = {r["policy"]: r for r in rows}
    assert by["lru"]["host_device_MiB"] == 0 < by["offload"]["host_device_MiB"]
    assert by["lru"]["host_pages_mean"] == 0 and by["offload"]["paused_to_running"] > 0
    assert by["rewarm"]["prefilled_tokens"] > by["lru"]["prefilled_tokens"] * 0.9


def test_a_hand_made_replay_counts_what_users_feel(tiny_dir: Path, tmp_path: Path) -> None:
    """Two jobs of one agent type (a shared 10-token prefix), one after the other: each turn's
    kind, prompt and truly new tokens follow the trace's rules exactly."""
    job = Job("x", 20, (
        Turn(4, "t", 0.1, 7, reasoning_tokens=2),
        Turn(3, reasoning_tokens=1, user_tokens=5, user_s=0.2),
        Turn(2, "t", 0.1, 6, keep_tokens=10),
        Turn(2)), 0.0, "agent", 10)
    other = dataclasses.replace(job, job_id="y")
    path = write_jsonl([job, other], tmp_path / "t.jsonl")
    _, (rec,) = run(bench(tiny_dir, trace=path, jobs=2, loads=(1,), policies=("lru",),
                          oversubscription=1.0, time_scale=1.0))
    turns = {(t["job"], t["turn"]): t for t in rec.result.turns}
    # prompts: 20; 24 + [B] 7 [A] + 3; 39 - 3 reasoning + [U] 5 [U] + 3; keep 10 + 1+6+1+3.
    assert [turns[("x", i)]["prompt_tokens"] for i in range(4)] == [20, 36, 46, 21]
    assert [turns[("x", i)]["turn_kind"] for i in range(4)] == ["first", "tool", "user",
                                                                 "tool"]
    # new: all 20 (the type's first session); 36 - 24; 46 - 20 (from the first reasoning
    # token on); 21 - 10 (the kept prefix). The second session's first turn: 20 - 10 shared.
    assert [turns[("x", i)]["new_tokens"] for i in range(4)] == [20, 12, 26, 11]
    assert turns[("y", 0)]["new_tokens"] == 10
    row = summary_rows([rec])[0]
    assert row["new_tokens"] == 2 * (20 + 12 + 26 + 11) - 10
    assert row["user_ttft_p50_ms"] is not None and row["jobs"] == 2
    for j in rec.result.jobs:
        assert j["user_s"] == pytest.approx(0.2, abs=0.05)
        assert j["tool_s"] == pytest.approx(0.4, abs=0.1)  # two tools and the user


def test_summary_column_helpers_on_hand_made_rows() -> None:
    def turn(kind: str, ttft: float, prompt: int, cached: int, new: int) -> dict[str, object]:
        return {"turn_kind": kind, "resume": kind != "first", "ttft_s": ttft,
                "prompt_tokens": prompt, "cached_tokens": cached, "new_tokens": new}

    turns = [turn("first", 0.5, 100, 0, 100), turn("tool", 0.1, 150, 100, 50),
             turn("tool", 0.3, 200, 150, 50), turn("user", 2.0, 220, 50, 70)]
    cols = ttft_columns(turns)
    assert cols["first_ttft_p50_ms"] == pytest.approx(500)
    assert cols["tool_ttft_p50_ms"] == pytest.approx(200)
    assert cols["user_ttft_p99_ms"] == pytest.approx(2000)
    assert cols["ttft_p50_ms"] == pytest.approx(400)
    pre = prefill_columns(turns, off_path=30)
    assert pre == {"prefilled_tokens": 100 + 50 + 50 + 170 + 30, "new_tokens": 270,
                   "prefill_amp": pytest.approx(400 / 270)}
    old = [{"resume": True, "ttft_s": 0.2, "prompt_tokens": 5, "cached_tokens": 1}]
    assert ttft_columns(old)["tool_ttft_p50_ms"] == pytest.approx(200)  # kind-less rows
    assert prefill_columns(old, 0)["prefill_amp"] is None
    timeline = [{"running_pages": 10, "paused_gpu_pages": 4, "host_pages": 2.0,
                 "free_pages": 6}, {"running_pages": 30, "paused_gpu_pages": 8,
                                    "host_pages": 6.0, "free_pages": 0}]
    st = state_columns(timeline)
    assert st["running_pages_mean"] == 20 and st["paused_to_running"] == pytest.approx(0.5)
    assert state_columns([{"pages_used": 3}])["paused_to_running"] is None


def test_all_turn_knee_and_targets() -> None:
    def row(policy: str, load: float, every: float, resume: float) -> dict[str, object]:
        return {"policy": policy, "tools": "long", "oversub": 2.0, "load": load,
                "ttft_p90_ms": every, "resume_ttft_p90_ms": resume, "wait_mean_s": 1.0}

    rows = [row("lru", 4, 500, 400), row("lru", 8, 1500, 900),
            row("offload", 4, 400, 300), row("offload", 8, 1000, 700),
            row("offload", 16, 3000, 1200), row("edmm", 8, 600, 500), row("edmm", 16, 1100, 900),
            row("edmm", 32, 2000, 1500)]
    every = knees(rows, 2.0, metric=ALL_TURN_P90)
    assert every["lru"].sustainable == pytest.approx(4 + 0.5 * 4)  # 1 s between 500 and 1500
    assert every["edmm"].sustainable == pytest.approx(8 + 0.8 * 8)
    assert knees(rows, 2.0)["edmm"].sustainable == pytest.approx(16 + 1 / 6 * 16)
    assert "every turn" in knee_line(rows, 2.0, ALL_TURN_P90)
    lines = {c.name: c for c in check_targets(rows, 2.0, None)}
    apc = lines["sustainable load, all-turn p90, edmm / lru (x2)"]
    assert apc.status == "PASS" and apc.measured.startswith("2.40x")  # 14.4 / 6
    conn = lines["sustainable load, all-turn p90, edmm / offload (x2)"]
    assert conn.status == "PASS" and conn.measured.startswith("1.80x")  # 14.4 / 8
