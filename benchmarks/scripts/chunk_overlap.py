"""Does a chunked prefill's host work overlap the device's? (diagnostic, H200)

    python -m benchmarks.scripts.chunk_overlap [--context 16384] [--chunk 2048]

Runs the full prefill of the qwen2.5-7b preset in passes of ``--chunk`` tokens (as
`edmm bench ttft --full-prefill-chunk` does) and prints, per pass, the host time spent mapping
pages (`grow`: the arena's driver time, `KVArena.driver`), building the attention metadata
(`meta`, one host-to-device copy) and launching the model (`launch`). If building a pass's
metadata waits for the previous pass's kernels, `meta` is as long as a pass's device time.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import edmm.model.attention as attention_module
from edmm.bench.model_ops import EdmmSide, ModelOpsConfig


def _timed(fn: Callable[..., Any], log: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        log.append((time.perf_counter() - t0) * 1e3)
        return out
    return wrapper


class _PinnedNumpy:
    """numpy, but `concatenate` writes into page-locked memory (for the pinned variant)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def concatenate(parts: list[np.ndarray]) -> np.ndarray:
        n = sum(len(p) for p in parts)
        out = torch.empty(n, dtype=torch.int64, pin_memory=True)
        np.concatenate(parts, out=out.numpy())
        return out.numpy()


def _extend(side: EdmmSide, ids: torch.Tensor, chunk: int, grow: list[float],
            launch: list[float]) -> torch.Tensor:
    """`EdmmSide.extend`, logging each pass's page mapping (ms of the arena's driver calls)
    and its launch (ms of the runner's `forward`)."""
    n = ids.shape[0]
    starts = [*(range(0, n, chunk) if chunk > 0 else [0]), n]
    driver = side.arena.driver
    for lo, hi in itertools.pairwise(starts):
        mapped = driver.map_s
        inputs = side.inputs(ids[lo:hi])
        grow.append((driver.map_s - mapped) * 1e3)
        t0 = time.perf_counter()
        hidden = side.runner.forward(inputs)
        launch.append((time.perf_counter() - t0) * 1e3)
    return side.runner.sample(hidden, inputs)


def run(side: EdmmSide, ids: torch.Tensor, chunk: int, reps: int) -> list[str]:
    grow: list[float] = []
    meta: list[float] = []
    launch: list[float] = []
    walls = []
    build = attention_module.AttentionMetadata.build
    attention_module.AttentionMetadata.build = _timed(build, meta)  # type: ignore[method-assign]
    try:
        for _ in range(reps):
            side.truncate(0)
            for log in (grow, meta, launch):
                log.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                _extend(side, ids, chunk, grow, launch).item()
            walls.append((time.perf_counter() - t0) * 1e3)
    finally:
        attention_module.AttentionMetadata.build = build  # type: ignore[method-assign]
    lines = [f"wall median {statistics.median(walls):.1f} ms (of {reps}); last rep per pass:",
             "| pass | grow ms | meta ms | launch ms |", "|---:|---:|---:|---:|"]
    lines += [f"| {i} | {g:.2f} | {m:.2f} | {f:.2f} |"
              for i, (g, m, f) in enumerate(zip(grow, meta, launch, strict=False))]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    side = EdmmSide(ModelOpsConfig(contexts=(args.context,)), args.context)
    ids = torch.randint(0, side.cfg.vocab_size, (args.context,), device="cuda")
    with torch.inference_mode():
        side.extend(ids)  # warm-up
    for label, np_module in (("pageable", np), ("pinned", _PinnedNumpy())):
        attention_module.np = np_module  # type: ignore[assignment]
        for chunk in (0, args.chunk):
            print(f"\n## {label}, chunk {chunk}")
            print("\n".join(run(side, ids, chunk, args.reps)))
    attention_module.np = np
    side.close()


if __name__ == "__main__":
    main()
