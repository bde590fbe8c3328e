"""`edmm bench load` and its peers, against a stand-in server whose timings are known (the real
peers, vLLM on a GPU, run on the device machine)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from edmm.bench.load import (
    LoadConfig,
    Prompts,
    RequestRecord,
    ratio_rows,
    run_load_bench,
    summarize_level,
)
from edmm.bench.peers import (
    PeerError,
    ServerSpec,
    VLLMOptions,
    edmm_spec,
    measure_each,
    parse_peer,
    served,
    vllm_spec,
)

STANDIN = Path(__file__).with_name("standin_server.py")


def standin(first_ms: float = 40.0, token_ms: float = 8.0, name: str = "stand-in") -> ServerSpec:
    return ServerSpec(name, launch=(sys.executable, str(STANDIN), "--port", "{port}",
                                    "--first-ms", str(first_ms), "--token-ms", str(token_ms)),
                      ready_timeout_s=60.0)


def test_prompts_fresh_and_shared() -> None:
    cfg = LoadConfig(prompt_tokens=(40,), token_range=(10, 1000))
    fresh = Prompts(cfg, 40, "fresh").take(3)
    assert all(len(p) == 40 and all(10 <= t < 1000 for t in p) for p in fresh)
    assert len({tuple(p[:8]) for p in fresh}) == 3
    shared = Prompts(cfg, 40, "shared")
    a, b = shared.take(2)
    assert a[:30] == b[:30] and a[30:] != b[30:]  # 75% common, the rest each its own
    assert Prompts(cfg, 40, "shared").take(1) == [a]  # seeded


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="prefix modes"):
        LoadConfig(prefixes=("odd",))
    with pytest.raises(ValueError, match="token_range"):
        LoadConfig(token_range=(5, 5))
    assert LoadConfig(min_requests=8, rounds=2).requests(32) == 64
    assert LoadConfig(min_requests=8, rounds=2).requests(1) == 8


def test_level_summary_and_ratios() -> None:
    recs = [RequestRecord(ttft_s=0.1, e2e_s=0.5, itl_s=[0.01] * 3, output_tokens=4,
                          prompt_tokens=10, cached_tokens=5),
            RequestRecord(ttft_s=0.3, e2e_s=0.9, itl_s=[0.02] * 3, output_tokens=4,
                          prompt_tokens=10, cached_tokens=5),
            RequestRecord(error="HTTP 500: boom")]
    row = summarize_level("A", 10, "fresh", 2, recs, wall_s=2.0)
    assert (row["requests"], row["errors"], row["output_tok_s"]) == (3, 1, 4.0)
    assert row["ttft_p50_ms"] == pytest.approx(200.0)
    assert row["ttft_min_ms"] == pytest.approx(100.0)
    assert row["itl_p50_ms"] == pytest.approx(15.0)
    assert row["tpot_p50_ms"] == pytest.approx((400 / 3 + 600 / 3) / 2)
    assert row["cached_frac"] == pytest.approx(0.5)
    other = dict(row, server="B", output_tok_s=8.0, ttft_p50_ms=100.0)
    ratios = ratio_rows([row, other], base="A")
    assert len(ratios) == 1 and ratios[0]["output_tok_s_ratio"] == pytest.approx(2.0)
    assert ratios[0]["ttft_p50_ms_ratio"] == pytest.approx(0.5)


def test_vllm_peers_command_lines() -> None:
    opts = VLLMOptions("/m", python_path="/site", kv_cache_bytes=10 << 30, offload_gib=8,
                       max_model_len=4096)
    apc = vllm_spec("vllm", opts, "served")
    cmd = " ".join(apc.launch)
    for flag in ("serve /m", "--load-format dummy", "--enable-prefix-caching",
                 "--enable-auto-tool-choice", "--tool-call-parser hermes",
                 f"--kv-cache-memory-bytes {10 << 30}", "--max-model-len 4096",
                 "--served-model-name served", "--port {port}"):
        assert flag in cmd
    assert "--kv-offloading-size" not in cmd and "fp8" not in cmd
    # forced tool calls: the arguments' schema without free whitespace (random weights would
    # pad hermes' structural tag with whitespace until max_tokens)
    so = apc.launch[apc.launch.index("--structured-outputs-config") + 1]
    assert json.loads(so) == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert apc.env["VLLM_ENFORCE_STRICT_TOOL_CALLING"] == "0"
    assert apc.env["PYTHONPATH"].split(":")[0] == "/site"
    assert apc.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert "--kv-offloading-size 8" in " ".join(vllm_spec("vllm-offload", opts, "s").launch)
    assert "--kv-cache-dtype fp8" in " ".join(vllm_spec("vllm-fp8", opts, "s").launch)
    assert parse_peer("http://h:1/", None, "s").url == "http://h:1"
    with pytest.raises(PeerError, match="needs --peer-model-dir"):
        parse_peer("vllm", None, "s")
    with pytest.raises(PeerError, match="unknown peer"):
        parse_peer("sglang", opts, "s")
    assert "--model" in edmm_spec(["--model", "x"]).launch


def test_a_server_that_fails_to_start_says_why(tmp_path: Path) -> None:
    spec = ServerSpec("broken", launch=(sys.executable, "-c", "import sys; print('no GPU here');"
                                        " sys.exit(3)"), ready_timeout_s=30)
    with pytest.raises(PeerError, match="exited with 3:\nno GPU here"), served(spec, tmp_path):
        pass
    assert (tmp_path / "broken.log").read_text().strip() == "no GPU here"


@pytest.mark.slow  # two server subprocesses; the rows' arithmetic: test_level_summary_and_ratios
def test_load_curve_against_a_stand_in(tmp_path: Path) -> None:
    """Two stand-ins with known timings measured in turn: the table and plot have both, the
    tokens add up, TTFT and ITL sit at the stand-ins' delays (at least the delay; within the
    level's wall time: a loaded machine only adds), the faster stand-in measures faster
    (summed over its rows), the launched processes are gone afterwards."""
    cfg = LoadConfig(prompt_tokens=(32,), output_tokens=6, concurrency=(1, 3),
                     prefixes=("fresh", "shared"), min_requests=3, rounds=1.0,
                     token_range=(10, 1000), device="cpu")
    paths = run_load_bench(cfg, [standin(40, 8, "slow"), standin(20, 4, "fast")], tmp_path)
    doc = json.loads(Path(paths["json"]).read_text())
    rows = {(r["server"], r["prefix"], r["concurrency"]): r for r in doc["summary"]}
    assert len(rows) == 8
    for (server, _, _c), r in rows.items():
        assert r["errors"] == 0 and r["requests"] == 3
        first, token = (40, 8) if server == "slow" else (20, 4)
        assert first <= r["ttft_p50_ms"] < r["wall_s"] * 1e3
        assert token * 0.8 <= r["itl_p50_ms"]
        assert (cfg.output_tokens - 1) * r["itl_p50_ms"] < r["wall_s"] * 1e3
        assert r["cached_frac"] == pytest.approx(0.5, abs=0.02)
        assert r["output_tok_s"] * r["wall_s"] == pytest.approx(18)
    ttft = {s: sum(r["ttft_p50_ms"] for (server, _, _), r in rows.items() if server == s)
            for s in ("fast", "slow")}
    assert ttft["fast"] < ttft["slow"]  # 4 x 20 ms apart
    assert "Ratios (each server over slow)" in Path(paths["md"]).read_text()
    if "png" in paths:
        assert Path(paths["png"]).stat().st_size > 10_000
    assert (tmp_path / "logs" / "slow.log").exists()


@pytest.mark.slow  # an edmm serve subprocess (the embedded model)
def test_stages_split_each_level_of_the_edmm_server(tmp_path: Path) -> None:
    """``stages``: the EDMM server (not the stand-in beside it) logs its requests' stages;
    each level's rows count that level's requests only (not the warm-up's), and the engine's
    span lies inside the client's TTFT."""
    cfg = LoadConfig(prompt_tokens=(64,), output_tokens=3, concurrency=(1, 2),
                     prefixes=("shared",), min_requests=3, rounds=1.0, token_range=(10, 1000),
                     device="cpu")
    spec = edmm_spec(["--max-model-len", "256"])
    paths = run_load_bench(cfg, [spec, standin(20, 4, "fast")], tmp_path, stages=True)
    doc = json.loads(Path(paths["stages_json"]).read_text())
    spans = {(r["concurrency"], r["span"]): r for r in doc["summary"]}
    assert {r["server"] for r in doc["summary"]} == {"EDMM"}
    load = {r["concurrency"]: r for r in json.loads(Path(paths["json"]).read_text())["summary"]
            if r["server"] == "EDMM"}
    for c in (1, 2):
        engine = spans[(c, "step_start->output_put")]
        assert engine["n"] == 3  # cfg.requests(c): the warm-up's record is not there
        assert spans[(c, "first_output->first_event")]["n"] == 3
        assert engine["p50"] < load[c]["ttft_p50_ms"]
    assert len((tmp_path / "load-stages-0.jsonl").read_text().splitlines()) == 1 + 3 + 3


@pytest.mark.slow  # a bench subprocess and its server
def test_a_stopped_run_keeps_its_rows_and_stops_its_server(tmp_path: Path) -> None:
    """SIGTERM in the middle of a run (a device call's time limit): the bench unwinds, the
    server it started is stopped, and the rows measured so far are in ``load-rows.jsonl``."""
    import os
    import signal
    import subprocess
    import time

    marker = f"edmm-standin-{os.getpid()}"
    driver = (
        "import sys; from pathlib import Path; "
        "from edmm.bench.load import LoadConfig, run_load_bench; "
        "from edmm.bench.peers import ServerSpec; "
        f"spec = ServerSpec('slow', launch=(sys.executable, '-X', 'pycache_prefix=/tmp/{marker}', "
        f"{str(STANDIN)!r}, '--port', '{{port}}', '--first-ms', '5', '--token-ms', '60'), "
        "ready_timeout_s=60.0); "
        "cfg = LoadConfig(prompt_tokens=(8,), output_tokens=4, concurrency=(1,) * 50, "
        "min_requests=1, rounds=1.0, token_range=(10, 1000), device='cpu'); "
        f"run_load_bench(cfg, [spec], Path({str(tmp_path)!r}))")
    proc = subprocess.Popen([sys.executable, "-c", driver])
    rows_log = tmp_path / "load-rows.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and not (
            rows_log.exists() and rows_log.read_text().count("\n") >= 2):
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    rows = [json.loads(line) for line in rows_log.read_text().splitlines()]
    assert len(rows) >= 2 and all(r["server"] == "slow" and r["errors"] == 0 for r in rows)
    assert not (tmp_path / "load.json").exists()

    def alive() -> bool:
        for cmd in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if marker.encode() in cmd.read_bytes():
                    return True
            except OSError:
                continue
        return False

    stop = time.monotonic() + 10
    while alive() and time.monotonic() < stop:
        time.sleep(0.1)
    assert not alive(), "the stand-in server outlived the stopped bench"


def test_the_edmm_server_is_labelled_as_named() -> None:
    """``--edmm-name`` labels the EDMM server (a variant measured in its own run stays apart
    when runs are merged); peers keep their names; the default label is EDMM."""
    from edmm.bench.commands.common import server_specs
    from edmm.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "load", "--edmm-args", "--max-num-batched-tokens 8192",
                              "--edmm-name", "EDMM 8K budget", "--peer", "http://127.0.0.1:9"])
    args.parser = parser
    specs = server_specs(args)
    assert [s.name for s in specs] == ["EDMM 8K budget", "http://127.0.0.1:9"]
    assert specs[0].launch is not None and "--max-num-batched-tokens" in specs[0].launch
    assert server_specs(parser.parse_args(["bench", "load"]))[0].name == "EDMM"


def test_sigterm_swallowed_by_a_finalizer_still_ends_the_run(tmp_path: Path) -> None:
    """SIGTERM arriving while a finalizer runs (CI saw an event loop's ``__del__``) has its
    `SystemExit` swallowed by Python; the run still ends with 143 at the next row, keeping
    the rows measured, and restores the previous handler."""
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    measured: list[int] = []

    def measure(spec: ServerSpec, logs: Path, on_row: Any) -> list[dict[str, Any]]:
        rows = []
        for i in range(3):
            if i == 1:
                with contextlib.suppress(SystemExit):  # what a finalizer does to it
                    os.kill(os.getpid(), signal.SIGTERM)
            measured.append(i)
            rows.append({"server": spec.name, "i": i})
            on_row(rows[-1])
        return rows

    with pytest.raises(SystemExit) as stopped:
        measure_each([ServerSpec("a", launch=("true",))], tmp_path, "load", measure)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert measured == [0, 1]
    lines = (tmp_path / "load-rows.jsonl").read_text().splitlines()
    assert [json.loads(line)["i"] for line in lines] == [0, 1]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_failing_server_is_reported_and_the_next_one_runs(tmp_path: Path) -> None:
    """A server whose measurement raises one of the listed errors keeps the rows it gave
    before failing; the next server still runs; the failure is named in the notes. Every
    server failing is a `PeerError`; an error not listed propagates."""
    from edmm.bench.load import LoadBenchError

    def measure(spec: ServerSpec, logs: Path, on_row: Any) -> None:
        on_row({"server": spec.name, "i": 0})
        if spec.name != "ok":
            raise LoadBenchError(f"{spec.name}: every request failed")
        on_row({"server": spec.name, "i": 1})

    specs = [ServerSpec(n, url="http://127.0.0.1:1") for n in ("bad", "ok")]
    got = measure_each(specs, tmp_path, "load", measure, errors=(PeerError, LoadBenchError))
    assert [(r["server"], r["i"]) for r in got.rows] == [("bad", 0), ("ok", 0), ("ok", 1)]
    assert got.failed == {"bad": "LoadBenchError: bad: every request failed"}
    (note,) = got.failure_notes()
    assert note.startswith("bad failed, its rows after the failure are missing")
    assert len((tmp_path / "load-rows.jsonl").read_text().splitlines()) == 3

    def fails(spec: ServerSpec, logs: Path, on_row: Any) -> None:
        raise PeerError(f"{spec.name} exited with 1")

    with pytest.raises(PeerError, match="every server failed: bad: PeerError: bad exited"):
        measure_each(specs[:1], tmp_path, "load", fails)
    with pytest.raises(LoadBenchError):
        measure_each(specs[:1], tmp_path, "load", measure)  # not listed: it propagates
