"""The ``edmm bench`` commands, one module each: ``NAME``, ``HELP``, ``DESCRIPTION``,
``add_arguments(parser)`` (its options) and ``run(args) -> int`` (measure, write, print).

The modules import only argument parsing; ``run`` imports torch and the measurement modules, so
building the command line stays quick. `add_bench_parsers` registers them in this order.
"""

from __future__ import annotations

import argparse
from types import ModuleType

from edmm.bench.commands import agents, agents_merge, live, load, single, ttft, vmm

BENCHES: tuple[ModuleType, ...] = (vmm, ttft, live, single, load, agents, agents_merge)


def add_bench_parsers(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """One parser per bench under ``subparsers``; a parsed namespace carries the bench's ``run``
    and its ``parser`` (for usage errors that name the bench)."""
    for bench in BENCHES:
        parser = subparsers.add_parser(bench.NAME, help=bench.HELP,
                                       description=bench.DESCRIPTION)
        bench.add_arguments(parser)
        parser.set_defaults(run=bench.run, parser=parser)
