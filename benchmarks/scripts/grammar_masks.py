"""Host time of one step's grammar masks: rows of forced tool calls (a free string argument,
unbounded or ``--string-bound`` characters) masked row by row (edmm serve's `GrammarMasks`) and
through llguidance's thread pool (``fill_next_token_bitmask_par``: the alternative, measured
slower on the device's CPUs), at several batch sizes, on a tokenizer folder.

    python -m benchmarks.scripts.grammar_masks --tokenizer /tmp/qwen25-7b-dummy [--out FILE.md]

Each step fills every row's mask (the matchers fed one allowed token per row, the same
choices both ways), unpacked on the host; the table gives the median and p90 milliseconds
per step over ``--steps`` steps, and the pool's threads (llguidance's default: 80% of the
CPUs, at most 32). Under async scheduling this work overlaps the device's step; it adds
to the step where it is longer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import llguidance
import numpy as np
import torch
from llguidance.numpy import fill_next_token_bitmask_par
from transformers import AutoTokenizer

from edmm.bench.results import markdown_table
from edmm.bench.stats import percentile
from edmm.server.guided import GrammarMasks, GuidedDecoding, unpack_bitmask_host
from edmm.server.protocol import FunctionDefinition

COLUMNS = ("rows", "fill", "threads", "ms / step p50", "ms / step p90")
TOOL = FunctionDefinition(name="run_tests", parameters={
    "type": "object", "required": ["digits"], "properties": {"digits": {"type": "string"}}})


def step_times(guided: GuidedDecoding, rows: int, steps: int,
               executor: llguidance.LLExecutor | None, seed: int = 0) -> list[float]:
    """Seconds of each step's mask fill for ``rows`` forced calls (``executor`` None: row by
    row)."""
    procs = [guided.tool_calls([TOOL], False) for _ in range(rows)]
    outs = [list(p.forced) for p in procs]
    vocab = guided.spec.vocab_size
    masks = GrammarMasks(vocab)
    bits = torch.zeros((rows, -(-vocab // 32)), dtype=torch.int32)  # [rows, words]
    rng = np.random.default_rng(seed)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if executor is None:
            masks.fill(procs, outs, bits)
        else:
            for row, (proc, out) in enumerate(zip(procs, outs, strict=True)):
                proc.feed(out, bits[row].numpy())
            fill_next_token_bitmask_par(executor, [(p.matcher, row) for row, p in enumerate(procs)],
                                        bits.numpy())
        times.append(time.perf_counter() - t0)
        allowed = unpack_bitmask_host(bits, vocab)  # [rows, vocab]
        for row, out in enumerate(outs):
            out.append(int(rng.choice(allowed[row].nonzero().flatten().numpy())))
    return times


def table(guided: GuidedDecoding, batch_sizes: Sequence[int], steps: int,
          threads: int | None) -> list[dict[str, object]]:
    """One row per batch size and way of filling."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    pool = threads or min(32, max(1, int(0.8 * (cpus or 1))))
    out: list[dict[str, object]] = []
    for rows in batch_sizes:
        for fill, executor, n in (("row by row", None, 1),
                                  ("parallel", llguidance.LLExecutor(pool), pool)):
            ms = [t * 1e3 for t in step_times(guided, rows, steps, executor)]
            out.append(dict(zip(COLUMNS, (rows, fill, n, round(percentile(ms, 50), 2),
                                          round(percentile(ms, 90), 2)), strict=True)))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer folder")
    p.add_argument("--rows", default="8,32,64", help="batch sizes, comma-separated")
    p.add_argument("--steps", type=int, default=30, help="steps per measurement")
    p.add_argument("--threads", type=int, default=None,
                   help="the pool's threads (default: llguidance's)")
    p.add_argument("--string-bound", type=int, default=None,
                   help="bound the free string to this many characters (edmm serve's "
                        "max_forced_string_chars; default: unbounded, its default)")
    p.add_argument("--out", type=Path, help="also write the table here (markdown)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not args.tokenizer.is_dir():
        p.error(f"--tokenizer: no folder {args.tokenizer}")
    try:
        sizes = [int(x) for x in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows: not comma-separated integers: {args.rows!r}")
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    if args.string_bound is not None and args.string_bound < 1:
        p.error(f"--string-bound: at least 1, not {args.string_bound}")
    guided = GuidedDecoding(tok, len(tok), tok.eos_token_id or 0,
                            forced_string_chars=args.string_bound)
    text = markdown_table(table(guided, sizes, args.steps, args.threads)) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
