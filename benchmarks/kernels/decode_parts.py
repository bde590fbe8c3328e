"""Where one decode attention layer's time goes, per shape, inside a CUDA graph of 28 layers.

    PYTHONPATH=. python3 -m benchmarks.kernels.decode_parts --out DIR [--routes FILE]

For batch 1 and 8 at 4K / 16K / 32K (``--batches``, ``--contexts``), at the launch a routing
table gives (``--routes``; default the committed `edmm/kernels/decode_routes.json`), it times
per layer (median of ``reps`` graph replays, as `decode_sweep` does):
- ``full``: the routed `decode_attention` (split kernel, then its merge);
- ``split only``: the same split kernel writing its partials, no merge (not a result: it
  shows what the merge, a reduce launch or the fused last-split merge, adds);
- ``launch floor``: a kernel of the same grid that only waits for the one before it (with
  the route's programmatic dependent launch) and writes one value per program;
- ``arena read floor``: a streaming-read Triton kernel (`stream_read_kernel`) over the same
  K+V bytes through the same arena views the decode kernel reads (each program sums its
  contiguous share of the (slot, token) rows to one value, so nothing is optimised away),
  with programmatic dependent launch, the fastest of `FLOORS` (grid size, rows per load,
  warps, stages, whole 2 KB token rows or one KV head's K and V per program as the decode
  kernel reads them; its loads are not software-pipelined, the grid's programs per SM keep
  the bytes in flight): the time no kernel reading those bytes that way beats by much;
- ``contiguous read floor``: the same kernel over a contiguous buffer of the same bytes (one
  buffer per layer, so nothing stays in L2): what the arena's token-major layout costs.

(Session 10's ``read floor``, ``torch.sum`` of a contiguous buffer, streamed slower than the
split kernel: it bounded nothing, and the Triton floors replace it.)

Writes ``decode-parts.json`` (each floor candidate's time too) and ``decode-parts.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import math
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.kernels.attention import (
    NUM_HEADS,
    SCALE,
    SPEC,
    _decode_bytes,
    _guarded,
    environment,
    make_kv,
    time_graph,
)
from edmm.bench.stats import percentile
from edmm.kernels import DecodeConfig, decode_attention, triton_usable
from edmm.kernels._common import CounterWorkspace, pdl_usable
from edmm.kernels.decode_attention import _launch_split, _partials
from edmm.kernels.decode_routes import DecodeRoutes, default_decode_routes

PARTS = ("full", "split only", "launch floor", "arena read floor", "contiguous read floor")
FLOOR_PARTS = PARTS[3:]


@dataclass(frozen=True)
class Floor:
    """One launch of the streaming-read kernel: ``programs`` programs (per KV head with
    ``per_head``), ``rows`` token rows per load, Triton's warps and stages."""

    programs: int
    rows: int
    num_warps: int
    num_stages: int
    per_head: bool = False

    def __str__(self) -> str:
        return (f"{self.programs}{'/head' if self.per_head else ''} programs, {self.rows} rows, "
                f"{self.num_warps}w{self.num_stages}s")


FLOORS = (Floor(132, 16, 8, 3), Floor(264, 16, 8, 3), Floor(528, 8, 4, 3), Floor(1056, 8, 4, 3),
          Floor(2112, 4, 4, 3), Floor(1056, 16, 8, 3), Floor(132, 16, 4, 3, per_head=True),
          Floor(264, 8, 4, 3, per_head=True))


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


@functools.cache
def _stream_kernel() -> Any:
    """The streaming-read kernel (see `stream_fns`; imported here: triton is GPU-only)."""
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def stream_read_kernel(kv_ptr, out_ptr, num_rows, tokens, rows_per_program,
                           stride_s, stride_t, stride_kv, stride_h,
                           ROWS: tl.constexpr, WIDTH: tl.constexpr, PER_HEAD: tl.constexpr,
                           PDL: tl.constexpr) -> None:
        """Program p sums rows [p * rows_per_program, ..) of the (slot, token) rows, slot
        major (``tokens`` per slot): each row WIDTH contiguous elements, or with PER_HEAD the
        K and V rows of KV head ``program_id(1)``, as the decode kernel reads them."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        lo = tl.program_id(0) * rows_per_program
        hi = tl.minimum(lo + rows_per_program, num_rows)
        base = kv_ptr + tl.program_id(1).to(tl.int64) * stride_h
        offs_r = tl.arange(0, ROWS)
        offs_w = tl.arange(0, WIDTH)
        acc = tl.zeros([ROWS], tl.float32)  # few registers: the loads' bytes stay in flight
        for r0 in range(lo, hi, ROWS):
            r = r0 + offs_r  # [ROWS]
            mask = (r < hi)[:, None]
            at = ((r // tokens).to(tl.int64) * stride_s + (r % tokens).to(tl.int64) * stride_t)
            ptrs = base + at[:, None] + offs_w[None, :]  # [ROWS, WIDTH]
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            if PER_HEAD:
                x += tl.load(ptrs + stride_kv, mask=mask, other=0.0).to(tl.float32)
            acc += tl.sum(x, 1)
        pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        tl.store(out_ptr + pid, tl.sum(acc, 0))

    return stream_read_kernel


def stream_fns(kv: torch.Tensor, batch: int, context: int, floors: tuple[Floor, ...],
               contiguous: bool) -> dict[Floor, Callable[[int], torch.Tensor]]:
    """Per-layer calls of the streaming-read kernel at each of ``floors``: over tokens
    0 .. context - 1 of slots 0 .. batch - 1 of the arena ``kv`` [S, M, L, 2, Hkv, D], or
    with ``contiguous`` over one contiguous buffer per layer of as many bytes. Each call
    returns its per-program sums."""
    dev = kv.device
    _, _, layers, two, heads, dim = kv.shape
    if contiguous:  # [L, B, context, 2, Hkv, D]
        src = torch.empty(layers, batch, context, two, heads, dim, dtype=kv.dtype,
                          device=dev).normal_()
        views = [src[i] for i in range(layers)]
    else:
        views = [kv[:batch, :context, i] for i in range(layers)]  # [B, n, 2, Hkv, D]
    if any(v.stride(2) != heads * dim or v.stride(3) != dim or v.stride(4) != 1 for v in views):
        raise SystemExit("the floor kernel reads token rows [2, Hkv, D] contiguous")
    pdl = pdl_usable(dev)
    kernel = _stream_kernel()
    num_rows = batch * context
    fns: dict[Floor, Callable[[int], torch.Tensor]] = {}
    for f in floors:
        grid = (f.programs, heads if f.per_head else 1)
        sums = torch.empty(math.prod(grid), dtype=torch.float32, device=dev)
        width = dim if f.per_head else two * heads * dim

        def call(i: int, f: Floor = f, grid: tuple[int, int] = grid, sums: torch.Tensor = sums,
                 width: int = width) -> torch.Tensor:
            v = views[i % layers]
            kernel[grid](v, sums, num_rows, context, -(-num_rows // f.programs), v.stride(0),
                         v.stride(1), v.stride(2), v.stride(3) if f.per_head else 0,
                         ROWS=f.rows, WIDTH=width, PER_HEAD=f.per_head, PDL=pdl,
                         num_warps=f.num_warps, num_stages=f.num_stages,
                         **({"launch_pdl": True} if pdl else {}))
            return sums

        fns[f] = call
    return fns


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

    return {"full": full, "split only": split_only, "launch floor": launch_floor}


def time_parts(kv: torch.Tensor, batch: int, context: int, routes: DecodeRoutes,
               reps: int) -> dict[str, Any]:
    """One shape's row: the route and each part's median per-layer time (us)."""
    route = routes.lookup(batch, context)
    if route is None:
        raise SystemExit("the routing table is empty")
    q = torch.randn(batch, NUM_HEADS, SPEC.head_dim, dtype=SPEC.dtype, device=kv.device)
    fns = part_fns(kv, q, context, route.num_splits, route.config)
    us = {name: percentile(time_graph(fn, reps), 50) for name, fn in fns.items()}
    floors: dict[str, dict[str, float]] = {}
    for part in FLOOR_PARTS:
        cands = stream_fns(kv, batch, context, FLOORS, contiguous=part != "arena read floor")
        timed = {str(f): _guarded(functools.partial(time_graph, fn, reps))
                 for f, fn in cands.items()}
        del cands  # the contiguous buffers
        floors[part] = {f: percentile(t, 50) for f, t in timed.items() if t is not None}
        us[part] = min(floors[part].values(), default=float("nan"))
    return {"batch": batch, "context": context, "num_splits": route.num_splits,
            "config": repr(route.config), "bytes": _decode_bytes(batch, context), "us": us,
            "floors": floors}


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    """One line per shape: each part's time and, for full and the read floors, TB/s; then
    the fastest floor launch of each shape."""
    lines = [header, "", "Per layer, median inside a CUDA graph of 28 layers (us; TB/s of the "
             "layer's K+V bytes).", "",
             "| batch | context | route | " + " | ".join(PARTS) + " |",
             "|---|---|---|" + "---|" * len(PARTS)]
    for r in rows:
        cells = [f"{r['us'][p]:.1f}" + (f" ({r['bytes'] / r['us'][p] / 1e6:.2f} TB/s)"
                                        if p == "full" or p in FLOOR_PARTS else "")
                 for p in PARTS]
        lines.append(f"| {r['batch']} | {r['context']} | splits={r['num_splits']}, "
                     f"{r['config']} | " + " | ".join(cells) + " |")
    lines += ["", "Fastest read-floor launch (of `FLOORS`):", ""]
    for r in rows:
        best = [f"{p}: {min(r['floors'][p], key=r['floors'][p].__getitem__, default='-')}"
                for p in FLOOR_PARTS]
        lines.append(f"- batch {r['batch']}, {r['context']}: " + "; ".join(best))
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
    command = "python3 -m benchmarks.kernels.decode_parts " + shlex.join(sys.argv[1:])
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
