"""Where one decode attention layer's time goes, per shape, inside a CUDA graph of 28 layers.

    PYTHONPATH=. python3 -m edmm.bench.scripts.decode_parts --out DIR [--routes FILE]

For batch 1 and 8 at 4K / 16K / 32K (``--batches``, ``--contexts``), at the launch a routing
table gives (``--routes``; default the committed `edmm/kernels/decode_routes.json`), it times
per layer (median of ``reps`` graph replays, as `decode_sweep` does):
- ``full``: the routed `decode_attention` (split kernel, then its merge);
- ``split only``: the same split kernel writing its partials, no merge (not a result: it
  shows what the merge, a reduce launch or the fused last-split merge, adds);
- ``launch floor``: a kernel of the same grid that only waits for the one before it (with
  the route's programmatic dependent launch) and writes one value per program;
- ``read floor``: ``torch.sum`` of a contiguous buffer of the layer's K+V bytes (one buffer
  per layer, so nothing stays in L2): a yardstick only; PyTorch's reduction streams slower
  than the split kernel at these sizes (measured on the H200, session 10), so it bounds
  nothing.

Writes ``decode-parts.json`` and ``decode-parts.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from edmm.bench.attention import (
    NUM_HEADS,
    SCALE,
    SPEC,
    _decode_bytes,
    environment,
    make_kv,
    time_graph,
)
from edmm.bench.stats import percentile
from edmm.kernels import DecodeConfig, decode_attention, triton_usable
from edmm.kernels._common import CounterWorkspace, pdl_usable
from edmm.kernels.decode_attention import _launch_split, _partials
from edmm.kernels.decode_routes import DecodeRoutes, default_decode_routes

PARTS = ("full", "split only", "launch floor", "read floor")


def _floor_kernel() -> Any:
    """A Triton kernel that waits for the kernel before it and writes one value per program
    (imported here: triton is needed only on the GPU)."""
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def launch_floor_kernel(out_ptr, PDL: tl.constexpr) -> None:
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        pid = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0)
        tl.store(out_ptr + pid + tl.program_id(0), 1.0)

    return launch_floor_kernel


def part_fns(kv: torch.Tensor, q: torch.Tensor, context: int, splits: int,
             config: DecodeConfig) -> dict[str, Callable[[int], torch.Tensor]]:
    """The per-layer calls of every part for queries ``q`` [B, 28, 128] over slots 0 .. B - 1
    of ``context`` tokens, at one launch."""
    dev, batch = kv.device, q.shape[0]
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    ws = CounterWorkspace()
    out = torch.empty_like(q)  # [B, Hq, D]
    part_o, part_lse = _partials(batch, NUM_HEADS, splits, SPEC.head_dim, dev)
    pdl = config.pdl and pdl_usable(dev)
    prefetch = config.prefetch and pdl_usable(dev)
    grid = (batch, SPEC.num_kv_heads, splits)
    flag = torch.empty(math.prod(grid), dtype=torch.float32, device=dev)
    floor = _floor_kernel()
    words = int(_decode_bytes(batch, context)) // SPEC.dtype.itemsize
    bufs = torch.empty(SPEC.num_layers, words, dtype=SPEC.dtype, device=dev).normal_()

    def full(i: int) -> torch.Tensor:
        return decode_attention(q, kv, i % SPEC.num_layers, slots, lens, SCALE,
                                num_splits=splits, config=config, workspace=ws)

    def split_only(i: int) -> torch.Tensor:
        layer = kv[:, :, i % SPEC.num_layers]  # [S, M, 2, Hkv, D]
        _launch_split(q, layer, slots, lens, out, part_o, part_lse, None, part_lse, SCALE,
                      splits, config, False, pdl, prefetch)
        return part_o

    def launch_floor(i: int) -> torch.Tensor:
        floor[grid](flag, PDL=pdl, **({"launch_pdl": True} if pdl else {}))
        return flag

    def read_floor(i: int) -> torch.Tensor:
        return bufs[i % SPEC.num_layers].sum(dtype=torch.float32)

    return dict(zip(PARTS, (full, split_only, launch_floor, read_floor), strict=True))


def time_parts(kv: torch.Tensor, batch: int, context: int, routes: DecodeRoutes,
               reps: int) -> dict[str, Any]:
    """One shape's row: the route and each part's median per-layer time (us)."""
    route = routes.lookup(batch, context)
    if route is None:
        raise SystemExit("the routing table is empty")
    q = torch.randn(batch, NUM_HEADS, SPEC.head_dim, dtype=SPEC.dtype, device=kv.device)
    fns = part_fns(kv, q, context, route.num_splits, route.config)
    us = {name: percentile(time_graph(fn, reps), 50) for name, fn in fns.items()}
    return {"batch": batch, "context": context, "num_splits": route.num_splits,
            "config": repr(route.config), "bytes": _decode_bytes(batch, context), "us": us}


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    """One line per shape: each part's time and, for full and read floor, TB/s."""
    lines = [header, "", "Per layer, median inside a CUDA graph of 28 layers (us; TB/s of the "
             "layer's K+V bytes).", "",
             "| batch | context | route | " + " | ".join(PARTS) + " |",
             "|---|---|---|" + "---|" * len(PARTS)]
    for r in rows:
        cells = [f"{r['us'][p]:.1f}" + (f" ({r['bytes'] / r['us'][p] / 1e6:.2f} TB/s)"
                                        if p in ("full", "read floor") else "")
                 for p in PARTS]
        lines.append(f"| {r['batch']} | {r['context']} | splits={r['num_splits']}, "
                     f"{r['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--routes", type=Path, default=None)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--contexts", default="4096,16384,32768")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not triton_usable("cuda"):
        print("decode_parts.py needs a CUDA GPU and triton", file=sys.stderr)
        return 2
    routes = DecodeRoutes.from_json(args.routes) if args.routes else default_decode_routes()
    if routes is None:
        print("no routing table (--routes)", file=sys.stderr)
        return 2
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    mem = make_kv(max(batches), max(contexts))
    rows = []
    try:
        with torch.inference_mode():
            for context in contexts:
                for batch in batches:
                    rows.append(time_parts(mem.kv, batch, context, routes, args.reps))
    finally:
        mem.close()
    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    command = "python3 -m edmm.bench.scripts.decode_parts " + shlex.join(sys.argv[1:])
    env = environment(mem.kind)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode-parts.json").write_text(json.dumps(
        {"environment": env, "date": date, "command": command, "routes": routes.source,
         "rows": rows}, indent=2))
    md = markdown(rows, f"# Decode attention parts\n\n{env}\n\n{date}: `{command}`")
    (args.out / "decode-parts.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
