"""One-off measurement scripts (profiles, A/B checks, the vLLM comparisons) that wrote files of
``benchmarks/results``; run each with ``python -m benchmarks.scripts.NAME --help``."""

from __future__ import annotations

import argparse
from pathlib import Path


def live_script_parser(runs: int) -> argparse.ArgumentParser:
    """The options the live path's host-side probes share: a tokenizer folder, the contexts,
    the runs per measurement and the output folder."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True, type=Path,
                        help="tokenizer folder with a chat template (e.g. edmm tokenizer "
                             "build-qwen DIR)")
    parser.add_argument("--contexts", default="16384,31744")
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--out", type=Path, default=Path("."))
    return parser
