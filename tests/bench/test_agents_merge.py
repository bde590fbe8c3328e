"""Knees, target checks and the merge of subset runs of `edmm bench agents`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edmm.bench.agents.merge import MergeError, merge, readme_table
from edmm.bench.agents.plots import load_axis_label, load_label
from edmm.bench.agents.targets import check_targets, knees, worst_metric


def _row(policy: str, load: float, p90: float, wait: float = 1.0, tools: str = "long",
         oversub: float = 2.0, **kw: Any) -> dict[str, Any]:
    base = {"policy": policy, "tools": tools, "oversub": oversub, "load": load,
            "resume_ttft_p90_ms": p90, "wait_mean_s": wait, "jct_mean_s": wait + 1}
    return {**base, **kw}


def test_knee_is_interpolated_where_p90_crosses_one_second() -> None:
    rows = [_row("lru", 32, 400), _row("lru", 64, 800), _row("lru", 96, 1600),
            _row("edmm", 32, 300), _row("edmm", 64, 500), _row("edmm", 96, 700)]
    kn = knees(rows, 2.0)
    assert kn["lru"].knee == 96 and kn["lru"].sustained == 64
    assert kn["lru"].sustainable == pytest.approx(64 + 200 / 800 * 32)
    assert not kn["edmm"].reached and kn["edmm"].sustainable == 96
    assert "knee not reached" in kn["edmm"].describe()


def test_targets_pass_miss_and_not_measured() -> None:
    rows = [_row("lru", 32, 400, wait=3.0), _row("lru", 64, 1600, wait=9.0),
            _row("edmm", 32, 200, wait=2.5), _row("edmm", 64, 600), _row("edmm", 128, 2600),
            _row("ttl", 32, 500), _row("ttl", 64, 1100)]
    checks = {c.name.split(" (")[0]: c for c in check_targets(rows, 2.0, 1.0)}
    # edmm crosses at 64 + 400/2000 * 64 = 76.8; lru at 32 + 600/1200 * 32 = 48: 1.6x
    sus = checks["sustainable load edmm / lru"]
    assert sus.status == "PASS" and "1.60x" in sus.measured
    best = checks["sustainable load edmm / best of ttl, offload, rewarm"]
    assert best.status == "PASS"  # ttl crosses at 32 + 500/600*32 = 58.7: 1.31x
    wait = next(c for c in check_targets(rows, 2.0, 1.0) if c.name.startswith("mean engine"))
    assert wait.status == "MISS" and "1.20x" in wait.measured  # 3.0 / 2.5 at lru's load 32
    ttft = next(c for c in check_targets(rows, 2.0, 1.0) if "resume TTFT x2" in c.name)
    assert ttft.status == "NOT MEASURED"  # no 1x run of edmm
    lone = check_targets([_row("lru", 32, 400), _row("edmm", 32, 300)], 2.0, 1.0)
    assert lone[0].status == "NOT MEASURED"  # lru never reached its knee


def test_wait_target_passes_on_a_big_enough_ratio() -> None:
    rows = [_row("lru", 32, 400, wait=3.0), _row("lru", 64, 1600), _row("edmm", 32, 300,
                                                                         wait=1.9)]
    wait = next(c for c in check_targets(rows, 2.0, 1.0) if c.name.startswith("mean engine"))
    assert wait.status == "PASS" and wait.margin == "+5%"
    assert "the most any policy" not in wait.measured  # no x1 run to bound it
    rows.append(_row("edmm", 32, 250, wait=1.5, oversub=1.0))
    rows[2].update(mem_wait_steps=7, mem_wait_running_share=0.96)
    checks = check_targets(rows, 2.0, 1.0)
    ttft = next(c for c in checks if "resume TTFT x2" in c.name)
    assert ttft.status == "PASS" and "1.20 (300 / 250 ms)" in ttft.measured
    assert "in 7 steps, running turns holding 96% of the pool" in ttft.measured
    assert "at load 32 (lru sustains 32)" in ttft.name
    wait = next(c for c in checks if c.name.startswith("mean engine"))
    assert "lru / edmm at x1: 2.00x" in wait.measured  # 3.0 / 1.5: edmm with all memory


def test_worst_metric_is_relative_to_the_best_baseline() -> None:
    edmm = {"jct_mean_s": 10.4, "jobs_per_min": 50.0}
    bases = [{"jct_mean_s": 10.0, "jobs_per_min": 52.0}, {"jct_mean_s": 11.0,
                                                          "jobs_per_min": 40.0}]
    col, rel = worst_metric(edmm, bases) or ("", 0.0)
    assert col == "jct_mean_s" and rel == pytest.approx(0.04)


def _folder(tmp: Path, name: str, rows: list[dict[str, Any]], **meta: Any) -> Path:
    folder = tmp / name
    folder.mkdir()
    env = {"device": "cpu", "hostname": "h", "platform": "p", "python": "3", "torch": "2",
           "transformers": None, "gpu_name": None, "driver_version": None,
           "cuda_runtime": None, "cpu_model": None, "timestamp_utc": "t",
           "git_commit": "abc", "git_dirty": False, "command": f"run {name}"}
    doc = {"environment": env, "summary": rows, "rows": [], "notes": [],
           "meta": {"trace_sha256": "t1", "seed": 0, "oversub": 2.0, "check_oversub": 1.0,
                    **meta}}
    (folder / "agents.json").write_text(json.dumps(doc))
    return folder


def test_merge_builds_one_report_and_refuses_mismatches(tmp_path: Path) -> None:
    a = _folder(tmp_path, "a", [_row("lru", 32, 400), _row("edmm", 32, 300)])
    b = _folder(tmp_path, "b", [_row("lru", 64, 1600), _row("edmm", 64, 900)])
    paths = merge([a, b], tmp_path / "out")
    doc = json.loads(paths["json"].read_text())
    assert [(r["policy"], r["load"]) for r in doc["summary"]] == [
        ("edmm", 32), ("edmm", 64), ("lru", 32), ("lru", 64)]
    md = paths["md"].read_text()
    assert "lru: 48.0 (under 1 s at 32, over at 64)" in md and "merged from: a" in md
    assert "| lru | long | 2 | 32 | 1 | 2 |" in paths["readme"].read_text()
    other = _folder(tmp_path, "c", [_row("ttl", 32, 400)], trace_sha256="t2")
    with pytest.raises(MergeError, match="trace_sha256"):
        merge([a, other], tmp_path / "out2")
    twice = _folder(tmp_path, "d", [_row("lru", 32, 500)])
    with pytest.raises(MergeError, match="measured twice"):
        merge([a, twice], tmp_path / "out3")
    newer = _folder(tmp_path, "e", [_row("ttl", 32, 400)])
    doc = json.loads((newer / "agents.json").read_text())
    doc["environment"]["git_commit"] = "def"
    (newer / "agents.json").write_text(json.dumps(doc))
    with pytest.raises(MergeError, match="source tree"):
        merge([a, newer], tmp_path / "out4")
    md = merge([a, newer], tmp_path / "out5", mixed_trees=True)["md"].read_text()
    assert "different source trees (--mixed-trees): a: abc; e: def" in md


@pytest.mark.slow  # five CLI subprocesses; the merge in process: the test above
def test_cli_subsets_merge_into_one_report(tmp_path: Path) -> None:
    """Two subset runs of the tiny model (different policies) through the CLI, then the
    merge: one table holding both, and a refusal to merge runs of different seeds."""
    from edmm.model.tiny import ensure_tiny_model

    tiny = ensure_tiny_model()
    common = ["--model", str(tiny), "--jobs", "2", "--turns", "2,3", "--token-scale", "0.02",
              "--time-scale", "0.05", "--loads", "2", "--no-checks", "--lean", "--threads", "1",
              "--host-page-size", "16384"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "edmm", "bench", *args], text=True,
                              capture_output=True, timeout=600, check=False)

    for name, policy in (("p1", "lru"), ("p2", "edmm")):
        got = run("agents", *common, "--policies", policy, "--out", str(tmp_path / name))
        assert got.returncode == 0, got.stderr[-2000:]
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == [
            "agents-timeline.csv", "agents.json", "agents.md"]
    got = run("agents-merge", str(tmp_path / "p1"), str(tmp_path / "p2"), "--out",
              str(tmp_path / "all"))
    assert got.returncode == 0, got.stderr[-2000:]
    doc = json.loads((tmp_path / "all" / "agents.json").read_text())
    assert {r["policy"] for r in doc["summary"]} == {"lru", "edmm"}
    # the parts' timelines, merged and plotted (one line per policy)
    assert (tmp_path / "all" / "agents-pages.png").read_bytes()[:4] == b"\x89PNG"
    assert any(n.startswith("NOT MEASURED: sustainable load edmm / lru") for n in doc["notes"])
    got = run("agents", *common, "--seed", "1", "--policies", "ttl", "--out",
              str(tmp_path / "p3"))
    assert got.returncode == 0, got.stderr[-2000:]
    got = run("agents-merge", str(tmp_path / "p1"), str(tmp_path / "p3"), "--out",
              str(tmp_path / "bad"))
    assert got.returncode == 2 and "MergeError" in got.stderr and "trace_sha256" in got.stderr


def test_plot_titles_name_the_load_by_the_loop() -> None:
    assert load_label(24.0, "closed") == "24 sessions"
    assert load_label(1.5, "open") == "1.5 jobs/s"
    assert load_axis_label("closed") == "concurrent sessions (closed loop)"
    assert load_axis_label("open") == "job arrivals per second (open loop, Poisson)"


def test_readme_table_heads_the_load_by_the_loop() -> None:
    rows = [_row("lru", 4, 48.0)]
    assert readme_table(rows).startswith("| policy | tools | KV oversub. | sessions |")
    assert readme_table(rows, "open").startswith("| policy | tools | KV oversub. | jobs/s |")
