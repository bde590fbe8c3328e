"""`edmm bench agents` on the tiny model: every policy replays the same trace under memory
pressure with greedy outputs identical to a plain engine running each job alone (no KV reuse at
all), every page back and every invariant intact after each run."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from edmm.bench.agents.matrix import AgentsBenchConfig, Condition, Matrix
from edmm.bench.agents.policies import POLICIES
from edmm.bench.agents.replay import AFTER, BEFORE, SUFFIX, Replayer
from edmm.bench.agents.report import best_baseline, summary_rows, sustainable
from edmm.bench.agents.trace import GeneratorConfig, Job
from edmm.engine import Engine, EngineConfig, SamplingParams

GEN = GeneratorConfig(turns=(3, 4), context_start=(40, 70), growth_per_turn=(20, 40),
                      output_tokens=(3, 6), p_mid_prompt=0.3, p_reasoning_stripped=0.3,
                      p_cacheable=0.3, p_predictable=0.4, p_streamed=0.4)
POLICY_NAMES = ("lru", "ttl", "offload", "rewarm", "edmm", "edmm-no-retention",
                "edmm-no-template")


def bench_config(tiny_dir: Path, **kw: object) -> AgentsBenchConfig:
    base = AgentsBenchConfig(model=str(tiny_dir), jobs=4, generator=GEN, time_scale=0.2,
                             loads=(3,), oversubscription=2.0, host_page_size=16384,
                             warmup=False, policies=POLICY_NAMES)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def reference_outputs(tiny_dir: Path, jobs: list[Job], ids: Replayer) -> dict[str, str]:
    """Each job's turns one after the other on a plain engine without prefix caching, the
    next prompt built here independently of the replayer."""
    engine = Engine(EngineConfig(model=str(tiny_dir), dtype="float32", host_page_size=16384,
                                 enable_prefix_caching=False, max_model_len=1024))
    out: dict[str, str] = {}
    try:
        for job in jobs:
            prompt = ids._ids(job.job_id, "system", job.system_tokens)
            for i, turn in enumerate(job.turns):
                n = turn.output_tokens
                engine.add_request(f"{job.job_id}/{i}", prompt, SamplingParams(
                    temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True))
                done = {}
                while engine.has_unfinished():
                    done.update({o.request_id: o for o in engine.step() if o.finished})
                tokens = list(done[f"{job.job_id}/{i}"].outputs[0].token_ids)
                out[f"{job.job_id}/{i}"] = hashlib.sha1(repr(tokens).encode()).hexdigest()[:16]
                if turn.tool is None:
                    break
                base = prompt + tokens
                if turn.reasoning_stripped:
                    base = prompt + tokens[len(tokens) // 2:]
                salt = "cacheable" if turn.cacheable else job.job_id
                result = ids._ids(f"{turn.tool}{turn.arguments}", salt, turn.result_tokens)
                cut = len(base) if turn.mid_prompt is None else int(turn.mid_prompt * len(base))
                prompt = [*base[:cut], *BEFORE, *result, *AFTER, *base[cut:], *SUFFIX]
    finally:
        engine.close()
    return out


@pytest.fixture(scope="module")
def tiny_module_dir() -> Path:
    from edmm.model.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="module")
def matrix_runs(tiny_module_dir: Path) -> tuple[Matrix, list]:  # type: ignore[type-arg]
    import torch

    torch.set_num_threads(1)
    matrix = Matrix(bench_config(tiny_module_dir))
    try:
        records = matrix.run(matrix.plan_main())
    finally:
        matrix.close()
    return matrix, records


def test_every_policy_gives_the_reference_greedy_outputs(matrix_runs, tiny_module_dir) -> None:
    matrix, records = matrix_runs
    jobs = matrix.mixes["long"]
    probe = Replayer.__new__(Replayer)
    probe.vocab = 1024
    want = reference_outputs(tiny_module_dir, jobs, probe)
    assert {r.condition.policy for r in records} == set(POLICY_NAMES)
    for r in records:
        assert r.result.outputs == want, r.condition.label
        assert len(r.result.jobs) == len(jobs)


def test_the_run_is_under_memory_pressure_and_mechanisms_act(matrix_runs) -> None:
    _, records = matrix_runs
    by = {r.condition.policy: r for r in records}
    assert by["lru"].result.sessions["tokens_recomputed"] > 0
    assert by["lru"].working_set_pages >= 2 * by["lru"].pages - 1
    off = by["offload"].result
    assert off.counters_after.offloads > off.counters_before.offloads
    assert off.counters_after.restored_bytes > off.counters_before.restored_bytes
    assert by["lru"].result.counters_after.offloads == 0
    edmm = by["edmm"].result.sessions
    assert edmm["spec_hits"] > 0 and edmm["tokens_speculated"] > 0
    assert by["lru"].result.sessions["tokens_speculated"] == 0


def test_summary_rows_account_for_tool_time(matrix_runs) -> None:
    _, records = matrix_runs
    rows = summary_rows(records)
    for row, rec in zip(rows, records, strict=True):
        for job in rec.result.jobs:
            assert job["jct_s"] >= job["tool_s"] > 0
            assert job["engine_wait_s"] == pytest.approx(job["jct_s"] - job["tool_s"])
        assert row["outputs_as_lru"] is True and row["turns_as_lru"] == 1.0
        assert row["outputs_digest"] == rows[0]["outputs_digest"]  # the same tokens everywhere
        assert 0 <= row["prefix_hit_rate"] <= 1
        assert row["pages_used_max"] <= row["pages"]
        share = row["mem_wait_running_share"]
        assert (share is None) == (row["mem_wait_steps"] == 0)
        assert share is None or 0 < share <= 1
        assert row["resume_ttft_p50_ms"] <= row["resume_ttft_p90_ms"] <= row["resume_ttft_p99_ms"]


def test_outputs_digest_tells_runs_apart() -> None:
    from edmm.bench.agents.report import outputs_digest

    a = {"j0/0": "aa", "j0/1": "bb"}
    assert outputs_digest(a) == outputs_digest(dict(reversed(a.items())))  # order-free
    assert outputs_digest(a) != outputs_digest({**a, "j0/1": "bc"})
    assert outputs_digest(a) != outputs_digest({"j0/0": "aa"})


def test_sustainable_load_and_best_baseline() -> None:
    def row(policy: str, load: float, p90: float, wait: float) -> dict[str, object]:
        return {"policy": policy, "tools": "long", "oversub": 2.0, "load": load,
                "resume_ttft_p90_ms": p90, "wait_mean_s": wait}

    rows = [row("lru", 8, 300, 5), row("lru", 32, 1500, 9), row("ttl", 8, 200, 4),
            row("ttl", 32, 900, 6), row("offload", 8, 100, 4), row("offload", 32, 800, 5),
            row("edmm", 8, 50, 2), row("edmm", 32, 400, 3)]
    assert sustainable(rows) == {"lru": 8, "ttl": 32, "offload": 32, "edmm": 32}
    assert best_baseline(rows, 2.0) == "offload"  # ttl ties on load, offload waits less


def test_unknown_policy_fails_before_any_engine(tiny_module_dir: Path) -> None:
    from edmm.agent.errors import UnknownPolicyError

    with pytest.raises(UnknownPolicyError, match="nope"):
        Matrix(bench_config(tiny_module_dir, policies=("lru", "nope")))


def test_every_registered_policy_builds_an_agent_config() -> None:
    for name in POLICIES:
        cfg = POLICIES.create(name).agent_config(10.0, 0.05)
        assert cfg.tool_timeout_s == 10.0
    assert POLICIES.create("lru").speculation == ()
    assert not POLICIES.create("edmm-no-offload").prefetch
    def order(name: str) -> str:
        return POLICIES.create(name).agent_config(10.0, 0.05).admission

    assert order("ttl") == "program"  # Continuum's program-level FCFS
    assert order("edmm-no-admission") == order("lru") == order("offload") == "arrival"
    assert order("edmm") != "arrival"
    edmm = POLICIES.create("edmm").agent_config(10.0, 0.05)
    assert edmm.speculate_in_place and edmm.learn_tool_durations
    assert edmm.speculation_gate is not None and edmm.speculation_gate.pool_sessions
    assert not POLICIES.create("edmm-no-inplace").agent_config(10.0, 0.05).speculate_in_place
    no_learn = POLICIES.create("edmm-no-learned").agent_config(10.0, 0.05)
    assert not no_learn.learn_tool_durations and no_learn.speculate_in_place
    gate = POLICIES.create("edmm-no-pooled").agent_config(10.0, 0.05).speculation_gate
    assert gate is not None and not gate.pool_sessions


def test_open_loop_pool_is_sized_for_its_working_set_sessions(tiny_module_dir: Path) -> None:
    """An open loop's load is a rate (jobs/s), not sessions: its pool is the working set of
    `OPEN_LOOP_SESSIONS` sessions (or ``working_set_sessions``) over the oversubscription,
    whatever the rate; a closed loop's is the working set of its load's sessions."""
    from edmm.bench.agents.matrix import OPEN_LOOP_SESSIONS, pool_pages, working_set_pages

    cfg = bench_config(tiny_module_dir, jobs=8, mode="open", loads=(0.5, 4.0))
    jobs = Matrix(cfg).mixes["long"]
    want = -(-working_set_pages(jobs, OPEN_LOOP_SESSIONS, cfg) // 2)
    assert want > pool_pages(jobs, 1, 2.0, dataclasses.replace(cfg, mode="closed"))
    assert pool_pages(jobs, 0.5, 2.0, cfg) == pool_pages(jobs, 4.0, 2.0, cfg) == want
    sized = dataclasses.replace(cfg, working_set_sessions=6)
    assert pool_pages(jobs, 0.5, 2.0, sized) == -(-working_set_pages(jobs, 6, cfg) // 2)
    closed = dataclasses.replace(cfg, mode="closed")
    assert pool_pages(jobs, 4, 2.0, closed) == -(-working_set_pages(jobs, 4, cfg) // 2)


def test_one_condition_runs_alone(tiny_module_dir: Path) -> None:
    import torch

    torch.set_num_threads(1)
    matrix = Matrix(bench_config(tiny_module_dir, jobs=2, mode="open", loads=(50.0,)))
    try:
        (rec,) = matrix.run([Condition("short", 1.0, 50.0, "edmm")])
    finally:
        matrix.close()
    assert len(rec.result.jobs) == 2


def test_model_clock_runs_are_deterministic_and_charge_the_model(tiny_module_dir: Path) -> None:
    """``clock="model"``: time is the step-time model's seconds alone, so the same condition
    replays to the same job completion times (host speed does not count), the engine time of
    the steps is what the model charged, and the agent layer's tool windows run on the same
    clock (each job's tool time is the trace's)."""
    import torch

    from edmm.engine.step_cost import H200_QWEN7B

    torch.set_num_threads(1)
    cfg = bench_config(tiny_module_dir, clock="model", policies=("offload",))
    runs = []
    for _ in range(2):
        matrix = Matrix(cfg)
        try:
            (rec,) = matrix.run([Condition("long", 2.0, 3, "offload")])
            assert matrix._engine is not None and matrix._engine.step_time_model is H200_QWEN7B
        finally:
            matrix.close()
        runs.append(rec.result)
    first, second = runs
    assert [j["jct_s"] for j in first.jobs] == [j["jct_s"] for j in second.jobs]
    assert first.makespan_s == second.makespan_s and first.busy_step_s > 0
    jobs = {j.job_id: j for j in Matrix(cfg).mixes["long"]}
    for row in first.jobs:
        want = sum(t.tool_s for t in jobs[row["job"]].turns)
        assert row["tool_s"] == pytest.approx(want, abs=0.2)  # + the step it returned in


def test_step_log_accounts_for_every_engine_second(tiny_module_dir: Path, tmp_path: Path) -> None:
    """``step_log``: one row per step the replay ran, whose seconds add up to the run's busy
    and speculation-only engine time, with the speculative tokens edmm computed; written as
    ``agents-steps.csv``."""
    import csv

    import torch

    from edmm.bench.agents.report import write_steps

    torch.set_num_threads(1)
    cfg = bench_config(tiny_module_dir, clock="model", policies=("edmm",), step_log=True)
    matrix = Matrix(cfg)
    try:
        (rec,) = matrix.run([Condition("long", 2.0, 3, "edmm")])
    finally:
        matrix.close()
    res, steps = rec.result, rec.result.steps
    busy = [s for s in steps if s["phase"] == "busy"]
    assert busy and {s["phase"] for s in steps} <= {"busy", "spec"}
    assert sum(s["agent_step_s"] for s in busy) == pytest.approx(res.busy_step_s, rel=1e-4)
    assert sum(s["agent_step_s"] for s in steps if s["phase"] == "spec") == pytest.approx(
        res.spec_only_step_s, rel=1e-4, abs=1e-6)
    assert sum(s["speculative_tokens"] for s in steps) == res.sessions["tokens_speculated"]
    for s in steps:
        assert 0 <= s["speculative_tokens"] <= s["tokens"] and s["decode_rows"] <= s["seqs"]
        assert s["engine_step_s"] == pytest.approx(s["agent_step_s"], abs=1e-6)  # model clock
    with write_steps([rec], tmp_path / "steps.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(steps) and rows[0]["policy"] == "edmm"
