"""`edmm bench agents --http` on the CPU: the server flags of each policy read back as the
in-process matrix's engine and agent config, /metrics parsing, the comparison table, and a small
trace through `edmm serve` (tiny model, loopback) under lru, offload and edmm with identical
greedy outputs."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from edmm.bench.agents.matrix import AgentsBenchConfig, Matrix, pool_pages
from edmm.bench.agents.policies import POLICIES
from edmm.bench.agents.trace import GeneratorConfig
from edmm.engine import EngineConfig


def _bench(**kw: object) -> AgentsBenchConfig:
    gen = dataclasses.replace(GeneratorConfig(), turns=(2, 3))
    base: dict[str, object] = dict(jobs=3, generator=gen, token_scale=0.1, time_scale=0.01)
    base.update(kw)
    return AgentsBenchConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["lru", "ttl", "offload", "edmm", "edmm-no-gate",
                                  "edmm-no-prefetch", "edmm-no-inplace", "edmm-no-learned",
                                  "edmm-no-pooled"])
def test_serve_args_read_back_as_the_in_process_run(name: str) -> None:
    from edmm.bench.agents.http import TOOL_TIMEOUT_S, HttpReplayConfig, serve_args
    from edmm.server.cli import build_parser, config_from_args

    hcfg = HttpReplayConfig(bench=_bench(dtype="float32", cuda_graph_token_sizes=(64, 128),
                                         speculative_tokens_when_busy=8,
                                         speculation_fills_padding=False),
                            load=2, policies=(name,))
    matrix = Matrix(hcfg.matrix_config())
    policy = POLICIES.create(name)
    engine = matrix.engine_config(policy.offload, policy.cache)
    # The pool is the in-process run's at this load and oversubscription (+ the pad page).
    assert engine.num_pages == pool_pages(matrix.mixes["long"], 2, 2.0, matrix.cfg) + 1
    args = build_parser().parse_args(serve_args(policy, engine, matrix.cfg.prefetch_lead_s))
    server = config_from_args(args)
    assert server.agent_config() == policy.agent_config(TOOL_TIMEOUT_S,
                                                        matrix.cfg.prefetch_lead_s)
    built = EngineConfig(model=engine.model, device=engine.device, **server.engine)
    for f in dataclasses.fields(EngineConfig):
        want, got = getattr(engine, f.name), getattr(built, f.name)
        assert got == want or str(got) == str(want), f.name
    assert (engine.kv_offload_bytes > 0) == policy.offload


def test_http_refuses_a_client_side_policy() -> None:
    from edmm.bench.agents.http import HttpBenchError, HttpReplayConfig, http_policies

    assert {"lru", "ttl", "offload", "edmm"} <= set(http_policies())
    with pytest.raises(HttpBenchError, match="rewarm"):
        HttpReplayConfig(policies=("lru", "rewarm"))


def test_parse_metrics() -> None:
    from edmm.bench.agents.http import parse_metrics

    text = "\n".join([
        "# HELP edmm_kv_restores_total Host copies of KV brought back.",
        'edmm_kv_restores_total{model_name="m"} 3.0',
        'edmm_speculation_outcomes_total{model_name="m",outcome="hit"} 2.0',
        'edmm_kv_pages_in_use{model_name="m"} 17.0',
        'python_gc_objects_collected_total{generation="0"} 9.0'])
    assert parse_metrics(text) == {"edmm_kv_restores": 3.0,
                                   "edmm_speculation_outcomes:hit": 2.0,
                                   "edmm_kv_pages_in_use": 17.0}


def test_in_process_rows_of_the_same_load_point_go_beside(tmp_path: Path) -> None:
    from edmm.bench.agents.http import HttpReplayConfig, comparison_lines, in_process_rows

    cfg = HttpReplayConfig(bench=_bench(), load=2, policies=("lru", "edmm"))
    rows = [{"policy": p, "tools": t, "load": load, "oversub": 2.0, "wait_mean_s": w}
            for p, t, load, w in (("lru", "long", 2.0, 1.5), ("edmm", "long", 2.0, 1.0),
                                  ("edmm", "short", 2.0, 9.0), ("edmm", "long", 8.0, 9.0))]
    meta = {"seed": 0, "jobs": 3, "token_scale": 0.1, "time_scale": 0.01}
    (tmp_path / "agents.json").write_text(json.dumps({"summary": rows, "meta": meta}))
    found = in_process_rows(tmp_path, cfg)
    assert [(r["policy"], r["wait_mean_s"]) for r in found] == [("lru", 1.5), ("edmm", 1.0)]
    lines = comparison_lines([{"policy": "edmm", "load": 2.0, "wait_mean_s": 1.25}], found)
    assert "| edmm | 2 |" in lines[-1] and "1.25 / 1" in lines[-1]  # paired by load too
    assert comparison_lines([{"policy": "edmm", "load": 4.0, "wait_mean_s": 1.0}], found) == []
    other = HttpReplayConfig(bench=_bench(seed=1), load=2, policies=("lru",))
    assert in_process_rows(tmp_path, other) == []  # another trace: nothing beside


@pytest.fixture()
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server subprocesses too


@pytest.mark.slow  # three server subprocesses and their client processes
@pytest.mark.usefixtures("_one_thread")
def test_http_replay_of_lru_offload_edmm(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from edmm.bench.agents.http import HttpReplayConfig, run_http_bench

    cfg = HttpReplayConfig(bench=_bench(), load=2, policies=("lru", "offload", "edmm"),
                           start_timeout_s=120, request_timeout_s=60, overlap_tail=1,
                           clients=2,  # one session in each of two client processes
                           stages=True)
    paths = run_http_bench(cfg, tmp_path)
    doc = json.loads(paths["json"].read_text())
    summary = {r["policy"]: r for r in doc["summary"]}
    assert list(summary) == ["lru", "offload", "edmm"]
    jobs = Matrix(cfg.matrix_config()).mixes["long"]
    turns = [r for r in doc["rows"] if r["kind"] == "turn"]
    assert len(turns) == 3 * sum(len(j.turns) for j in jobs)
    for r in summary.values():
        assert r["jobs"] == 3 and r["wait_mean_s"] > 0 and r["resume_ttft_p50_ms"] > 0
        assert r["outputs_as_lru"] is True  # EDMM on and off: the same greedy outputs
        assert r["server_resumes"] == sum(len(j.turns) - 1 for j in jobs)
        assert r["client_procs"] == 2 and 0 < r["client_cpu_max"] <= 1.5
    assert all(t["ttft_s"] <= t["total_s"] for t in turns)
    assert summary["lru"]["restores"] == summary["lru"]["offloads"] == 0
    assert summary["lru"]["spec_tokens"] == 0 and summary["edmm"]["spec_tokens"] > 0
    assert paths["md"].read_text().count("| edmm |") == 1
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())  # each server's own output
    assert logs == ["edmm-edmm-2.log", "edmm-lru-2.log", "edmm-offload-2.log"]
    assert all("POST /v1/chat/completions" in (tmp_path / "logs" / n).read_text() for n in logs)
    stages = json.loads(paths["stages_json"].read_text())
    per_turn = {p: sum(1 for t in turns if t["policy"] == p) for p in summary}
    for p, n in per_turn.items():  # every measured request, none of the warm-up's
        assert sum(1 for r in stages["rows"] if r["policy"] == p) == n
        spans = {r["span"]: r for r in stages["summary"] if r["policy"] == p}
        assert spans["step_start->output_put"]["n"] == n
        split = spans["(step_start->scheduled)"]["p50"] + spans["(scheduled->output_put)"]["p50"]
        assert split > 0 and spans["memory_wait_steps (count)"]["n"] == n


def test_client_columns_are_the_in_process_definitions() -> None:
    from edmm.bench.agents.http import client_columns

    def row(resume: bool, call: bool, ttft: float, prompt: int, cached: int) -> dict[str, object]:
        return {"resume": resume, "ends_in_call": call, "ttft_s": ttft,
                "prompt_tokens": prompt, "cached_tokens": cached}

    cols = client_columns([row(False, True, 9.0, 100, 0), row(True, True, 0.5, 200, 150),
                           row(True, False, 0.1, 300, 200)])
    assert cols["recomputed_tokens"] == 150  # (200 - 150) + (300 - 200); first turns left out
    assert cols["prefix_hit_rate"] == pytest.approx(350 / 500)
    assert cols["content_resume_ttft_p50_ms"] == pytest.approx(100.0)  # the content resume
    assert cols["resume_ttft_p50_ms"] == pytest.approx(300.0)  # both resumes


def test_client_processes_split_the_sessions() -> None:
    from edmm.bench.agents.http_client import client_processes

    assert client_processes(32, 0) == 8  # one per four sessions by default
    assert client_processes(2, 0) == 1
    assert client_processes(3, 5) == 3  # never more processes than sessions
    assert client_processes(32, 1) == 1


@pytest.mark.slow  # spawns client processes
def test_a_failing_client_process_is_a_typed_error_not_a_hang() -> None:
    pytest.importorskip("openai")
    from edmm.bench.agents.http import HttpReplayConfig
    from edmm.bench.agents.http_client import (
        ClientSpec,
        HttpBenchError,
        new_event,
        replay_clients,
    )

    jobs = Matrix(HttpReplayConfig(bench=_bench()).matrix_config()).mixes["long"]
    spec = ClientSpec("http://127.0.0.1:9", None, "lru", 5.0, "run")  # nothing listens
    started: list[str] = []
    with pytest.raises(HttpBenchError, match="a client process failed"):
        replay_clients(spec, jobs, 2, 2, new_event(), started.append, lambda r: None)
    assert started == []  # no job was handed out


def test_the_sampler_counts_from_the_clients_readiness() -> None:
    from edmm.bench.agents.http_metrics import Sampler

    class Probe:  # /metrics of a server whose pages grow by one a read
        def __init__(self) -> None:
            self.reads = 0

        def text(self) -> str:
            self.reads += 1
            return str(self.reads)

    probe = Probe()
    sampler = Sampler(probe, 0.01, lambda text: {"pages_used": float(text)})  # type: ignore[arg-type]
    while probe.reads < 5:
        time.sleep(0.01)
    sampler.restart()  # what came before was the clients' start-up
    restarted = probe.reads
    time.sleep(0.1)
    samples = sampler.stop()
    assert samples and all(s["pages_used"] > restarted - 1 for s in samples)
    assert 0 < samples[0]["t_s"] < 0.1 and samples[-1]["t_s"] < 0.3
