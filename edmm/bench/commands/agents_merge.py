"""``edmm bench agents-merge``: its options, and the run (`edmm.bench.agents.merge` merges)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edmm.argparsing import float_at_least
from edmm.bench.commands.common import print_report

NAME = "agents-merge"
HELP = "one report from several `edmm bench agents` folders (subset runs)"
DESCRIPTION = (
    "Merge the folders of `edmm bench agents` subset runs (same trace, seed, settings and "
    "source tree) into one report: tables, knees, the targets with PASS/MISS and the margin, "
    "plots. A folder may hold restore-overlap.json instead.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``edmm bench agents-merge``."""
    add = parser.add_argument
    add("folders", type=Path, nargs="+", help="folders to merge")
    add("--out", type=Path, required=True, help="folder of the merged report")
    add("--oversub", type=float_at_least(1.0), default=None,
        help="main oversubscription (default: the first run's)")
    add("--check-oversub", type=float_at_least(1.0), default=None,
        help="check oversubscription (default: the first run's)")
    add("--mixed-trees", action="store_true",
        help="accept folders measured on different source trees (each one's tree is noted in "
             "the report; say in its README what differs)")


def run(args: argparse.Namespace) -> int:
    """Merge; folders that cannot be merged are one line on stderr and exit status 2."""
    from edmm.bench.agents.merge import MergeError, merge

    try:
        paths = merge(args.folders, args.out, args.oversub, args.check_oversub,
                      args.mixed_trees)
    except (MergeError, OSError, ValueError, KeyError) as e:  # ValueError: bad JSON
        print(f"edmm bench agents-merge: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print_report(paths)
    return 0
