"""Tests for edmm.bench.results: environment, CSV/JSON/Markdown files, tables, plots."""

from __future__ import annotations

import csv
import json
import math
import os
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
import torch

from edmm.bench import results
from edmm.bench.results import (
    Environment,
    ReportError,
    ResultWriter,
    collect_environment,
    format_cell,
    markdown_table,
    plot_bars,
)

_REPO = Path(__file__).resolve().parents[2]


def _env(**overrides: object) -> Environment:
    base: dict = dict(
        device="cuda",
        hostname="node1",
        platform="Linux-6.1-x86_64",
        python="3.11.7",
        torch="2.13.0",
        transformers="5.0.0",
        gpu_name="NVIDIA H200",
        driver_version="570.124.06",
        cuda_runtime="12.8",
        cpu_model="AMD EPYC 9654",
        timestamp_utc="2025-01-02T03:04:05+00:00",
        git_commit="a" * 40,
        git_dirty=False,
        command="edmm bench vmm --repeats 20",
    )
    base.update(overrides)
    return Environment(**base)


# ---------------------------------------------------------------- environment


def test_collect_environment_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDMM_GIT_COMMIT", raising=False)
    env = collect_environment("cpu")
    assert env.device == "cpu"
    assert env.gpu_name is None and env.driver_version is None and env.cuda_runtime is None
    assert (
        env.python == f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    )
    assert env.torch == torch.__version__
    assert env.hostname
    assert env.command == shlex.join(sys.argv)
    stamp = datetime.fromisoformat(env.timestamp_utc)
    assert stamp.utcoffset() == timezone.utc.utcoffset(None)
    assert abs((datetime.now(timezone.utc) - stamp).total_seconds()) < 60
    if (_REPO / ".git").exists():
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        assert env.git_commit == head
        assert isinstance(env.git_dirty, bool)
    json.dumps(env.as_dict())  # plain JSON types only


def test_collect_environment_outside_git(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDMM_GIT_COMMIT", raising=False)
    env = collect_environment("cpu", repo_dir=tmp_path)
    assert env.git_commit is None
    assert env.git_dirty is None


def test_named_commit_wins_over_a_stale_git(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the tree with a stale .git (the GPU machine's) is named by EDMM_GIT_COMMIT."""
    monkeypatch.setenv("EDMM_GIT_COMMIT", "abc1234")
    env = collect_environment("cpu", repo_dir=_REPO)
    assert env.git_commit == "abc1234" and env.git_dirty is None


def test_collect_environment_cuda_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    env = collect_environment("cuda")
    assert env.device == "cuda"
    assert env.gpu_name is None and env.driver_version is None


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, smi: str | None) -> None:
    """Pretend torch sees a GPU; put a fake (or no) nvidia-smi first on PATH."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: f"Fake GPU {index}")
    monkeypatch.delattr(torch.cuda, "driver_version", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi is not None:
        tool = bin_dir / "nvidia-smi"
        tool.write_text(f"#!/bin/sh\nprintf '{smi}'\n")
        tool.chmod(0o755)
    # git stays reachable; nothing else named nvidia-smi is.
    git_dir = Path(
        subprocess.run(["sh", "-c", "command -v git"], capture_output=True, text=True).stdout
    ).parent
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), str(git_dir)]))


def test_collect_environment_cuda_reads_nvidia_smi(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_cuda(monkeypatch, tmp_path, "550.54.15\\n550.54.15\\n")
    env = collect_environment("cuda:1")
    assert env.gpu_name == "Fake GPU 1"
    assert env.driver_version == "550.54.15"
    assert env.cuda_runtime == "12.8"


def test_collect_environment_prefers_torch_driver_version(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_cuda(monkeypatch, tmp_path, "550.54.15\\n")
    monkeypatch.setattr(torch.cuda, "driver_version", lambda: "575.1", raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert collect_environment("cuda").driver_version == "575.1"


def test_collect_environment_survives_missing_tools(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_cuda(monkeypatch, tmp_path, None)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no git, no nvidia-smi

    def broken(index: int | None = None) -> str:
        raise RuntimeError("no device")

    monkeypatch.setattr(torch.cuda, "get_device_name", broken)
    env = collect_environment("cuda:0")
    assert env.gpu_name is None
    assert env.driver_version is None
    assert env.git_commit is None


# ---------------------------------------------------------------- writer


def test_writer_round_trip(tmp_path: Path) -> None:
    env = _env()
    w = ResultWriter(tmp_path / "out", "vmm-cuda", env)
    w.add_rows([{"op": "map", "iter": 0, "us": 1.5}, {"op": "map", "iter": 1, "us": 2.25}])
    w.add_rows([{"op": "unmap", "iter": 0, "us": 0.75, "pages": 64}])  # new key: appended
    summary = [
        {"op": "map", "median_us": 1.875, "n": 2},
        {"op": "unmap", "median_us": 0.75, "n": 1},
    ]
    paths = w.write(summary, title="VMM costs", notes=["remap within 1.2x of bare"])
    assert set(paths) == {"csv", "json", "md"}
    assert paths["csv"] == tmp_path / "out" / "vmm-cuda.csv"

    with paths["csv"].open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["op", "iter", "us", "pages"]
    assert rows[1] == ["map", "0", "1.5", ""]
    assert rows[3] == ["unmap", "0", "0.75", "64"]

    doc = json.loads(paths["json"].read_text())
    assert doc["title"] == "VMM costs"
    assert doc["environment"] == env.as_dict()
    assert doc["summary"] == summary
    assert doc["rows"][2] == {"op": "unmap", "iter": 0, "us": 0.75, "pages": 64}
    assert doc["notes"] == ["remap within 1.2x of bare"]

    md = paths["md"].read_text()
    assert md.startswith("# VMM costs\n")
    for fact in ("NVIDIA H200", "570.124.06", "12.8", "2025-01-02T03:04:05+00:00", "a" * 40):
        assert fact in md
    assert "`edmm bench vmm --repeats 20`" in md
    assert "| op | median_us | n |" in md
    assert "| map | 1.875 | 2 |" in md
    assert md.rstrip().endswith("- remap within 1.2x of bare")
    assert md.index("Device") < md.index("| op |") < md.index("## Notes")


def test_writer_json_is_strict(tmp_path: Path) -> None:
    w = ResultWriter(tmp_path, "x", _env(git_commit=None, git_dirty=None))
    w.add_rows([{"v": math.nan, "np": np.float32(0.5), "i": np.int64(3), "t": torch.tensor(2.0)}])
    paths = w.write([{"inf": math.inf, "path": tmp_path, "nested": {"a": (1, 2)}}], title="t")
    text = paths["json"].read_text()
    assert "NaN" not in text and "Infinity" not in text
    doc = json.loads(text)
    assert doc["rows"] == [{"v": None, "np": 0.5, "i": 3, "t": 2.0}]
    assert doc["summary"] == [{"inf": None, "path": str(tmp_path), "nested": {"a": [1, 2]}}]
    assert "**Git commit:** unknown" in paths["md"].read_text()


def test_writer_without_rows(tmp_path: Path) -> None:
    paths = ResultWriter(tmp_path, "empty", _env()).write([], title="Nothing")
    assert paths["csv"].read_text() == ""
    assert json.loads(paths["json"].read_text())["rows"] == []
    assert "_No summary rows._" in paths["md"].read_text()


def test_dirty_tree_and_backticks_in_header(tmp_path: Path) -> None:
    env = _env(git_dirty=True, command="run `x`", gpu_name=None, device="cpu")
    md = ResultWriter(tmp_path, "d", env).write([{"a": 1}], title="T")["md"].read_text()
    assert "(uncommitted changes)" in md
    assert "`` run `x` ``" in md
    assert "**Device:** cpu\n" in md


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b"])
def test_writer_rejects_bad_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ReportError):
        ResultWriter(tmp_path, name, _env())


# ---------------------------------------------------------------- markdown


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, ""),
        (True, "True"),
        (3, "3"),
        (np.int64(4096), "4096"),
        (0.0, "0"),
        (1.23456, "1.235"),
        (12.3456, "12.35"),
        (123.456, "123.5"),
        (3.0, "3.000"),
        (-0.012345, "-0.01235"),
        (1234.56, "1235"),
        (2_500_000.4, "2500000"),
        (0.000123, "1.230e-04"),
        (1e20, "1.000e+20"),
        (math.nan, "nan"),
        (-math.inf, "-inf"),
        (np.float32(0.5), "0.5000"),
        ("a|b\nc", "a\\|b c"),
    ],
)
def test_format_cell(value: object, text: str) -> None:
    assert format_cell(value) == text


def test_markdown_table_layout() -> None:
    table = markdown_table(
        [{"op": "map", "us": 1.5, "n": 3}, {"op": "unmap", "us": None, "n": 4, "extra": "x"}]
    )
    assert table.splitlines() == [
        "| op | us | n | extra |",
        "|---|---:|---:|---|",
        "| map | 1.500 | 3 |  |",
        "| unmap |  | 4 | x |",
    ]


def test_markdown_table_needs_columns() -> None:
    with pytest.raises(ReportError):
        markdown_table([])


# ---------------------------------------------------------------- plots

_BARS = [
    {"ctx": 4096, "engine": "edmm", "ms": 1.0},
    {"ctx": 4096, "engine": "copy", "ms": 3.0},
    {"ctx": 16384, "engine": "edmm", "ms": 1.2},
    {"ctx": 16384, "engine": "copy", "ms": 9.5},
]


def test_plot_bars_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        plot_bars(_BARS, "ctx", "ms", "engine", tmp_path / "p.png", "t")


def test_plot_bars_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = plot_bars(_BARS, "ctx", "ms", "engine", tmp_path / "sub" / "p.png", "Commit cost")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    single = plot_bars(_BARS[:1], "ctx", "ms", None, tmp_path / "one.png", "One")
    assert single.stat().st_size > 0


@pytest.mark.parametrize(
    "rows",
    [[], [{"ctx": 1, "engine": "a", "ms": "slow"}], [_BARS[0], _BARS[0]], [{"ms": 1.0}]],
)
def test_plot_bars_bad_rows(tmp_path: Path, rows: list[dict]) -> None:
    pytest.importorskip("matplotlib")
    with pytest.raises(ReportError):
        plot_bars(rows, "ctx", "ms", "engine", tmp_path / "p.png", "t")


def test_module_does_not_import_matplotlib() -> None:
    assert "plt" not in vars(results) and "matplotlib" not in vars(results)


def test_progress_logs_quarters_when_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    from edmm.bench.results import Progress

    progress = Progress("x", 8)
    for i in range(8):
        progress.step(f"item {i}")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "[x] 2/8 item 1", "[x] 4/8 item 3", "[x] 6/8 item 5", "[x] 8/8 item 7"]
