"""One load-curve table and plot from ``edmm bench load`` runs made separately (one server
each, e.g. EDMM and vLLM in consecutive device calls on one held machine).

    python -m benchmarks.scripts.load_merge RUN_DIR [RUN_DIR ...] --out DIR [--base EDMM]

Each ``RUN_DIR`` holds ``load.json`` (the bench's own output) or, when the bench was stopped
before writing it, ``load-rows.jsonl`` (its rows as they were measured). Writes
``DIR/load-merged.{md,png}``: every server's rows, then each server's ratios over ``--base``
(the first server by default) at the points both measured, and the environment line of each
run (its GPU, tree and command), so a reader sees which runs the table joins.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edmm.bench.load import plot_load, ratio_rows
from edmm.bench.results import markdown_table

COLUMNS = ("server", "prompt_tokens", "prefix", "concurrency", "errors", "output_tok_s",
           "ttft_min_ms", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "cached_frac")


class MergeError(ValueError):
    """A run folder holds no load rows."""


def load_run(folder: Path) -> tuple[list[dict[str, Any]], str, str | None]:
    """A run's summary rows, a line saying where they come from (GPU, tree, command) and its
    GPU's name (None: not recorded)."""
    doc_path, rows_path = folder / "load.json", folder / "load-rows.jsonl"
    if doc_path.exists():
        doc = json.loads(doc_path.read_text(encoding="utf-8"))
        env = doc.get("environment", {})
        gpu = env.get("gpu_name")
        line = (f"`{folder.name}`: {gpu or env.get('device', '?')}, tree "
                f"`{str(env.get('git_commit', '?'))[:7]}`, {env.get('timestamp_utc', '?')}, "
                f"`{env.get('command', '?')}`")
        return list(doc["summary"]), line, gpu
    if rows_path.exists():
        rows = [json.loads(x) for x in rows_path.read_text(encoding="utf-8").splitlines() if x]
        return rows, f"`{folder.name}`: rows log only (the bench stopped before its JSON)", None
    raise MergeError(f"{folder}: neither load.json nor load-rows.jsonl")


def merged_markdown(rows: Sequence[dict[str, Any]], sources: Sequence[str], base: str) -> str:
    ratios = ratio_rows(rows, base)
    lines = ["# Load curve, merged runs", "", "Runs:", "", *(f"- {s}" for s in sources), "",
             markdown_table([{k: r.get(k) for k in COLUMNS} for r in rows]), ""]
    if ratios:
        lines += [f"Ratios over {base} (output tok/s > 1: more throughput; latencies > 1: "
                  "slower):", "", markdown_table(ratios), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="edmm bench load --out folders")
    p.add_argument("--out", type=Path, required=True, help="folder of load-merged.{md,png}")
    p.add_argument("--base", default=None, help="the server the ratios divide by "
                   "(default: the first run's)")
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    sources: list[str] = []
    gpus: list[str] = []
    try:
        for folder in args.runs:
            run_rows, line, gpu = load_run(folder)
            rows += run_rows
            sources.append(line)
            gpus += [gpu] if gpu else []
    except MergeError as exc:
        p.error(str(exc))
    if not rows:
        p.error("the runs hold no rows")
    base = args.base or rows[0]["server"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load-merged.md").write_text(merged_markdown(rows, sources, base),
                                             encoding="utf-8")
    plot_load(rows, args.out / "load-merged.png", " / ".join(dict.fromkeys(gpus)) or "the GPU")
    print(args.out / "load-merged.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
