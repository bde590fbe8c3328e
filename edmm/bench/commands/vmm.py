"""``edmm bench vmm``: its options, and the run (`edmm.bench.vmm` measures)."""

from __future__ import annotations

import argparse
from pathlib import Path

from edmm.argparsing import int_at_least, int_list
from edmm.bench.commands.common import OUT_HELP, default_out_dir, device_tag, print_report

NAME = "vmm"
HELP = "VMM page costs: remap, branch, commit, copy baseline"
DESCRIPTION = ("Time the KV arena's memory operations (CUDA VMM if usable, else the host twin) "
               "and write CSV/JSON/Markdown and a plot.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``edmm bench vmm``."""
    parser.add_argument("--backend", choices=("auto", "cuda", "host"), default="auto",
                        help="VMM backend (auto: CUDA if usable, else the host twin)")
    parser.add_argument("--contexts", type=int_list, default=(4096, 16384, 32768),
                        help="prefix lengths in tokens (comma-separated)")
    parser.add_argument("--repeats", type=int_at_least(1), default=20,
                        help="timed repetitions per measurement")
    parser.add_argument("--pages", type=int_at_least(1), default=64,
                        help="pages per batch of the per-page measurements")
    parser.add_argument("--host-page-size", type=int_at_least(4096), default=2 * 1024 * 1024,
                        help="page size of the host twin in bytes (a multiple of 4096)")
    parser.add_argument("--out", type=Path, default=None, help=OUT_HELP)


def run(args: argparse.Namespace) -> int:
    """Measure on the chosen backend, print the report and the files written."""
    from edmm.bench.vmm import VMMBenchConfig, run_vmm_bench

    if args.host_page_size % 4096:
        args.parser.error(f"--host-page-size must be a multiple of 4096, "
                          f"got {args.host_page_size}")
    cfg = VMMBenchConfig(backend=args.backend, contexts=args.contexts, repeats=args.repeats,
                         pages=args.pages, host_page_size=args.host_page_size)
    paths = run_vmm_bench(cfg, args.out or default_out_dir(device_tag(args.backend != "host")))
    print_report(paths)
    if "png" not in paths:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
    return 0
