"""Plots shared by one `edmm bench agents` run (report.py) and a merge of several (merge.py).

Each takes matplotlib's ``Figure`` class (imported by the caller, which skips plotting without
matplotlib) and writes one PNG.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from edmm.bench.agents.targets import SUSTAIN_TTFT_MS

TITLE_WIDTH = 64  # characters a title line holds in a 7-inch figure at the default font


def set_title(ax: Any, title: str) -> None:
    """``title`` on ``ax``, wrapped to lines that fit the figure (a long one was clipped at
    both sides)."""
    ax.set_title("\n".join(textwrap.fill(line, TITLE_WIDTH) for line in title.split("\n")))


def load_unit(mode: str) -> str:
    """What a load counts: concurrent sessions (closed loop) or jobs per second (open loop)."""
    return "jobs/s" if mode == "open" else "sessions"


def load_label(load: float, mode: str) -> str:
    """A load as a plot title says it, with its unit (`load_unit`)."""
    return f"{load:g} {load_unit(mode)}"


def load_axis_label(mode: str) -> str:
    """What a plot's load axis counts: concurrent sessions (closed loop) or job arrivals per
    second (open loop)."""
    if mode == "open":
        return "job arrivals per second (open loop, Poisson)"
    return "concurrent sessions (closed loop)"


def plot_ttft_cdf(figure: Any, series: Mapping[str, Sequence[float]], path: Path,
                  title: str) -> Path:
    """Step CDF of resume TTFT (ms) per policy, with the 1 s line; ``series``: policy -> ms."""
    fig = figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for policy, values in series.items():
        xs = sorted(values)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=policy)
    ax.axvline(SUSTAIN_TTFT_MS, color="grey", linestyle=":", label="1 s")
    ax.set_xscale("log")
    ax.set_xlabel("resume TTFT (ms, log scale)")
    ax.set_ylabel("fraction of resumes")
    set_title(ax, title)
    ax.legend(loc="lower right")
    fig.savefig(path, format="png", dpi=120)
    return path


def plot_by_policy(ax: Any, points: Mapping[str, Sequence[tuple[float, float]]]) -> None:
    """One line with markers per policy, through its ``(x, y)`` points in x order."""
    for policy, xy in sorted(points.items()):
        ordered = sorted(xy)
        ax.plot([x for x, _ in ordered], [y for _, y in ordered], marker="o", label=policy)


def plot_wait_vs_oversub(figure: Any, rows: Sequence[dict[str, Any]], path: Path,
                         device: str, mode: str) -> Path | None:
    """Mean engine-wait per job against oversubscription, per policy, at the highest load run
    at more than one oversubscription (long tools); None when there is no such load."""
    per_load: dict[float, set[float]] = {}
    for r in rows:
        if r["tools"] == "long":
            per_load.setdefault(float(r["load"]), set()).add(float(r["oversub"]))
    multi = [ld for ld, o in per_load.items() if len(o) > 1]
    if not multi:
        return None
    load = max(multi)
    pts: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r["tools"] == "long" and float(r["load"]) == load:
            pts.setdefault(r["policy"], []).append((float(r["oversub"]), r["wait_mean_s"]))
    fig = figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    plot_by_policy(ax, pts)
    ax.set_xlabel("KV memory oversubscription (working set / pool)")
    ax.set_ylabel("mean engine-wait per job (s)")
    set_title(ax, f"Engine-wait per job vs memory oversubscription ({device}, "
                  f"{load_label(load, mode)})")
    ax.legend(loc="upper left")
    fig.savefig(path, format="png", dpi=120)
    return path


def plot_pages(figure: Any, series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
               pool_pages: float, path: Path, title: str) -> Path:
    """KV pages in use over time per policy (``series``: policy -> (seconds since the run
    started, pages)), with the pool's size."""
    fig = figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for policy, (ts, pages) in sorted(series.items()):
        ax.plot(ts, pages, label=policy)
    ax.axhline(pool_pages, color="grey", linestyle=":", label="pool")
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("KV pages in use (pages)")
    set_title(ax, title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, format="png", dpi=120)
    return path
