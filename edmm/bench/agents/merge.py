"""`edmm bench agents-merge`: one report from several `edmm bench agents` folders.

A full-size matrix does not fit one device call, so it runs as subsets (``--policies``,
``--loads``, ``--oversub``, ``--mix``, ``--lean``; over HTTP ``--peer`` too), each into its own
folder. The merge reads each folder's ``agents.json`` (or ``agents-http.json``, and its
timeline; a ``restore-overlap.json`` of the micro-bench, if a folder holds one), refuses
folders that did not replay the same trace with the same seed, scales, clock (in process and
over HTTP do not mix), engine settings and source tree (`MergeError` names what differs), and
refuses a condition measured twice. It writes the same files as one run (``agents.json``,
``agents.md``, ``agents.csv``, ``agents-timeline.csv``) plus the knee plot, the resume-TTFT CDF
at the highest load every policy ran, engine-wait against oversubscription, KV pages in use
over time (at the highest oversubscription and load merged), and ``agents-readme-table.md``
(the README's policy table of these rows); ``agents.md`` lists the knees, the
targets with PASS / MISS and the margin (`edmm.bench.agents.targets`), and where every row
came from.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edmm.bench.agents.plots import (
    load_axis_label,
    load_label,
    load_unit,
    plot_by_policy,
    plot_pages,
    plot_ttft_cdf,
    plot_wait_vs_oversub,
    set_title,
)
from edmm.bench.agents.targets import (
    ALL_TURN_P90,
    MARGIN_NOTE,
    SUSTAIN_TTFT_MS,
    check_targets,
    knee_line,
    peer_checks,
)
from edmm.bench.results import Environment, ResultWriter

NAME = "agents"
# meta keys that must agree (the runs' own oversubscriptions and loads may differ).
SHARED = ("trace_sha256", "seed", "jobs", "token_scale", "time_scale", "mode", "model",
          "device", "dtype", "clock", "max_num_seqs", "max_num_batched_tokens", "graph_sizes")
KEY = ("policy", "tools", "oversub", "load")


class MergeError(ValueError):
    """The folders cannot be merged into one report (the message says why)."""


@dataclass
class Part:
    """One folder's results."""

    folder: Path
    doc: dict[str, Any]
    timeline: list[dict[str, str]]
    restore: dict[str, Any] | None

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.doc.get("meta") or {})

    @property
    def tree(self) -> tuple[Any, Any]:
        env = self.doc.get("environment") or {}
        return env.get("git_commit"), env.get("git_dirty")


def result_doc(folder: Path) -> Path | None:
    """The results file of an `edmm bench agents` folder: ``agents.json`` (in process), else
    ``agents-http.json`` (over HTTP); None when it has neither."""
    for name in (f"{NAME}.json", f"{NAME}-http.json"):
        if (folder / name).is_file():
            return folder / name
    return None


def read_part(folder: Path) -> Part:
    """A folder written by `edmm bench agents` (`result_doc`), or holding the restore
    micro-bench only."""
    doc_path = result_doc(folder) or folder / f"{NAME}.json"
    restore_path = folder / "restore-overlap.json"
    restore = json.loads(restore_path.read_text())["result"] if restore_path.exists() else None
    if not doc_path.exists():
        if restore is None:
            raise MergeError(f"{folder}: no {NAME}.json nor restore-overlap.json")
        return Part(folder, {}, [], restore)
    doc = json.loads(doc_path.read_text())
    if "meta" not in doc:
        raise MergeError(f"{doc_path}: no 'meta' (written before merges were possible)")
    tl_path = doc_path.with_name(f"{doc_path.stem}-timeline.csv")
    timeline = list(csv.DictReader(tl_path.open())) if tl_path.exists() else []
    return Part(folder, doc, timeline, restore)


def check_compatible(parts: Sequence[Part], mixed_trees: bool = False) -> None:
    """Raise `MergeError` unless the bench folders share trace, seed, settings and tree
    (``mixed_trees``: the tree may differ; the report then lists each part's)."""
    bench = [p for p in parts if p.doc]
    if not bench:
        raise MergeError("no agents.json among the folders")
    first = bench[0]
    for p in bench[1:]:
        diff = [k for k in SHARED if p.meta.get(k) != first.meta.get(k)]
        if p.tree != first.tree and not mixed_trees:
            diff.append(f"source tree {p.tree} vs {first.tree}")
        if diff:
            raise MergeError(f"{p.folder} differs from {first.folder}: {', '.join(map(str, diff))}")
    seen: dict[tuple[Any, ...], Path] = {}
    for p in bench:
        for row in p.doc["summary"]:
            key = tuple(row[k] for k in KEY)
            if key in seen:
                raise MergeError(f"{key} measured twice: {seen[key]} and {p.folder}")
            seen[key] = p.folder


def _tree_notes(bench: Sequence[Part]) -> list[str]:
    """One note naming each part's source tree, when they differ."""
    trees = {p.tree for p in bench}
    if len(trees) < 2:
        return []
    return ["parts measured on different source trees (--mixed-trees): " + "; ".join(
        f"{p.folder.name}: {p.tree[0][:12]}{' (uncommitted changes)' if p.tree[1] else ''}"
        for p in bench)]


def _method_notes(part: Part) -> list[str]:
    """The method notes of one run: its notes after the target lines."""
    notes = part.doc.get("notes") or []
    return notes[notes.index(MARGIN_NOTE) + 1:] if MARGIN_NOTE in notes else notes[-5:]


def _sort_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["tools"], -float(row["oversub"]), row["policy"], float(row["load"]))


def merge(folders: Sequence[Path], out: Path, oversub: float | None = None,
          check_oversub: float | None = None, mixed_trees: bool = False) -> dict[str, Path]:
    """Merge ``folders`` into ``out``; return the files written. ``oversub`` / ``check_oversub``
    default to the first run's main and check oversubscriptions; ``mixed_trees`` accepts
    parts measured on different source trees (each part's tree is then noted)."""
    parts = [read_part(f) for f in folders]
    check_compatible(parts, mixed_trees)
    bench = [p for p in parts if p.doc]
    meta = bench[0].meta
    oversub = oversub if oversub is not None else float(meta["oversub"])
    check_oversub = check_oversub if check_oversub is not None else meta.get("check_oversub")
    rows = sorted((dict(r, source=p.folder.name) for p in bench for r in p.doc["summary"]),
                  key=_sort_key)
    restore = next((p.restore for p in parts if p.restore is not None), None)
    checks = check_targets(rows, oversub, check_oversub, restore)
    env_doc = dict(bench[0].doc["environment"])
    env_doc["command"] = "edmm bench agents-merge " + " ".join(str(f) for f in folders)
    fields: dict[str, Any] = {k: env_doc.get(k) for k in Environment.__dataclass_fields__}
    env = Environment(**fields)
    writer = ResultWriter(out, NAME, env)
    for p in bench:
        writer.add_rows(p.doc.get("rows", []))
    notes = [knee_line(rows, oversub, ALL_TURN_P90), knee_line(rows, oversub),
             *(c.line() for c in peer_checks(rows, oversub)), *(c.line() for c in checks),
             MARGIN_NOTE,
             "merged from: " + "; ".join(
                 f"{p.folder.name} ({(p.doc.get('environment') or {}).get('command', '')})"
                 for p in bench),
             *_tree_notes(bench), *_method_notes(bench[0])]
    paths = writer.write(rows, "Agent workloads: policies on one trace (merged runs)", notes,
                         meta={**meta, "oversub": oversub, "check_oversub": check_oversub,
                               "targets": [c.__dict__ for c in checks], "restore": restore})
    timeline = [r for p in bench for r in p.timeline]
    paths["timeline"] = _write_timeline(timeline, out / f"{NAME}-timeline.csv")
    paths["readme"] = out / f"{NAME}-readme-table.md"
    mode = str(meta.get("mode", "closed"))
    paths["readme"].write_text(readme_table(rows, mode) + "\n", encoding="utf-8")
    device = env_doc.get("gpu_name") or env_doc.get("device") or ""
    trace = f"{meta['jobs']}-job trace, " if meta.get("jobs") else ""
    for path in plot_merged(rows, writer.rows, timeline, oversub, out, trace + str(device),
                            mode):
        paths[path.stem] = path
    return paths


# The README's policy table: (header, column, format).
README_COLUMNS = (("policy", "policy", "{}"), ("tools", "tools", "{}"),
                  ("KV oversub.", "oversub", "{:g}"), ("load", "load", "{:g}"),
                  ("engine-wait / job, mean s", "wait_mean_s", "{:.3g}"),
                  ("JCT mean s", "jct_mean_s", "{:.3g}"),
                  ("resume TTFT p50 ms", "resume_ttft_p50_ms", "{:.3g}"),
                  ("p90 ms", "resume_ttft_p90_ms", "{:.3g}"),
                  ("all-turn TTFT p90 ms", "ttft_p90_ms", "{:.3g}"),
                  ("prefill amp.", "prefill_amp", "{:.3g}"),
                  ("recomputed tokens", "recomputed_tokens", "{}"),
                  ("prefix hit rate", "prefix_hit_rate", "{:.3g}"),
                  ("spec. hits", "spec_hit", "{}"), ("spec. misses", "spec_miss", "{}"),
                  ("spec. gated", "spec_gated", "{}"), ("offloaded MiB", "offloaded_MiB", "{:.0f}"))


def readme_table(rows: Sequence[dict[str, Any]], mode: str = "closed") -> str:
    """The merged rows as the README's policy table (Markdown); the load column is headed by
    what ``mode``'s load counts (sessions, or jobs/s in an open loop)."""
    def cell(row: dict[str, Any], col: str, fmt: str) -> str:
        value = row.get(col)
        return "" if value is None else fmt.format(value)

    head = "| " + " | ".join(load_unit(mode) if c == "load" else h
                             for h, c, _ in README_COLUMNS) + " |"
    rule = "|" + "|".join("---" if i < 2 else "---:" for i in range(len(README_COLUMNS))) + "|"
    body = ["| " + " | ".join(cell(r, c, f) for _, c, f in README_COLUMNS) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def _write_timeline(rows: list[dict[str, str]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return path


def plot_merged(rows: Sequence[dict[str, Any]], detail: Sequence[dict[str, Any]],
                timeline: Sequence[dict[str, str]], oversub: float, out: Path,
                device: str, mode: str) -> list[Path]:
    """The knee plot, the resume-TTFT CDF, engine-wait vs oversubscription and KV pages in use
    over time (none without matplotlib)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return []
    paths = [_plot_knees(Figure, rows, oversub, out / f"{NAME}-knees.png", device, mode)]
    cdf = _plot_cdf(Figure, rows, detail, oversub, out / f"{NAME}-resume-ttft-cdf.png", device,
                    mode)
    wait = plot_wait_vs_oversub(Figure, rows, out / f"{NAME}-wait-vs-oversub.png", device, mode)
    pages = _plot_pages(Figure, timeline, out / f"{NAME}-pages.png", device, mode)
    return paths + [p for p in (cdf, wait, pages) if p is not None]


def _plot_pages(figure: Any, timeline: Sequence[dict[str, str]], path: Path,
                device: str, mode: str) -> Path | None:
    """Pages in use over time per policy, at the highest oversubscription and then load of
    the timeline's long-tool runs (where memory is shortest); None without such rows (a
    peer's rows over HTTP, with its KV usage but no pages, are left out)."""
    long = [t for t in timeline if t.get("tools") == "long" and t.get("pages_used")]
    if not long:
        return None
    oversub = max(float(t["oversub"]) for t in long)
    at = [t for t in long if float(t["oversub"]) == oversub]
    load = max(float(t["load"]) for t in at)
    at = [t for t in at if float(t["load"]) == load]
    series: dict[str, tuple[list[float], list[float]]] = {}
    for t in at:
        ts, pages = series.setdefault(t["policy"], ([], []))
        ts.append(float(t["t_s"]))
        pages.append(float(t["pages_used"]))
    pool = max(float(t["pages_total"]) for t in at)
    return plot_pages(figure, series, pool, path,
                      f"KV pages in use ({device}, {load_label(load, mode)}, "
                      f"{oversub:g}x KV oversubscription)")


def _plot_knees(figure: Any, rows: Sequence[dict[str, Any]], oversub: float, path: Path,
                device: str, mode: str) -> Path:
    fig = figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    curves: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r["tools"] == "long" and r["oversub"] == oversub and r["resume_ttft_p90_ms"]:
            curves.setdefault(r["policy"], []).append((float(r["load"]), r["resume_ttft_p90_ms"]))
    plot_by_policy(ax, curves)
    ax.axhline(SUSTAIN_TTFT_MS, color="grey", linestyle=":", label="1 s")
    ax.set_yscale("log")
    ax.set_xlabel(load_axis_label(mode))
    ax.set_ylabel("p90 resume TTFT (ms, log scale)")
    set_title(ax, f"Where each policy stops sustaining 1 s\n({device}, "
                  f"{oversub:g}x KV oversubscription)")
    ax.legend(loc="upper left")
    fig.savefig(path, format="png", dpi=120)
    return path


def _plot_cdf(figure: Any, rows: Sequence[dict[str, Any]], detail: Sequence[dict[str, Any]],
              oversub: float, path: Path, device: str, mode: str) -> Path | None:
    """The resume-TTFT CDF at the highest load every policy ran at ``oversub`` (long tools)."""
    by_load: dict[float, set[str]] = {}
    for r in rows:
        if r["tools"] == "long" and r["oversub"] == oversub:
            by_load.setdefault(float(r["load"]), set()).add(r["policy"])
    policies = {r["policy"] for r in rows if r["tools"] == "long" and r["oversub"] == oversub}
    common = [ld for ld, ps in by_load.items() if ps == policies]
    if not common:
        return None
    load = max(common)
    series = {policy: [d["ttft_s"] * 1e3 for d in detail
                       if d.get("kind") == "turn" and d.get("resume") and d["policy"] == policy
                       and d["tools"] == "long" and d["oversub"] == oversub
                       and float(d["load"]) == load]
              for policy in sorted(policies)}
    title = (f"Resume TTFT per policy ({device}, {load_label(load, mode)}, "
             f"{oversub:g}x KV oversubscription)")
    return plot_ttft_cdf(figure, series, path, title)
