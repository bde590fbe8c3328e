"""`edmm bench agents --http` with fleet traces and peers, on the CPU: a fleet (shared prefixes,
subagents, user messages, compaction) through `edmm serve` with identical greedy outputs under
two policies; the peer plumbing (vLLM's command line from EDMM's pool, its metrics, the rows and
knees) against a stand-in chat server started as a fake ``vllm`` and as a URL."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from edmm.bench.agents.fleet import AgentProfile, FleetConfig, ToolProfile
from edmm.bench.agents.matrix import AgentsBenchConfig, Matrix, page_size
from edmm.bench.peers import ServerSpec, VLLMOptions, served

STANDIN = Path(__file__).with_name("standin_server.py")
READ = ToolProfile("read", 1.0, 0.05, 0.5, 30, cacheable=True)
AGENTS = (
    AgentProfile("a", 60, 120, 1.0, (READ, ToolProfile("run", 1.0, 0.2, 1.0, 40),
                                     ToolProfile("Task", 0.5, 1.0, 0.0, 1)),
                 task_tokens=30, turns_median=6, output_median=5, user_messages_mean=2.0,
                 subagent="sub"),
    AgentProfile("sub", 40, 60, 0.0, (READ,), task_tokens=10, turns_median=2,
                 output_median=4, user_messages_mean=0.0))
FLEET = FleetConfig(num_jobs=3, agents=AGENTS, turns=(5, 7), subagent_turns=(2, 2),
                    context_limit=1024, compact_at=0.5, summary_tokens=30, user_s=1.0)


def bench(**kw: object) -> AgentsBenchConfig:
    base = AgentsBenchConfig(jobs=3, generator=FLEET, seed=5, time_scale=0.05, loads=(2,),
                             host_page_size=16384)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_the_trace_has_what_the_tests_need() -> None:
    jobs = Matrix(bench()).mixes["long"]
    assert any(j.parent for j in jobs)
    assert any(t.keep_tokens is not None for j in jobs for t in j.turns)
    assert any(t.user_tokens for j in jobs for t in j.turns)


@pytest.fixture()
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server subprocesses too


@pytest.mark.slow  # two edmm serve subprocesses and their client processes
@pytest.mark.usefixtures("_one_thread")
def test_a_fleet_through_edmm_serve(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from edmm.bench.agents.http import HttpReplayConfig, run_http_bench

    cfg = HttpReplayConfig(bench=bench(), load=2, policies=("lru", "edmm"),
                           start_timeout_s=120, request_timeout_s=60, clients=1)
    doc = json.loads(run_http_bench(cfg, tmp_path)["json"].read_text())
    jobs = Matrix(cfg.matrix_config()).mixes["long"]
    turns = [r for r in doc["rows"] if r["kind"] == "turn"]
    assert len(turns) == 2 * sum(len(j.turns) for j in jobs)  # subagents' turns too
    for row in doc["summary"]:
        assert row["jobs"] == 3 and row["server"] == "edmm serve"
        assert row["outputs_as_lru"] is True
        for kind in ("first", "tool", "user"):
            assert row[f"{kind}_ttft_p50_ms"] > 0
        assert row["new_tokens"] > 0 and row["prefill_amp"] > 0.5
        assert row["running_pages_mean"] is not None and row["free_pages_mean"] is not None
    kinds = {(r["job"], r["turn"]): r["turn_kind"] for r in turns if r["policy"] == "edmm"}
    for job in jobs:
        for i, t in enumerate(job.turns[:-1]):
            assert kinds[(job.job_id, i + 1)] == ("user" if t.user_tokens else "tool")
    lines = (tmp_path / "agents-http-timeline.csv").read_text().splitlines()
    assert "running_pages" in lines[0] and len(lines) > 2


@pytest.mark.slow  # four stand-in server subprocesses and their client processes
def test_vllm_peers_get_edmm_memory_and_are_measured(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("openai")
    from edmm.bench.agents.http import HttpReplayConfig, run_http_bench
    from edmm.bench.agents.http_peers import peer_options
    from edmm.bench.live import load_tokenizer
    from tests.bench.standin_server import write_fake_vllm

    argv_file = tmp_path / "argv.jsonl"
    monkeypatch.setenv("FAKE_VLLM_ARGV", str(argv_file))
    opts = VLLMOptions("/models/tiny", python_path=str(write_fake_vllm(tmp_path / "fake")))
    cfg = HttpReplayConfig(bench=bench(warmup=False), load=1, loads=(1, 2), policies=(),
                           peers=("vllm", "vllm-offload"), vllm=opts, clients=1,
                           request_timeout_s=60)
    paths = run_http_bench(cfg, tmp_path / "out")
    doc = json.loads(paths["json"].read_text())
    rows = {(r["policy"], r["load"]): r for r in doc["summary"]}
    assert set(rows) == {(p, ld) for p in ("vllm", "vllm-offload") for ld in (1.0, 2.0)}
    launches = [json.loads(x) for x in argv_file.read_text().splitlines()]
    assert len(launches) == 4
    tok = load_tokenizer(None)
    for i, argv in enumerate(launches):  # loads 1, 1, 2, 2; vllm before vllm-offload
        at = dataclasses.replace(cfg, load=(1, 2)[i // 2])
        matrix = Matrix(at.matrix_config())
        want = peer_options(at, matrix, matrix.mixes["long"], tok)
        edmm = matrix.engine_config(False)
        assert edmm.num_pages is not None and want.kv_cache_bytes is not None
        flags = dict(zip(argv[2::2], argv[3::2], strict=False))
        assert argv[:2] == ["serve", "/models/tiny"]
        assert "--enable-prompt-tokens-details" in argv and "--enable-prefix-caching" in argv
        assert int(flags["--max-num-seqs"]) == edmm.max_num_seqs
        assert int(flags["--max-num-batched-tokens"]) == edmm.max_num_batched_tokens
        # EDMM's KV pool (its pages less the pad page) in bytes, and its context limit.
        assert int(flags["--kv-cache-memory-bytes"]) == want.kv_cache_bytes
        assert want.kv_cache_bytes >= (edmm.num_pages - 1) * page_size(matrix.cfg)
        assert int(flags["--max-model-len"]) == want.max_model_len
        if i % 2:
            gib = matrix.engine_config(True).kv_offload_bytes / 2**30
            assert float(flags["--kv-offloading-size"]) == pytest.approx(gib, rel=1e-5)
        else:
            assert "--kv-offloading-size" not in flags
    for row in rows.values():
        assert row["server"] == "vLLM" and row["jobs"] == 3
        assert row["first_ttft_p50_ms"] >= 30 and row["user_ttft_p50_ms"] >= 30
        assert row["server_prefix_hit_rate"] is not None and row["kv_usage_mean"] is not None
        assert row["running_pages_mean"] is None  # vLLM does not say
        assert row["prefix_hit_rate"] > 0.3 and row["prefill_amp"] > 0
        assert "outputs_as_lru" not in row
    md = paths["md"].read_text()
    assert "p90 TTFT of every turn" in md
    assert (tmp_path / "out" / "logs" / "vllm-apc.log").exists()


@pytest.mark.slow  # a stand-in server subprocess and client processes
def test_a_url_peer_gets_nothing_edmm_specific(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    import httpx

    from edmm.bench.agents.http import HttpReplayConfig
    from edmm.bench.agents.http_peers import replay_peer

    spec = ServerSpec("stand-in", launch=(sys.executable, str(STANDIN), "--port", "{port}",
                                          "--first-ms", "20", "--chat"), ready_timeout_s=60)
    with served(spec, tmp_path) as url:
        # Streamed results and predictions would be EDMM-only: edmm's client options.
        cfg = HttpReplayConfig(bench=bench(warmup=False), load=2, policies=("edmm",),
                               peers=(url,),
                               clients=1, request_timeout_s=60)
        run = replay_peer(cfg, url)
        stats = httpx.get(f"{url}/stats").json()
    assert stats["other"] == 0  # no session deletion, no tool output, nothing else
    assert stats["forced"] == sum(1 for t in run.turns if t["ends_in_call"])
    assert run.summary["policy"] == url and run.summary["server"] == "URL"
    assert run.summary["jobs"] == 3


def test_parse_vllm_metrics_sums_engines() -> None:
    from edmm.bench.agents.http_metrics import parse_vllm_metrics, vllm_counters, vllm_states

    text = "\n".join([
        "# TYPE vllm:prefix_cache_hits_total counter",
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0',
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 10.0',
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 80.0',
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'edmm_kv_pages_in_use{model_name="m"} 3.0'])
    m = parse_vllm_metrics(text)
    assert m == {"prefix_cache_hits": 40.0, "prefix_cache_queries": 80.0,
                 "gpu_cache_usage_perc": 0.25}
    assert vllm_states(m) == {"kv_usage": 0.25}
    c = vllm_counters({"prefix_cache_hits": 20.0, "prefix_cache_queries": 40.0}, m)
    assert c["server_prefix_hit_rate"] == pytest.approx(0.5)  # (40-20) / (80-40)
    assert c["external_prefix_hit_rate"] is None


def test_the_server_context_holds_the_rendered_prefixes() -> None:
    """At a small token scale an agent type's tool schemas outgrow its trace prefix: the
    server's context grows by the excess (the replay's prompts were refused without it)."""
    from edmm.bench.agents.http import server_engine
    from edmm.bench.agents.http_client import prefix_excess
    from edmm.bench.live import load_tokenizer

    tok = load_tokenizer(None)
    small = Matrix(bench(generator=FleetConfig(num_jobs=2), jobs=2, token_scale=0.01, seed=1))
    jobs = small.mixes["long"]
    excess = prefix_excess(tok, jobs)
    assert excess > 0
    base = small.engine_config(False)
    assert base.max_model_len is not None
    engine = server_engine(base, small.cfg, jobs, tok)
    assert engine.max_model_len is not None and engine.max_model_len >= base.max_model_len + excess


def test_a_compaction_below_the_shared_prefix_keeps_it_counted() -> None:
    """A compaction that keeps fewer tokens than the system message still keeps that message
    (the shared prefix every engine finds cached), and counts its tokens as kept: the next
    turn's new tokens are what follows it (2026-12-07: the whole prompt was counted new, so
    prefill amplification came out below 1 on EDMM and vLLM alike)."""
    from edmm.bench.agents.chat import Conversation

    chat = Conversation([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                        shared_tokens=5248)
    chat.replied(6000, 12, {"role": "assistant", "content": "a"})
    assert chat.kept == 6012
    chat.keep(3000)  # a summary shorter than the shared prefix
    assert chat.kept == 5248 and len(chat.messages) == 1
    chat.keep(6100)
    assert chat.kept == 5248
