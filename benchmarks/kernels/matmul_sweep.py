"""Skinny-matmul sweep of a model's decode projections, and the routing table it implies.

    PYTHONPATH=. python3 -m benchmarks.kernels.matmul_sweep --out DIR [--model qwen2.5-7b]

For each projection of the model (qkv, o_proj, gate_up, down, LM head: N x K of its weight)
and each decode batch size (``--rows``, default 1, 2, 4, 8, 16: the decode graphs' sizes) it
times ``F.linear`` (cuBLAS) and the skinny kernel (`edmm.kernels.skinny_matmul`) over launch
configs x split counts: per call, the median of ``--reps`` replays of a CUDA graph that calls
the op once on each of several distinct weights (as many as the model has layers, fewer for
the large ones: always > 1 GB in all, so nothing comes from the 50 MB L2), the way a decode
step runs 28 layers. Every candidate's output is checked against an fp32 product rounded once
(a candidate off by more than one unit in the last place is dropped).

Writes ``matmul-sweep.json`` (every timing, device, date, command), ``matmul-sweep.md`` (per
projection and row count: cuBLAS, the best skinny launch, in TB/s of weight read, and the
route) and ``matmul_routes.json`` (`edmm.kernels.matmul_routes`'s format: the skinny launch
where it beat cuBLAS, else cuBLAS). Pass it to ``edmm bench ttft --matmul-routes``; committed
as ``edmm/kernels/matmul_routes.json`` it is the engine's default. ``--budget-s`` bounds the
run: shapes (smallest weight first) not reached in time are left out (the engine keeps cuBLAS
for them), and the files are rewritten after each shape, so a cut run keeps what it finished.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.kernels.attention import time_eager
from edmm.kernels import triton_usable
from edmm.kernels._common import CounterWorkspace, SkinnyConfig, cdiv
from edmm.kernels.matmul_routes import route_row
from edmm.kernels.skinny_matmul import MAX_ROWS, skinny_linear
from edmm.model.config import ModelConfig, resolve_preset

ROWS = (1, 2, 4, 8, 16)
# block_n, block_k, warps, stages: on the H200 deeper pipelines won (session 9: 6 stages over
# 4 for every projection), so most tiles here are as deep as shared memory allows
TILES = ((16, 256, 4, 8), (32, 128, 4, 8), (32, 256, 4, 6), (64, 128, 4, 6), (64, 128, 4, 8),
         (64, 256, 4, 4), (128, 128, 8, 4), (128, 128, 8, 6))
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
MIN_PROGRAMS, MAX_PROGRAMS = 100, 4096  # fewer leave SMs idle; more only add merge traffic
WEIGHT_BYTES = 1 << 30  # the distinct weights of one timing hold at least this much


@dataclass(frozen=True)
class Shape:
    """One projection: its name, output features N, input features K, whether it has a bias."""

    name: str
    n: int
    k: int
    bias: bool


@dataclass
class Timing:
    """One candidate at one (shape, rows): median us per call, weight read rate, error."""

    shape: str
    n: int
    k: int
    rows: int
    kernel: str  # "cublas" or "skinny"
    config: dict[str, Any] | None  # SkinnyConfig's fields
    us: float
    tbs: float
    max_ulps: float  # largest error in units of the output dtype's last place vs fp32


def projections(cfg: ModelConfig) -> list[Shape]:
    """The projections of one decoder layer, and the LM head."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [Shape("qkv", q + 2 * kv, cfg.hidden_size, cfg.attention_bias),
            Shape("o_proj", cfg.hidden_size, q, cfg.o_proj_bias),
            Shape("gate_up", 2 * cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias),
            Shape("down", cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias),
            Shape("lm_head", cfg.vocab_size, cfg.hidden_size, False)]


def candidates(n: int, k: int) -> list[SkinnyConfig]:
    """Launch configs whose program count fills the GPU without waste (see MIN/MAX_PROGRAMS);
    a split count that rounds to the same split size as a smaller one is left out."""
    out = []
    for bn, bk, warps, stages in TILES:
        seen = set()
        for s in SPLITS:
            k_split = cdiv(cdiv(k, s), bk) * bk
            splits = cdiv(k, k_split)
            programs = cdiv(n, bn) * splits
            if splits in seen or programs > MAX_PROGRAMS or (programs < MIN_PROGRAMS and s > 1):
                continue
            seen.add(splits)
            out.append(SkinnyConfig(bn, bk, splits, warps, stages))
    return out


def time_op(fn: Callable[[int], object], copies: int, reps: int) -> float:
    """Median us per call of a CUDA graph calling ``fn(i)`` for i < copies."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile, settle the allocator
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    for _ in range(3):
        graph.replay()
    return statistics.median(time_eager(lambda _: graph.replay(), 0, reps)) / copies


def max_ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |got - ref| in units of got's dtype's last place at |ref| (ref fp32)."""
    ulp = torch.finfo(got.dtype).eps * ref.abs().clamp_min(1e-2)
    return float(((got.float() - ref).abs() / ulp).max())


def sweep_shape(shape: Shape, rows: tuple[int, ...], reps: int, dtype: torch.dtype
                ) -> list[Timing]:
    """cuBLAS and every candidate at each row count of ``rows``, one projection."""
    nbytes = shape.n * shape.k * torch.finfo(dtype).bits // 8
    copies = max(2, min(28, cdiv(WEIGHT_BYTES, nbytes)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = [torch.randn(shape.n, shape.k, device="cuda", dtype=dtype, generator=gen)
         .mul_(shape.k ** -0.5) for _ in range(copies)]  # [N, K] each
    b = [torch.randn(shape.n, device="cuda", dtype=dtype, generator=gen) if shape.bias
         else None for _ in range(copies)]
    workspace = CounterWorkspace()
    out: list[Timing] = []
    for m in rows:
        x = torch.randn(m, shape.k, device="cuda", dtype=dtype, generator=gen)  # [M, K]
        ref = F.linear(x.float(), w[0].float(), b[0].float() if b[0] is not None else None)

        def timing(kernel: str, cfg: SkinnyConfig | None, fn: Callable[[int], torch.Tensor],
                   m: int = m, ref: torch.Tensor = ref) -> Timing:
            ulps = max_ulps(fn(0), ref)
            us = time_op(fn, copies, reps)
            return Timing(shape.name, shape.n, shape.k, m, kernel,
                          asdict(cfg) if cfg else None, us, nbytes / us / 1e6, ulps)

        def cublas(i: int, x: torch.Tensor = x) -> torch.Tensor:
            return F.linear(x, w[i], b[i])

        out.append(timing("cublas", None, cublas))
        for cfg in candidates(shape.n, shape.k):
            def skinny(i: int, x: torch.Tensor = x, cfg: SkinnyConfig = cfg) -> torch.Tensor:
                return skinny_linear(x, w[i], b[i], cfg, workspace)

            try:
                out.append(timing("skinny", cfg, skinny))
            except Exception as e:
                print(f"skipped {shape.name} rows={m} {cfg}: {str(e)[:120]}", file=sys.stderr)
    return out


def routes(timings: list[Timing]) -> list[dict[str, Any]]:
    """Per (rows, N, K): the fastest skinny launch where it beats cuBLAS, else cuBLAS."""
    table = []
    for key in sorted({(t.rows, t.n, t.k) for t in timings}):
        group = [t for t in timings if (t.rows, t.n, t.k) == key]
        cublas = next(t for t in group if t.kernel == "cublas")
        skinny = [t for t in group if t.kernel == "skinny" and t.max_ulps <= 1.0]
        best = min(skinny, key=lambda t: t.us, default=None)
        if best is not None and best.config is not None and best.us < cublas.us:
            table.append(route_row(*key, SkinnyConfig(**best.config), best.us, cublas.us))
        else:
            table.append(route_row(*key, None, cublas.us, cublas.us))
    return table


def markdown(timings: list[Timing], header: str) -> str:
    """Per projection and row count: cuBLAS, the best skinny launch, the route's gain."""
    lines = [header, "", "Median per call inside a CUDA graph over distinct weights; TB/s of "
             "weight read.", "", "| projection | N x K | rows | cuBLAS | best skinny (launch) "
             "| error (ulp) | route | saves |", "|---|---|---:|---:|---|---:|---|---:|"]
    for name, n, k, m in dict.fromkeys((t.shape, t.n, t.k, t.rows) for t in timings):
        group = [t for t in timings if (t.shape, t.rows) == (name, m)]
        cublas = next(t for t in group if t.kernel == "cublas")
        skinny = [t for t in group if t.kernel == "skinny" and t.max_ulps <= 1.0]
        best = min(skinny, key=lambda t: t.us, default=None)
        win = best is not None and best.us < cublas.us
        cell = (f"{best.us:.1f} us, {best.tbs:.2f} TB/s ({_launch(best.config)})"
                if best else "-")
        lines.append(f"| {name} | {n} x {k} | {m} | {cublas.us:.1f} us, {cublas.tbs:.2f} TB/s "
                     f"| {cell} | {best.max_ulps if best else 0:.2f} | "
                     f"{'skinny' if win else 'cublas'} | "
                     f"{(cublas.us - best.us) if best and win else 0:.1f} us |")
    return "\n".join(lines)


def _launch(config: dict[str, Any] | None) -> str:
    if not config:
        return ""
    return (f"{config['block_n']}x{config['block_k']}, splits={config['splits']}, "
            f"{config['num_warps']} warps, {config['num_stages']} stages")


def write(out: Path, timings: list[Timing], env: dict[str, Any], command: str) -> str:
    """Write the three files from the timings so far; returns the markdown."""
    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    out.mkdir(parents=True, exist_ok=True)
    (out / "matmul-sweep.json").write_text(json.dumps(
        {"environment": env, "date": date, "command": command,
         "timings": [asdict(t) for t in timings]}, indent=2))
    (out / "matmul_routes.json").write_text(json.dumps(
        {"device": env["gpu"], "date": date, "command": command, "routes": routes(timings)},
        indent=2))
    md = markdown(timings, f"# Skinny matmul sweep\n\n{env}\n\n{date}: `{command}`")
    (out / "matmul-sweep.md").write_text(md + "\n")
    return md


def main(argv: list[str] | None = None) -> int:
    """CLI entry; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen2.5-7b", help="a preset of edmm.model.config")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default="", help="projections to sweep (default: all)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="start no new projection after this many seconds")
    args = parser.parse_args(argv)
    rows = tuple(int(r) for r in args.rows.split(","))
    if not all(1 <= r <= MAX_ROWS for r in rows):
        parser.error(f"--rows must be in [1, {MAX_ROWS}]")
    if not torch.cuda.is_available() or not triton_usable("cuda"):
        print("matmul_sweep.py needs a CUDA GPU and triton", file=sys.stderr)
        return 2
    cfg = resolve_preset(args.model)
    shapes = sorted((s for s in projections(cfg)
                     if not args.shapes or s.name in args.shapes.split(",")),
                    key=lambda s: s.n * s.k)  # smallest first: where cuBLAS streams worst
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "triton": triton.__version__, "model": args.model,
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    command = "python3 -m benchmarks.kernels.matmul_sweep " + shlex.join(sys.argv[1:])
    start, timings, md = time.monotonic(), [], ""
    with torch.inference_mode():
        for shape in shapes:
            if time.monotonic() - start > args.budget_s:
                print(f"budget spent: {shape.name} and after left out", file=sys.stderr)
                break
            timings += sweep_shape(shape, rows, args.reps, cfg.torch_dtype)
            torch.cuda.empty_cache()  # the shape's weights
            md = write(args.out, timings, env, command)  # a cut-off run keeps its shapes
            print(f"swept {shape.name} ({time.monotonic() - start:.0f} s)", file=sys.stderr)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
