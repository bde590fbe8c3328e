"""The forced call's length an HTTP fleet run measured, for the in-process run of the same
work (device call 18's ``--call-tokens``).

    python3 -m benchmarks.scripts.call_tokens FOLDER [FOLDER ...]

Prints the ``call_tokens`` of the newest ``agents-http.json`` under the folders (its EDMM rows
first, else any row with one), or nothing when no run is there.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path


def call_tokens(folders: Sequence[Path]) -> int | None:
    """``call_tokens`` of the newest HTTP fleet result under ``folders`` (None: none)."""
    found = [p for f in folders if f.is_dir() for p in f.rglob("agents-http.json")]
    for path in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True):
        rows = json.loads(path.read_text()).get("summary", [])
        ranked = sorted(rows, key=lambda r: r.get("server") != "edmm serve")
        for row in ranked:
            if row.get("call_tokens"):
                return int(row["call_tokens"])
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="where HTTP fleet results lie")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    n = call_tokens(build_parser().parse_args(argv).folders)
    if n is not None:
        print(n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
