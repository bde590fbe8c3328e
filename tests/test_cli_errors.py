"""The command line explains itself: help lines with defaults, --version, and bad arguments as
one-line errors (exit status 2, naming the flag and its range, no traceback)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edmm import __version__
from edmm.argparsing import HelpFormatter
from edmm.cli import build_parser, main


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(("argv", "words"), [
    (["bench", "ttft", "--contexts", "256,1024", "--result-tokens", "512"],
     ["--contexts", "--result-tokens + 2 = 514", "512 on CUDA, 32 on the CPU", "got 256"]),
    (["bench", "ttft", "--device", "cpu", "--contexts", "16"],
     ["--result-tokens + 2 = 34", "got 16"]),
    (["bench", "ttft", "--only", "model", "--device", "cpu", "--contexts", "16"],
     ["--new-tokens = 32", "got 16"]),
    (["bench", "ttft", "--repeats", "0"], ["--repeats", ">= 1", "got 0"]),
    (["bench", "ttft", "--insert-fraction", "1.5"], ["--insert-fraction", "[0, 1)"]),
    (["bench", "ttft", "--contexts", "1024,x"], ["--contexts", "comma-separated integers"]),
    (["bench", "ttft", "--device", "tpu"], ["--device", "auto, cpu or cuda"]),
    (["bench", "live", "--contexts", "300"],
     ["--contexts", "2 x --result-tokens + 128 = 640", "got 300"]),
    (["bench", "live", "--tool-duration", "-1"], ["--tool-duration", ">= 0"]),
    (["bench", "vmm", "--host-page-size", "5000"], ["--host-page-size", "multiple of 4096"]),
    (["bench", "vmm", "--repeats", "-3"], ["--repeats", ">= 1"]),
    (["bench", "agents", "--jobs", "4", "--loads", "2,8"],
     ["--loads", "closed loop of 8 sessions", "the trace has 4", "--jobs"]),
    (["bench", "agents", "--trace", "/nonexistent/edmm-trace.jsonl"],
     ["--trace", "No such file"]),
    (["bench", "nope"], ["invalid choice", "'nope'"]),
    (["demo", "--iterations", "0"], ["--iterations", ">= 1"]),
    (["demo", "--contexts", "16"], ["--contexts", "--result-tokens"]),
    (["serve", "--port", "0"], ["--port", ">= 1"]),
    (["serve", "--kv-cache-policy", "lru"], ["--kv-cache-policy", "'lru'", "'apc', 'blocks'"]),
    (["proxy", "--upstream", "http://x", "--port", "-1"], ["--port", ">= 1"]),
])
def test_bad_arguments_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                    words: list[str]) -> None:
    line = _error_line(capsys, argv)
    assert "error:" in line and "--help" in line
    for w in words:
        assert w in line, line


def test_a_bad_trace_file_is_one_line(capsys: pytest.CaptureFixture[str],
                                      tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"job": 1}\n')
    line = _error_line(capsys, ["bench", "agents", "--trace", str(trace)])
    assert "--trace" in line and "trace.jsonl:1" in line and "unknown fields" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_an_error_not_a_traceback(
        capsys: pytest.CaptureFixture[str]) -> None:
    for bench in ("ttft", "live"):
        line = _error_line(capsys, ["bench", bench, "--device", "cuda"])
        assert "--device cuda: no CUDA device here" in line


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"edmm {__version__}"


def _parsers() -> list[argparse.ArgumentParser]:
    from edmm.demo import build_parser as demo_parser
    from edmm.proxy.cli import build_parser as proxy_parser
    from edmm.server.cli import build_parser as serve_parser

    out = [demo_parser(), proxy_parser(), serve_parser()]
    todo = [build_parser()]
    while todo:
        p = todo.pop()
        out.append(p)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [c for c in a.choices.values() if c.add_help]
    return out


def test_every_flag_has_help_and_shows_its_default() -> None:
    parsers = _parsers()
    assert len(parsers) >= 9
    for p in parsers:
        fmt = HelpFormatter(p.prog)
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._VersionAction,
                              argparse._SubParsersAction)):
                continue
            assert a.help, f"{p.prog} {a.option_strings} has no help line"
            shown = fmt._get_help_string(a) or ""
            if a.default not in (None, False) and not a.required:
                assert "default" in shown, f"{p.prog} {a.option_strings}: {shown}"
        if any(a.option_strings and a.default not in (None, False, argparse.SUPPRESS)
               for a in p._actions):
            assert "(default: " in p.format_help(), p.prog


@pytest.mark.slow  # a server, subprocess or seconds of waiting: the thorough tier
def test_serve_refuses_a_busy_port_before_loading() -> None:
    """Exit 2 with the one line, and nothing logged of loading a model before it."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "edmm.server", "--port", str(port)],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--port {port}" in lines[0] and "in use" in lines[0], lines
    assert "loading model" not in proc.stderr + proc.stdout


@pytest.mark.slow  # a server subprocess: tests/server/test_cli.py starts one in the fast tier
def test_serve_logs_loading_then_the_url(tiny_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "edmm.server", "--model", str(tiny_dir),
                             "--port", str(port), "--max-model-len", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line or len(lines) > 200:
                break
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    text = "".join(lines)
    loading = text.index(f"loading model {tiny_dir} on cpu ...")
    loaded = text.index("loaded in ")
    url = text.index(f"at http://127.0.0.1:{port}/v1")
    assert loading < loaded < url, text
