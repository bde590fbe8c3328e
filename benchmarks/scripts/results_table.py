"""The README's results tables, regenerated from a results folder's JSON files.

``python -m benchmarks.scripts.results_table [RESULTS_DIR ...] [--readme README.md]`` prints
Markdown built from ``agent-ttft.json`` (and ``agent-ttft-transformers.json`` beside it),
``agent-ttft-live.json``, ``vmm-cuda.json`` and ``ttft-model.json``, each taken from the first
folder that has it (a file in no folder leaves its part out). Without folders: every folder of
``benchmarks/results`` named ``<date>-<device>[-<label>]`` for ``--device`` (default ``h200``),
newest first (`result_dirs`). With ``--readme`` the block
between ``<!-- results:begin -->`` and ``<!-- results:end -->`` in that file is replaced.

Rounding: A/B/C times to 0.1 ms (whole ms from 1000 up), ratios to 2 decimals (B/A with an
``x``); VMM times to 0.1 µs / 0.1 ms / 0.01 ms as in the prose; model-level times to 3
significant digits.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from edmm.bench.resume import SEED_RATIOS

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
RESULTS_ROOT = Path("benchmarks/results")
_FOLDER = re.compile(r"(?P<date>\d{4}-\d{2}-\d{2})-(?P<device>[a-z0-9]+)(?:-(?P<label>.+))?")
MODEL_CONTEXT = 16384
# The model-level targets of the seed (ms, or a multiple of the compute floor).
DECODE_TARGET_MS = 5.0
CACHED_PREFILL_TARGET_MS = 15.0
FULL_PREFILL_TARGET_X = 1.2

Row = Mapping[str, Any]


class ResultsTableError(ValueError):
    """A results file lacks what a table needs, or the README lacks the markers."""


def result_dirs(root: Path = RESULTS_ROOT, device: str = "h200") -> list[Path]:
    """The results folders of ``device`` under ``root`` (``<date>-<device>[-<label>]``),
    newest first: by date, then a labelled folder (a later session of that day) before the
    unlabelled one, labels in natural order (``session10`` after ``session9``)."""
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        m = _FOLDER.fullmatch(path.name)
        if path.is_dir() and m is not None and m["device"] == device:
            label = m["label"] or ""
            natural = [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label) if t]
            found.append(((m["date"], bool(label), natural), path))
    return [path for _, path in sorted(found, key=lambda kv: _sort_key(kv[0]), reverse=True)]


def _sort_key(key: tuple[str, bool, list[int | str]]) -> tuple[str, bool, list[tuple[int, Any]]]:
    date, labelled, natural = key
    return date, labelled, [(0, t) if isinstance(t, int) else (1, t) for t in natural]


def load_summary(folders: Sequence[Path], name: str) -> list[dict[str, Any]] | None:
    """The ``summary`` rows of ``name`` in the first of ``folders`` that has it, or None."""
    path = next((f / name for f in folders if (f / name).is_file()), None)
    if path is None:
        return None
    doc = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(doc.get("summary"), list):
        raise ResultsTableError(f"{path}: no summary list")
    return list(doc["summary"])


def live_rows(folders: Sequence[Path],
              ) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """The live rows of every folder with ``agent-ttft-live.json``, and the in-process groups
    to set beside them, from the ``agent-ttft.json`` of those folders; each context from the
    first folder that measured it (a results folder's calls, e.g. one live context per call
    and the groups in one of them; a newer call's context before an older one's)."""
    live_folders = [f for f in folders if (f / "agent-ttft-live.json").is_file()]
    if not live_folders:
        return None, None
    rows = _first_per_context(live_folders, "agent-ttft-live.json")
    return rows, _first_per_context(live_folders, "agent-ttft.json") or None


def _first_per_context(folders: Sequence[Path], name: str) -> list[dict[str, Any]]:
    """The summary rows of ``name`` in ``folders``, each context's from the first that has it."""
    rows: list[dict[str, Any]] = []
    seen: set[Any] = set()
    for folder in folders:
        got = load_summary([folder], name) or []
        rows += [r for r in got if r["context_tokens"] not in seen]
        seen |= {r["context_tokens"] for r in got}
    return rows


def ms(x: float) -> str:
    """A/B/C time: ``35.3 ms``, ``1175 ms``."""
    return f"{x:.0f} ms" if x >= 1000 else f"{x:.1f} ms"


def sig3(x: float) -> str:
    """Three significant digits (no decimals from 100 up): ``5.14``, ``18.7``, ``504``."""
    if x == 0 or not math.isfinite(x):
        return str(x)
    decimals = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def ctx_label(n: int) -> str:
    """``4096`` -> ``4K``."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _by(rows: Sequence[Row], *keys: str) -> dict[tuple[Any, ...], Row]:
    return {tuple(r.get(k) for k in keys): r for r in rows}


def groups_table(edmm: Sequence[Row], peer: Sequence[Row] | None) -> str:
    """The A/B/C table: an EDMM row (and a transformers row) per context, then the seed."""
    lines = ["| context | A: result appended, prefix hit | B: result mid-prompt, recompute "
             "from it | C: B's prompt, speculation hit + zero-copy commit | B/A | C/A |",
             "|---:|---:|---:|---:|---:|---:|"]
    sides = [("EDMM", _by(edmm, "context_tokens", "group"))]
    if peer:
        sides.append(("transformers", _by(peer, "context_tokens", "group")))
    for ctx in dict.fromkeys(r["context_tokens"] for r in edmm):
        for label, by in sides:
            got = {g: by.get((ctx, g)) for g in "ABC"}
            if any(r is None for r in got.values()):
                continue
            t = {g: float(r["ttft_trimmed_mean_ms"]) for g, r in got.items() if r is not None}
            lines.append(f"| {ctx_label(ctx)} {label} | {ms(t['A'])} | {ms(t['B'])} | "
                         f"{ms(t['C'])} | {t['B'] / t['A']:.2f}x | {t['C'] / t['A']:.2f} |")
    (b_live, b_alone), (c_live, c_alone) = SEED_RATIOS["B/A"], SEED_RATIOS["C/A"]
    lines.append(f"| seed (vLLM live / standalone) | | | | {b_live:.2f}x / {b_alone:.2f}x | "
                 f"{c_live:.2f} / {c_alone:.2f} |")
    return "\n".join(lines)


def live_table(rows: Sequence[Row], in_process: Sequence[Row] | None = None) -> str:
    """The live groups at the client: streamed TTFT where measured, else the non-streamed
    latency of the resume (a 1-token resume: its TTFT seen by the client). With the same
    run's in-process groups (``in_process``: ``agent-ttft.json`` of the live file's folder),
    what HTTP adds to A and C (live minus in process) and the openai SDK's share of it. Where
    the live file has the raw-HTTP resumes (no SDK: the server and HTTP alone), their A / C
    and C/A, and what they add over the in-process groups."""
    by = _by(rows, "context_tokens", "group")
    alone = _by(in_process or (), "context_tokens", "group")
    raw = any(r.get("raw_ttft_trimmed_mean_ms") is not None for r in rows)
    head = "| context (live, HTTP) | A | B | C | B/A | C/A | C's cached / prompt tokens |"
    rule = "|---:|---:|---:|---:|---:|---:|---:|"
    if alone:
        head += " HTTP adds to A / C | of which the openai SDK (A / C) |"
        rule += "---:|---:|"
    if raw:
        head += " raw HTTP, no SDK: A / C (C/A) |" + (" raw HTTP adds to A / C |" if alone
                                                     else "")
        rule += "---:|" + ("---:|" if alone else "")
    lines = [head, rule]
    for ctx in dict.fromkeys(r["context_tokens"] for r in rows):
        got = {g: by.get((ctx, g)) for g in "ABC"}
        if any(r is None for r in got.values()):
            continue
        t = {g: _client_ms(r) for g, r in got.items() if r is not None}
        c = got["C"]
        assert c is not None
        line = (f"| {ctx_label(ctx)} | {ms(t['A'])} | {ms(t['B'])} | {ms(t['C'])} | "
                f"{t['B'] / t['A']:.2f}x | {t['C'] / t['A']:.2f} | "
                f"{c['cached_tokens']} / {c['prompt_tokens']} |")
        if alone:
            line += f" {_added(t, alone, ctx)} | {_sdk(got)} |"
        if raw:
            line += _raw_cells(got, alone, ctx)
        lines.append(line)
    return "\n".join(lines)


def _added(live: Mapping[str, float], alone: Mapping[tuple[Any, ...], Row], ctx: int) -> str:
    """Live minus in process for A and C (the in-process run's context nearest ``ctx``: the
    live bench's 31744 beside the in-process 32768)."""
    contexts = sorted({k[0] for k in alone}, key=lambda c: abs(c - ctx))
    near = contexts[0] if contexts and abs(contexts[0] - ctx) <= ctx // 16 else None
    cells = []
    for g in "AC":
        row = alone.get((near, g))
        cells.append("" if row is None else
                     f"{live[g] - float(row['ttft_trimmed_mean_ms']):.1f} ms")
    return " / ".join(cells) if any(cells) else ""


def _raw_cells(got: Mapping[str, Row | None], alone: Mapping[tuple[Any, ...], Row],
               ctx: int) -> str:
    """The raw-HTTP cells of a live row: A / C (C/A), and what they add (``alone``)."""
    t = {g: (got[g] or {}).get("raw_ttft_trimmed_mean_ms") for g in "AC"}
    if t["A"] is None or t["C"] is None:
        return " |" + (" |" if alone else "")
    a, c = float(t["A"]), float(t["C"])
    cells = f" {ms(a)} / {ms(c)} ({c / a:.2f}) |"
    return cells + (f" {_added({'A': a, 'C': c}, alone, ctx)} |" if alone else "")


def _sdk(got: Mapping[str, Row | None]) -> str:
    cells = [(got[g] or {}).get("sdk_median_ms") for g in "AC"]
    if all(x is None for x in cells):
        return ""
    return " / ".join("" if x is None else f"{float(x):.1f} ms" for x in cells)


def _client_ms(row: Row) -> float:
    ttft = row.get("ttft_trimmed_mean_ms")  # null or NaN when no TTFT was measured
    if ttft is not None and math.isfinite(float(ttft)):
        return float(ttft)
    return float(row["total_trimmed_mean_ms"])


def _vmm(rows: Sequence[Row], op: str) -> list[Row]:
    found = [r for r in rows if r.get("op") == op]
    if not found:
        raise ResultsTableError(f"vmm-cuda.json: no {op!r} rows")
    return found


def vmm_line(vmm: Sequence[Row], agent: Sequence[Row] | None) -> str:
    """The VMM paragraph: commit, remap vs bare calls, branching 16K, engine admission."""
    commits = _vmm(vmm, "commit at resume (slot swap)")
    ctxs = [ctx_label(r["context_tokens"]) for r in commits]
    remap = _vmm(vmm, "remap (unmap+map+access)")[0]
    bare = _vmm(vmm, "remap, bare driver calls")[0]
    mib = remap["bytes"] / 2**20
    commit_us = " / ".join(f"{r['median_us']:.1f}" for r in commits)
    parts = [f"commit at resume (slot swap) {commit_us} µs at {' / '.join(ctxs)} "
             "(target ≤ 50 µs, flat)",
             f"remap {remap['median_us']:.1f} µs per {mib:g} MiB page through EDMM vs "
             f"{bare['median_us']:.1f} µs through bare `cuda.bindings` calls "
             f"({remap['median_us'] / bare['median_us']:.2f}x, target ≤ 1.2x)"]
    branch = {r["context_tokens"]: r for r in
              _vmm(vmm, "branch (map shared prefix + copy boundary page)")}
    copy = {r["context_tokens"]: r for r in _vmm(vmm, "device copy of the prefix bytes")}
    if MODEL_CONTEXT in branch and MODEL_CONTEXT in copy:
        b, c = branch[MODEL_CONTEXT], copy[MODEL_CONTEXT]
        parts.append(f"branching a {ctx_label(MODEL_CONTEXT)}-token prefix maps {b['pages']} "
                     f"shared pages in {b['median_us'] / 1e3:.1f} ms off the critical path (a "
                     f"device copy of the same {c['bytes'] / 1e9:.2f} GB: "
                     f"{c['median_us'] / 1e3:.2f} ms, and a second copy in memory)")
    line = "**VMM** (`edmm bench vmm`): " + "; ".join(parts) + "."
    admission = [r for r in agent or () if r.get("group") == "C" and "commit_ms" in r]
    if admission:
        admission_ms = " / ".join(f"{r['commit_ms']:.2f}" for r in admission)
        line += (" The engine-level admission (prefix lookup + commit + truncate) is "
                 f"{admission_ms} ms at "
                 f"{' / '.join(ctx_label(r['context_tokens']) for r in admission)}.")
    return line


def _verdict(value: float, target: float) -> str:
    if value <= target:
        return "met"
    return f"missed by {round((value / target - 1) * 100)}%"


def model_table(rows: Sequence[Row], context: int = MODEL_CONTEXT) -> str:
    """Decode step, 512 tokens on a cached prefix, full prefill: EDMM, transformers, target."""
    by = _by(rows, "engine", "op", "context_tokens")

    def get(engine: str, op: str) -> Row:
        r = by.get((engine, op, context))
        if r is None:
            raise ResultsTableError(f"ttft-model.json: no {engine} {op!r} at {context}")
        return r

    def cell(engine: str, op: str) -> str:
        r = by.get((engine, op, context))
        return "" if r is None else f"{sig3(float(r['trimmed_mean_ms']))} ms"

    decode = float(get("edmm", "decode step")["trimmed_mean_ms"])
    cached = get("edmm", "prefill on cached prefix")
    full = get("edmm", "full prefill")
    cached_ms, cached_floor = float(cached["trimmed_mean_ms"]), float(cached["compute_floor_ms"])
    full_x = float(full["trimmed_mean_ms"]) / float(full["compute_floor_ms"])
    full_verdict = "met" if full_x <= FULL_PREFILL_TARGET_X else "missed"
    targets = {
        "decode step": f"≤ {DECODE_TARGET_MS:g} ms — {_verdict(decode, DECODE_TARGET_MS)}",
        "prefill on cached prefix": f"≤ {CACHED_PREFILL_TARGET_MS:g} ms — "
        + ("met" if cached_ms <= CACHED_PREFILL_TARGET_MS else "missed")
        + f" (matmul + attention FLOP floor {cached_floor:.1f} ms)",
        "full prefill": f"≤ {FULL_PREFILL_TARGET_X:g}x floor "
        f"({float(full['compute_floor_ms']):.0f} ms) — {full_verdict}: {full_x:.2f}x",
    }
    labels = {"decode step": "decode step", "prefill on cached prefix":
              "512 tokens on a cached prefix", "full prefill": "full prefill"}
    lines = [f"| {ctx_label(context)} context | EDMM | transformers | target |",
             "|---|---:|---:|---:|"]
    for op, label in labels.items():
        lines.append(f"| {label} | {cell('edmm', op)} | {cell('transformers', op)} | "
                     f"{targets[op]} |")
    return "\n".join(lines)


def render(folders: Sequence[Path]) -> str:
    """Every part whose file is in one of ``folders`` (the first that has it), as Markdown."""
    agent = load_summary(folders, "agent-ttft.json")
    peer = load_summary(folders, "agent-ttft-transformers.json")
    live, same_run = live_rows(folders)
    vmm = load_summary(folders, "vmm-cuda.json")
    model = load_summary(folders, "ttft-model.json")
    parts = []
    if agent:
        parts.append(groups_table(agent, peer))
    if live:
        parts.append(live_table(live, same_run))
    if vmm:
        parts.append(vmm_line(vmm, agent))
    if model:
        parts.append(model_table(model))
    if not parts:
        raise ResultsTableError(f"{', '.join(map(str, folders))}: none of agent-ttft.json, "
                                "agent-ttft-live.json, vmm-cuda.json, ttft-model.json")
    return "\n\n".join(parts) + "\n"


def replace_block(text: str, block: str) -> str:
    """``text`` with the lines between the markers replaced by ``block``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ResultsTableError(f"the README needs {BEGIN} ... {END} (in this order)")
    head = text[:start + len(BEGIN)]
    return f"{head}\n{block.rstrip()}\n{text[end:]}"


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scripts.results_table",
                                     description="README results tables from a results folder")
    parser.add_argument("results_dirs", nargs="*", type=Path,
                        help="folders to take each file from, first match wins (default: "
                             "the --device folders of benchmarks/results, newest first)")
    parser.add_argument("--device", default="h200",
                        help="device part of the default folders' names")
    parser.add_argument("--readme", type=Path, default=None,
                        help=f"replace the block between {BEGIN} and {END} in this file")
    args = parser.parse_args(argv)
    try:
        block = render(args.results_dirs or result_dirs(device=args.device))
        if args.readme is not None:
            text = args.readme.read_text(encoding="utf-8")
            args.readme.write_text(replace_block(text, block), encoding="utf-8")
    except (ResultsTableError, OSError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(block, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
