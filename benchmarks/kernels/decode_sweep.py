"""Decode attention launch sweep on a real CUDA VMM arena, and the routing table it implies.

    PYTHONPATH=. python3 -m benchmarks.kernels.decode_sweep --out DIR [--reps 20]

Qwen2.5-7B heads (28 query heads, 4 KV heads, head dim 128, bf16; 33.5 MB of K+V per layer at
16K), batch 1 and 8 at 4K / 16K / 32K (``--batches``, ``--contexts``). For each shape it times,
per layer, inside a CUDA graph of all 28 layers as the engine runs decode (median of ``reps``
replays, CUDA events, a GPU sleep before each so launch latency stays out):
- the split-K Triton kernel at its default launch (`default_num_splits`, `DecodeConfig()`);
- the same kernel over launch modes x split counts x launch configs (``MODES`` x ``SPLITS`` x
  ``CONFIGS``; ``--modes``, ``--configs``): the reduce as a second launch or fused into the
  split kernel (its last split per sequence and KV head merges; up to 1024 splits), each with
  and without programmatic dependent launch (``pdl``: each launch starts while the one before
  drains; ``early``: as soon as it starts), and an L2 prefetch of each program's whole chunk
  (``prefetch``), or of its first tiles (a config's fourth number, ``64x2x3x1``: in the modes
  without prefetch it is 64x2x3); a config's letters ``b`` (balanced: equal token shares per
  split, for split counts such as 33, 66, 99, 132 that are multiples of the SM count over the
  4 KV heads), ``t`` (TMA loads of the full tiles), ``r`` (sliced reduce: the merge launch
  over head-dim slices too) and ``c`` (the CUDA C++ split kernel: warps x 16 tokens a tile,
  each warp its own ring of stages; only in the modes without fused, prefetch or early) and
  ``k`` (with ``c``: the splits merge in a thread-block cluster, no reduce launch; up to 16
  splits), ``64x2x3btr``, ``64x4x3rc``, ``64x4x2ck``;
- SDPA on the strided view (equal lengths only: the engine cannot route a CUDA-graph batch of
  unequal lengths to it without reading past each context, so it is a yardstick).
Every candidate's output is checked against SDPA's (relative error in the table).

Writes ``decode-sweep.json`` (every row, device, date, command), ``decode-sweep.md`` (per shape:
default, best, SDPA, in TB/s of K+V read; the best of each launch mode) and
``decode_routes.json``: the fastest Triton launch per shape in `edmm.kernels.decode_routes`'s
format. Pass it to ``edmm bench ttft
--decode-routes``; committed as ``edmm/kernels/decode_routes.json`` it is the engine's default.

``--budget-s S`` bounds the sweep: each shape gets an equal share of S seconds and sweeps its
launches (modes in ``--modes`` order, then configs, then split counts) until the share is spent,
so every shape gets a route. The table over all six shapes in about four minutes:

    python3 -m benchmarks.kernels.decode_sweep --out DIR --reps 10 --budget-s 180 \
        --modes reduce-pdl,reduce,fused-pdl,reduce-pdl-prefetch \
        --configs 64x2x3,32x2x3,64x4x3 --splits 8,16,32,64,96,128
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import itertools
import json
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.kernels.attention import (
    SPEC,
    Case,
    Row,
    _decode_bytes,
    _decode_fns,
    environment,
    make_kv,
    time_case,
    time_eager,
    time_graph,
)
from edmm.kernels import DecodeConfig, default_num_splits, triton_usable
from edmm.kernels._common import CounterWorkspace
from edmm.kernels._cuda_decode import MAX_CLUSTER
from edmm.kernels.decode_attention import MAX_FUSED_SPLITS, MAX_SPLITS

SPLITS = (8, 16, 32, 33, 48, 64, 66, 96, 99, 128, 132, 192, 256, 384, 512)
CONFIGS = (DecodeConfig(32, 4, 4), DecodeConfig(32, 2, 3), DecodeConfig(64, 4, 2),
           DecodeConfig(64, 4, 3), DecodeConfig(64, 8, 3), DecodeConfig(64, 2, 3),
           DecodeConfig(128, 4, 2), DecodeConfig(128, 8, 3))
FLAGS = ("fused", "pdl", "prefetch", "early_launch")  # DecodeConfig's launch-mode flags
MODES = {  # launch mode -> DecodeConfig flags (early launch only with pdl)
    "-".join(["fused" if fused else "reduce"]
             + [f for f, on in (("pdl", pdl), ("early", early), ("prefetch", pre)) if on]):
    {"fused": fused, "pdl": pdl, "prefetch": pre, "early_launch": early}
    for fused in (False, True) for pdl in (False, True) for early in (False, True)
    for pre in (False, True) if pdl or not early}
# config letters -> DecodeConfig flags: balanced splits, TMA loads, sliced reduce
SUFFIXES = {"b": "balanced", "t": "tma", "r": "sliced_reduce", "c": "cuda", "k": "cluster"}
CUDA_MODE_FLAGS = ("fused", "prefetch", "early_launch")  # modes the CUDA split kernel lacks
TARGET_TBS = 3.0  # issue 20: decode attention >= 3 TB/s at batch 1 and 8, 16K


def mode_of(config: DecodeConfig) -> str:
    """The launch mode name of a config (a key of `MODES`)."""
    return next(m for m, flags in MODES.items()
                if all(getattr(config, f) == flags[f] for f in FLAGS))


def candidates(modes: list[str], configs: tuple[DecodeConfig, ...], splits: tuple[int, ...],
               context: int) -> list[tuple[int, DecodeConfig]]:
    """(split count, config) of every swept launch at ``context``, each once: no split past
    the tiles (it would do nothing), none over the mode's limit; a config's prefetch depth
    applies in the modes that prefetch (elsewhere the config runs without it)."""
    out: list[tuple[int, DecodeConfig]] = []
    for mode in modes:
        flags = MODES[mode]
        for base in configs:
            if base.cuda and any(flags[f] for f in CUDA_MODE_FLAGS):
                continue
            config = replace(base, **flags,
                             prefetch_tiles=base.prefetch_tiles if flags["prefetch"] else 0)
            limit = MAX_FUSED_SPLITS if config.fused else MAX_SPLITS
            if config.cluster:
                limit = min(limit, MAX_CLUSTER)  # the CTAs of one cluster
            out += [(n, config) for n in splits if (n, config) not in out
                    and n <= limit and n <= -(-context // config.block_n)]
    return out


def sweep_shape(kv: torch.Tensor, batch: int, context: int, reps: int,
                launches: list[tuple[int, DecodeConfig]],
                deadline: float = float("inf")) -> list[Row]:
    """Rows of the default launch, SDPA and every (split count, config) of ``launches`` at
    one shape (op decode-graph, and decode for the default); launches not started by
    ``deadline`` (`time.monotonic`) are left out."""
    graph = functools.partial(time_graph, reps=reps)
    eager = functools.partial(time_eager, warmup=5, reps=reps)
    work = _decode_bytes(batch, context)
    case = Case("decode-graph", batch, context, 1, work, "GB/s")
    tri, sdpa = _decode_fns(kv, batch, context, max_context=kv.shape[1])
    default = default_num_splits(batch, SPEC.num_kv_heads, kv.shape[1])
    notes = {"triton": f"default: splits={default}, {DecodeConfig()}", "sdpa": "strided view"}
    rows = time_case(case, {"triton": tri, "sdpa": sdpa}, graph, notes)
    rows += time_case(Case("decode", batch, context, 1, work, "GB/s"),
                      {"triton": tri, "sdpa": sdpa}, eager, notes)
    workspace = CounterWorkspace()
    for splits, config in launches:
        if time.monotonic() > deadline:
            print(f"batch {batch} at {context}: time share spent, {len(launches)} launches "
                  "not all swept", file=sys.stderr)
            break
        cand, ref = _decode_fns(kv, batch, context, num_splits=splits, config=config,
                                workspace=workspace)
        rows += [_tag(r, splits, config) for r in time_case(
            case, {"triton-sweep": cand}, graph, {"triton-sweep": ""}, reference=ref)]
    return rows


def _tag(row: Row, splits: int, config: DecodeConfig) -> Row:
    row.note = f"splits={splits}, {mode_of(config)}, {config}"
    row.extra = {"num_splits": splits, **asdict(config)}
    return row


def routes(rows: list[Row]) -> list[dict[str, Any]]:
    """The fastest swept Triton launch of each shape (graph median), in the routing format."""
    best: dict[tuple[int, int], Row] = {}
    for r in rows:
        if r.impl != "triton-sweep" or (r.rel_err or 0.0) > 2e-2:
            continue
        key = (r.batch, r.context)
        if key not in best or r.median_us < best[key].median_us:
            best[key] = r
    return [{"batch": b, "context": c, "graph_us": r.median_us, **r.extra}
            for (b, c), r in sorted(best.items())]


def markdown(rows: list[Row], table: list[dict[str, Any]], header: str) -> str:
    """Per shape: the default launch, the best swept one and SDPA, per layer in a graph."""
    def cell(r: Row | None) -> str:
        return f"{r.median_us:.1f} us, {r.throughput / 1e3:.2f} TB/s" if r else "-"

    by = {(r.op, r.impl, r.batch, r.context): r for r in rows if r.impl != "triton-sweep"}
    lines = [header, "", f"Per layer, median inside a CUDA graph of {SPEC.num_layers} layers. "
             f"Target (issue 20): >= {TARGET_TBS} TB/s at batch 1 and 8.", "",
             "| batch | context | Triton default | best swept Triton (launch) | SDPA | eager "
             "Triton default | best >= target |", "|---|---|---|---|---|---|---|"]
    for route in table:
        b, c = route["batch"], route["context"]
        best = next(r for r in rows if r.impl == "triton-sweep" and (r.batch, r.context) == (b, c)
                    and r.median_us == route["graph_us"])
        lines.append(
            f"| {b} | {c} | {cell(by.get(('decode-graph', 'triton', b, c)))} | {cell(best)} "
            f"({best.note}) | {cell(by.get(('decode-graph', 'sdpa', b, c)))} | "
            f"{cell(by.get(('decode', 'triton', b, c)))} | "
            f"{'yes' if best.throughput / 1e3 >= TARGET_TBS else 'no'} |")
    return "\n".join([*lines, "", *_mode_table(rows)])


def _mode_table(rows: list[Row]) -> list[str]:
    """Per shape, the fastest launch of each mode (splits, tile, warps, stages)."""
    best: dict[tuple[int, int, str], Row] = {}
    for r in rows:
        if r.impl != "triton-sweep" or (r.rel_err or 0.0) > 2e-2:
            continue
        key = (r.batch, r.context, mode_of(DecodeConfig(**{k: v for k, v in r.extra.items()
                                                             if k != "num_splits"})))
        if key not in best or r.median_us < best[key].median_us:
            best[key] = r
    shapes = sorted({(b, c) for b, c, _ in best})
    modes = [m for m in MODES if any((b, c, m) in best for b, c in shapes)]
    lines = ["Best launch of each mode (reduce: a second launch merges the splits; fused: the "
             "split kernel's last split merges them; pdl: programmatic dependent launch; "
             "prefetch: each program's chunk asked of L2 first):", "",
             "| batch | context | " + " | ".join(modes) + " |",
             "|---|---|" + "---|" * len(modes)]
    for b, c in shapes:
        cells = [_mode_cell(best.get((b, c, m))) for m in modes]
        lines.append(f"| {b} | {c} | " + " | ".join(cells) + " |")
    return lines


def _mode_cell(r: Row | None) -> str:
    if r is None:
        return "-"
    e = r.extra
    tiles = f"x{e['prefetch_tiles']}" if e.get("prefetch_tiles") else ""
    return (f"{r.median_us:.1f} us, {r.throughput / 1e3:.2f} TB/s (splits={e['num_splits']}, "
            f"{e['block_n']}x{e['num_warps']}x{e['num_stages']}{tiles}"
            f"{''.join(c for c, flag in SUFFIXES.items() if e.get(flag))})")


def parse_configs(text: str) -> tuple[DecodeConfig, ...]:
    """``"32x2x3,64x4x3x1,64x2x3bt,64x2x3r"`` -> DecodeConfigs (tokens per tile x warps x
    stages, optionally x tiles a prefetch asks L2 for: 0, the default, is the whole chunk; then
    optionally ``b``, balanced splits, ``t``, TMA loads, ``r``, sliced reduce, ``c``, the
    CUDA C++ split kernel, and ``k``, its cluster merge:
    `DecodeConfig`'s flags)."""
    try:
        configs = []
        for item in (i for i in text.split(",") if i):
            flags = item[len(item.rstrip("".join(SUFFIXES))):]
            p = [int(v) for v in item[:len(item) - len(flags)].split("x")]
            if len(p) not in (3, 4) or len(set(flags)) != len(flags):
                raise ValueError("three or four numbers per config, each flag once")
            configs.append(DecodeConfig(p[0], p[1], p[2], prefetch_tiles=p[3] if len(p) == 4
                                        else 0, **{flag: c in flags
                                                   for c, flag in SUFFIXES.items()}))
        if not configs:
            raise ValueError("no config")
        return tuple(configs)
    except ValueError as e:
        raise SystemExit("--configs: expected BLOCK_NxWARPSxSTAGES[xPREFETCH_TILES][b][t][r][c][k],"
                         f"..., got {text!r}") from e


def main(argv: list[str] | None = None) -> int:
    """CLI entry; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"launch modes to sweep, of {', '.join(MODES)}")
    parser.add_argument("--configs", default="",
                        help="launch configs BLOCK_NxWARPSxSTAGES,... (default: all of CONFIGS)")
    parser.add_argument("--splits", default="", help="split counts (default: all of SPLITS)")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="share this many seconds evenly over the shapes: each sweeps its "
                             "launches (modes in --modes order) until its share is spent")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        parser.error(f"--modes: unknown mode in {modes}; modes are {', '.join(MODES)}")
    configs = parse_configs(args.configs) if args.configs else CONFIGS
    splits = tuple(int(x) for x in args.splits.split(",")) if args.splits else SPLITS
    if not torch.cuda.is_available() or not triton_usable("cuda"):
        print("decode_sweep.py needs a CUDA GPU and triton", file=sys.stderr)
        return 2
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    mem = make_kv(max(batches), max(contexts))
    env = environment(mem.kind)
    command = "python3 -m benchmarks.kernels.decode_sweep " + shlex.join(sys.argv[1:])
    rows: list[Row] = []
    md = ""
    start, shapes = time.monotonic(), len(batches) * len(contexts)
    try:
        with torch.inference_mode():
            for i, (context, batch) in enumerate(itertools.product(contexts, batches)):
                deadline = start + args.budget_s * (i + 1) / shapes
                rows += sweep_shape(mem.kv, batch, context, args.reps,
                                    candidates(modes, configs, splits, context), deadline)
                print(f"swept batch {batch} at {context}", file=sys.stderr)
                md = write(args.out, rows, env, command)  # a cut-off run keeps its shapes
    finally:
        mem.close()
    print(md)
    return 0


def write(out: Path, rows: list[Row], env: dict[str, Any], command: str) -> str:
    """Write the three files from the rows so far; returns the markdown."""
    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    table = routes(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode-sweep.json").write_text(json.dumps(
        {"environment": env, "date": date, "command": command,
         "rows": [asdict(r) for r in rows]}, indent=2))
    (out / "decode_routes.json").write_text(json.dumps(
        {"device": env["gpu"], "date": date, "command": command, "routes": table}, indent=2))
    md = markdown(rows, table, f"# Decode attention sweep\n\n{env}\n\n{date}: `{command}`")
    (out / "decode-sweep.md").write_text(md + "\n")
    return md


if __name__ == "__main__":
    raise SystemExit(main())
