"""``python -m edmm.server`` (what ``edmm serve`` runs): options, start, serve, clean exit."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import pytest

from edmm.agent import KeyQuota
from edmm.server.cli import build_parser, config_from_args
from edmm.server.collector import SERVING_THRESHOLD0
from edmm.server.state import DEFAULT_MAX_AWAITING_PER_KEY, DEFAULT_MAX_SESSIONS_PER_KEY


def test_options_map_to_the_config() -> None:
    args = build_parser().parse_args(["--model", "qwen2.5-7b", "--device", "cuda", "--port",
                                      "9000", "--max-model-len", "4096",
                                      "--no-execution-aware"])
    config = config_from_args(args)
    assert (config.model, config.device, config.host, config.port) == (
        "qwen2.5-7b", "cuda", "127.0.0.1", 9000)
    assert config.engine == {"max_model_len": 4096} and not config.execution_aware
    assert config.model_name == "qwen2.5-7b"
    assert config_from_args(build_parser().parse_args([])).model_name == "edmm-tiny"
    more = config_from_args(build_parser().parse_args(["--kv-offload-gib", "0.5",
                                                       "--tokenizer", "/tok"]))
    assert more.engine == {"kv_offload_bytes": 1 << 29, "tokenizer": "/tok"}


def test_policy_and_engine_size_options() -> None:
    from edmm.agent import AgentConfig
    from edmm.agent.gate import SpeculationGate
    from edmm.bench.agents.policies import POLICIES

    quota = KeyQuota(DEFAULT_MAX_SESSIONS_PER_KEY, DEFAULT_MAX_AWAITING_PER_KEY, None)
    default = config_from_args(build_parser().parse_args([]))
    base = AgentConfig()
    # the defaults are the policy the benchmarks measure as `edmm` with the server's per-key
    # quota, host offload sized from the machine's memory (capped)
    edmm = POLICIES.create("edmm").agent_config(base.tool_timeout_s, base.prefetch_lead_s)
    assert default.agent_config() == dataclasses.replace(edmm, quota=quota)
    assert default.engine == {} and default.kv_offload_cap_bytes == 32 << 30
    off = config_from_args(build_parser().parse_args(["--no-execution-aware"]))
    assert off.agent_config() == dataclasses.replace(AgentConfig.off(), quota=quota)
    # offload: EDMM off, paused KV kept and copied to host, no prefetch
    cfg = config_from_args(build_parser().parse_args([
        "--no-execution-aware", "--retention", "keep", "--no-prefetch", "--kv-offload-gib",
        "1", "--speculation", "template,prompt", "--admission", "program",
        "--speculation-gate", "--prefetch-lead-s", "0.05", "--tool-timeout-s", "7",
        "--num-slots", "9", "--max-num-batched-tokens", "512", "--cuda-graph-sizes",
        "64,128", "--host-page-size", "16384", "--busy-spec-tokens", "4",
        "--no-spec-in-padding", "--kv-cache-policy", "blocks"]))
    assert cfg.agent_config() == AgentConfig(
        speculation=("template", "prompt"), retention="keep", admission="program",
        prefetch=False, prefetch_lead_s=0.05, tool_timeout_s=7.0,
        speculation_gate=SpeculationGate(), quota=quota)
    assert cfg.engine == {"kv_offload_bytes": 1 << 30, "num_slots": 9,
                          "max_num_batched_tokens": 512, "cuda_graph_token_sizes": (64, 128),
                          "host_page_size": 16384, "speculative_tokens_when_busy": 4,
                          "speculation_fills_padding": False, "kv_cache_policy": "blocks"}
    none = config_from_args(build_parser().parse_args(["--speculation", "none"]))
    assert none.agent_config().speculation == ()
    for bad in (["--speculation", "template,psychic"], ["--retention", "forever"],
                ["--admission", "random"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)


def test_hardening_options() -> None:
    default = config_from_args(build_parser().parse_args([]))
    assert not default.allow_client_chat_template and not default.api_docs
    assert default.hosts == ["127.0.0.1", "::1", "localhost"]
    assert default.max_body_bytes == 16 << 20
    opened = config_from_args(build_parser().parse_args([
        "--allow-client-chat-template", "--api-docs", "--max-body-mib", "2",
        "--allowed-hosts", "edmm.internal", "10.0.0.5"]))
    assert opened.allow_client_chat_template and opened.api_docs
    assert opened.max_body_bytes == 2 << 20
    assert opened.hosts == ["edmm.internal", "10.0.0.5"]
    anyone = config_from_args(build_parser().parse_args(["--allowed-hosts", "*"]))
    assert anyone.hosts is None


def test_quota_options() -> None:
    cfg = config_from_args(build_parser().parse_args([
        "--max-sessions-per-key", "10", "--max-awaiting-per-key", "0",
        "--max-kv-pages-per-key", "300"]))
    assert cfg.agent_config().quota == KeyQuota(10, None, 300)
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--max-sessions-per-key", "-1"])
    assert exit_.value.code == 2


def test_read_timeout_options() -> None:
    default = config_from_args(build_parser().parse_args([]))
    assert (default.header_timeout_s, default.body_timeout_s) == (10.0, 30.0)
    given = config_from_args(build_parser().parse_args(
        ["--header-timeout-s", "2.5", "--body-timeout-s", "7"]))
    assert (given.header_timeout_s, given.body_timeout_s) == (2.5, 7.0)
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--header-timeout-s", "0"])
    assert exit_.value.code == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # a server, subprocess or seconds of waiting: the thorough tier
def test_serve_starts_answers_and_stops_on_sigint(tiny_dir: Path) -> None:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "edmm.server", "--model", str(tiny_dir), "--port", str(port),
         "--served-model-name", "tiny", "--max-model-len", "512", "--log-level", "warning",
         "--header-timeout-s", "0.5"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
            start = time.monotonic()
            assert idle.recv(1) == b""  # closed: its headers never came
            assert 0.4 <= time.monotonic() - start < 5
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_freezes_the_start_up_objects_and_raises_the_young_threshold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` freezes what start-up made before uvicorn runs (a full collection during a
    request would walk it all: ~0.2 s on a dev CPU with torch and a tokenizer loaded)."""
    import gc

    from edmm.server import app as app_module
    from edmm.server import cli
    from edmm.server.shutdown import DrainingServer

    seen: list[int] = []
    closed: list[bool] = []
    state = types.SimpleNamespace(close=lambda: closed.append(True))
    monkeypatch.setattr(cli, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(cli, "load_state", lambda config: state)
    monkeypatch.setattr(app_module, "build_app", lambda s: "app")
    thresholds: list[tuple[int, int, int]] = []

    def run(app: object, state: object, **kw: object) -> None:
        seen.append(gc.get_freeze_count())
        thresholds.append(gc.get_threshold())

    monkeypatch.setattr(DrainingServer, "run_app", run)
    before, before_gc = sys.getswitchinterval(), gc.get_threshold()
    try:
        gc.unfreeze()
        cli.serve(cli.config_from_args(cli.build_parser().parse_args([])), "warning")
    finally:
        gc.unfreeze()
        sys.setswitchinterval(before)
        gc.set_threshold(*before_gc)
    assert seen and seen[0] > 1000 and closed == [True]
    # the young collections are the idle engine thread's (edmm.server.collector)
    assert thresholds == [(SERVING_THRESHOLD0, *before_gc[1:])]
