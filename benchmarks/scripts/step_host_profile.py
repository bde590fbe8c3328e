"""cProfile of the host side of a graph-replayed 512-token prefill on a 16K prefix (H200).

    python -m benchmarks.scripts.step_host_profile > step-host.txt

Forty steps of `edmm bench ttft`'s "prefill on cached prefix" (qwen2.5-7b preset): truncate to
the prefix, map the new tokens' pages and build the inputs, replay the graph, sample, wait.
Prints the functions by own time and by cumulative time; the wait is ``item``.
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from edmm.bench.model_ops import EdmmSide, ModelOpsConfig

CONTEXT, NEW = 16384, 512


def main() -> None:
    side = EdmmSide(ModelOpsConfig(contexts=(CONTEXT,), new_tokens=NEW), CONTEXT)
    ids = torch.randint(0, side.cfg.vocab_size, (CONTEXT,), device="cuda")
    runner = side.runner

    def step() -> None:
        side.truncate(CONTEXT - NEW)
        torch.cuda.synchronize()
        inputs = side.inputs(ids[CONTEXT - NEW:])
        hidden = runner.forward(inputs)
        runner.sample(hidden, inputs).item()

    with torch.inference_mode():
        side.extend(ids)
        for _ in range(5):
            step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(40):
            step()
        prof.disable()
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    side.close()


if __name__ == "__main__":
    main()
