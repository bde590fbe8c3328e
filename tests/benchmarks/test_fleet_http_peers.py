"""`benchmarks.scripts.fleet_http_peers` on the CPU: the GPU command's options parse and its
trace is generated; the whole run (edmm serve with the tiny model, two stand-in vLLM peers,
two load points, the merge, the tarball) with only the model, device and scales changed; the
time budget skipping a load point."""

from __future__ import annotations

import json
import shlex
import tarfile
from pathlib import Path

import pytest

from benchmarks.scripts.fleet_http_peers import bench_argv, main, parse_args
from edmm.cli import main as edmm_main


def test_the_gpu_commands_parse_and_generate_their_trace(tmp_path: Path, capsys) -> None:
    """The default (GPU) command of a load point, with ``--write-trace``: every option is
    edmm's, the trace is the fleet's (a subagent, compaction, user messages)."""
    args = parse_args(["--out", str(tmp_path / "r")])
    argv = bench_argv(args, 3, tmp_path / "r" / "load-3")
    assert argv[3:6] == ["bench", "agents", "--http"]
    assert "--peer-model-dir" in argv and "/tmp/qwen25-7b-dummy" in argv
    assert argv[argv.index("--tokenizer") + 1] == "/tmp/qwen25-7b-dummy"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--peer"] == ["vllm", "vllm-offload"]
    assert argv[argv.index("--policies") + 1] == "edmm"
    rebuilt = bench_argv(parse_args(["--out", "r", "--policies", "lru,offload,edmm"]), 3, Path("x"))
    assert rebuilt[rebuilt.index("--policies") + 1] == "lru,offload,edmm"
    trace = tmp_path / "trace.jsonl"
    assert edmm_main([*argv[3:], "--write-trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "| sessions (top-level / subagents) | 4,265 sessions (TraceLab) | 6 / 1 | 6 / 1 |" in out
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert any(t.get("keep_tokens") for j in lines for t in j["turns"])
    assert any(t.get("user_tokens") for j in lines for t in j["turns"])
    assert main(["--out", str(tmp_path / "r"), "--dry-run"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and shlex.split(printed[0]) == argv
    assert "agents-merge" in printed[2] and not (tmp_path / "r").exists()


def test_bad_loads_are_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--out", "x", "--loads", "3,a"])
    assert exc.value.code == 2 and "--loads" in capsys.readouterr().err


def _cpu(tmp_path: Path, tiny: Path, site: Path, *more: str) -> list[str]:
    """The GPU command with the tiny model on the CPU and a trace it can replay in seconds."""
    return ["--out", str(tmp_path / "fleet"), "--model", "", "--device", "cpu", "--dtype",
            "float32", "--peer-model-dir", str(tiny), "--peer-python-path", str(site),
            "--trace-arg=--jobs=2", "--trace-arg=--turns=3,4", "--trace-arg=--token-scale=0.01",
            "--trace-arg=--time-scale=0.002", "--trace-arg=--host-page-size=16384",
            "--trace-arg=--http-clients=1", *more]


@pytest.mark.slow  # edmm serve and two stand-in peers at two load points, then the merge
def test_the_run_writes_one_folder(tmp_path: Path, tiny_dir: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    pytest.importorskip("matplotlib")
    from tests.bench.standin_server import write_fake_vllm

    monkeypatch.setenv("FAKE_VLLM_ARGV", str(tmp_path / "argv.jsonl"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    site = write_fake_vllm(tmp_path / "site")
    assert main(_cpu(tmp_path, tiny_dir, site, "--loads", "1,2")) == 0
    out = tmp_path / "fleet"
    doc = json.loads((out / "agents.json").read_text())
    assert {(r["policy"], r["load"]) for r in doc["summary"]} == {
        (p, float(n)) for p in ("edmm", "vllm", "vllm-offload") for n in (1, 2)}
    assert doc["meta"]["clock"] == "wall"
    md = (out / "agents.md").read_text()
    assert "p90 TTFT of every turn" in md and "edmm / vllm-offload" in md
    assert (out / "agents-knees.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "load-1" / "agents-http.json").exists()
    assert (out / "load-2" / "logs" / "vllm-apc---offloadingconnector.log").exists()
    summary = (out / "fleet-http-peers.md").read_text()
    assert "- load 1:" in summary and "- load 2:" in summary and "skipped" not in summary
    launches = [json.loads(x) for x in (tmp_path / "argv.jsonl").read_text().splitlines()]
    assert len(launches) == 4 and all(a[:2] == ["serve", str(tiny_dir)] for a in launches)
    with tarfile.open(tmp_path / "fleet.tgz") as tar:
        assert "fleet/agents.md" in tar.getnames()


@pytest.mark.slow  # edmm serve at one load point
def test_the_budget_skips_a_load_point(tmp_path: Path, tiny_dir: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(_cpu(tmp_path, tiny_dir, tmp_path, "--peers", "", "--loads", "2,1",
                     "--budget-s", "0")) == 0
    out = tmp_path / "fleet"
    assert sorted(p.name for p in out.glob("load-*")) == ["load-1"]  # lowest first
    assert "- load 2: skipped" in (out / "fleet-http-peers.md").read_text()
    rows = json.loads((out / "agents.json").read_text())["summary"]
    assert [(r["policy"], r["load"]) for r in rows] == [("edmm", 1.0)]
    # another run's load point merged with this one's; an absent folder is a line, not a stop
    again = _cpu(tmp_path, tiny_dir, tmp_path, "--peers", "", "--loads", "2")
    again[1] = str(tmp_path / "fleet2")
    assert main([*again, "--merge-also", str(out / "load-1"),
                 "--merge-also", str(tmp_path / "absent")]) == 0
    rows = json.loads((tmp_path / "fleet2" / "agents.json").read_text())["summary"]
    assert sorted((r["policy"], r["load"]) for r in rows) == [("edmm", 1.0), ("edmm", 2.0)]
    assert "absent: not merged" in (tmp_path / "fleet2" / "fleet-http-peers.md").read_text()
