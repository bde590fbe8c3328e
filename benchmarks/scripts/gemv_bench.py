"""One-row projections at Qwen2.5-7B's shapes: cuBLAS (F.linear) against the Triton GEMV.

    PYTHONPATH=. python3 benchmarks/scripts/gemv_bench.py --out DIR

Each case is 28 calls (one per layer, 28 weights) captured in a CUDA graph, as a decode step
replays them; the time is the graph's median over 30 replays, the bandwidth the weights'
bytes over it. Writes ``gemv.{csv,json,md}`` (device, date, command) to DIR.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from edmm.bench.report import ResultWriter, collect_environment
from edmm.kernels import GemvConfig, gemv

LAYERS = 28
SHAPES = {"qkv (bias)": (4608, 3584, True), "o": (3584, 3584, False),
          "gate_up": (37888, 3584, False), "down": (3584, 18944, False)}
CONFIGS = (GemvConfig(), GemvConfig(4, 1024), GemvConfig(8, 1024, 8), GemvConfig(16, 512),
           GemvConfig(4, 512), GemvConfig(2, 1024))


def graph_us(fn: Callable[[], object], reps: int = 30) -> list[float]:
    """Times (us) of replaying a graph of ``fn``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps + 3):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times[3:]


def _case(name: str, n: int, k: int, has_bias: bool
          ) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """Per-replay rows and summary rows of one shape, every impl."""
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    bs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
          for _ in range(LAYERS)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, ws[0], bs[0]).float()
    impls: dict[str, Callable[[], list[torch.Tensor]]] = {
        "cublas": lambda: [F.linear(x, w, b) for w, b in zip(ws, bs, strict=True)]}
    for cfg in CONFIGS:
        impls[f"gemv {cfg.block_n}x{cfg.block_k} w{cfg.num_warps}"] = (
            lambda cfg=cfg: [gemv(x, w, b, cfg) for w, b in zip(ws, bs, strict=True)])
    rows: list[dict[str, object]] = []
    summary: list[dict[str, object]] = []
    for impl, fn in impls.items():
        err = float((fn()[0].float() - ref).norm() / ref.norm())
        times = graph_us(fn)
        med = statistics.median(times)
        rows += [{"shape": name, "impl": impl, "us_per_28": t} for t in times]
        summary.append({"shape": name, "n": n, "k": k, "impl": impl,
                        "median_us_per_28": round(med, 1),
                        "tb_per_s": round(LAYERS * n * k * 2 / med / 1e6, 2),
                        "rel_err_vs_cublas": f"{err:.1e}"})
        print(summary[-1], flush=True)
    return rows, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows, summary = [], []
    for name, (n, k, has_bias) in SHAPES.items():
        case_rows, case_summary = _case(name, n, k, has_bias)
        rows += case_rows
        summary += case_summary
    writer = ResultWriter(args.out, "gemv", collect_environment("cuda"))
    writer.add_rows(rows)
    writer.write(summary, title="one-row projections: cuBLAS vs Triton GEMV (28 per graph)",
                 notes=["bf16 weights, random; 28 distinct weights per graph (no L2 reuse)",
                        "command: python3 benchmarks/scripts/gemv_bench.py --out DIR"])


if __name__ == "__main__":
    main()
