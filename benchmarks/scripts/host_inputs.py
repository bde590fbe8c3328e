"""Host time of building a step's inputs, by token count (CPU only; no model, no device copy).

    python -m benchmarks.scripts.host_inputs [--out DIR]

Times, for one sequence of T new tokens (and a decode batch of T sequences of one token), the
two conversions every step pays before its first kernel: `AttentionMetadata.build` (the
per-token slot and index tensors) and the token ids list -> int64 tensor of
`ModelRunner.prepare`. Medians of 200 calls; writes ``<name>.{csv,json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from edmm.bench.results import ResultWriter, collect_environment
from edmm.engine.runner import int64_tensor
from edmm.model.attention import AttentionMetadata

TOKENS = (1, 8, 64, 512, 2048, 16384, 32768)
REPS = 200


def _median_us(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def measure() -> list[dict[str, object]]:
    """One row per (batch shape, token count): median microseconds of each conversion."""
    rows: list[dict[str, object]] = []
    for t in TOKENS:
        ids = list(range(1000, 1000 + t))
        for shape, meta_args in (("one sequence", ([0], [t], [t + 100])),
                                 ("decode batch", (list(range(t)), [1] * t, [4096] * t))):
            if shape == "decode batch" and t > 64:
                continue
            rows.append({
                "shape": shape, "tokens": t,
                "metadata_us": _median_us(partial(AttentionMetadata.build, *meta_args)),
                "ids_us": _median_us(partial(int64_tensor, ids, "cpu")),
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/host-inputs"))
    parser.add_argument("--name", default="host-inputs", help="file name stem")
    args = parser.parse_args()
    rows = measure()
    for r in rows:
        print(f"{r['shape']:13s} T={r['tokens']:6d} metadata {r['metadata_us']:8.1f} us "
              f"ids {r['ids_us']:8.1f} us")
    writer = ResultWriter(args.out, args.name, collect_environment("cpu"))
    writer.add_rows(rows)
    writer.write(rows, title="host time of a step's inputs (CPU)",
                 notes=[f"medians of {REPS} calls; metadata: AttentionMetadata.build to the "
                        "CPU (no device copy); ids: int64_tensor"])


if __name__ == "__main__":
    main()
