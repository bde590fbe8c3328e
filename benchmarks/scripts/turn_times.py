"""Where a fleet's turns spend their time after the first token: per server of an
``edmm bench agents --http`` run, each turn's generation (streamed end minus first token) and
its completion tokens, from the run's per-turn CSV.

    python -m benchmarks.scripts.turn_times RUN/agents-http.csv [--out FILE.md]

Per server and turn kind (a turn that ends in a tool call, or in text): turns, mean TTFT,
mean generation seconds, mean completion tokens, and generation milliseconds per completion
token (after the first) at the median and p90 of the turns. A server that computes part of
the output with the prompt (EDMM's grammar fast-forward of a forced call's wrapper and name)
counts those tokens as completion tokens without a decode step each, so its per-token time
understates its time per decode step.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from edmm.bench.stats import percentile

COLUMNS = ("server", "turn ends in", "turns", "TTFT mean (ms)", "generation mean (s)",
           "completion tokens mean", "ms / token p50", "ms / token p90")


def turn_rows(path: Path) -> list[dict[str, object]]:
    """One row per server and turn kind of the run's CSV (its rows of kind ``turn``)."""
    groups: dict[tuple[str, str], list[dict[str, str]]] = {}
    with path.open(newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            if r["kind"] == "turn":
                kind = "a tool call" if r["ends_in_call"] == "True" else "text"
                groups.setdefault((r["policy"], kind), []).append(r)
    out: list[dict[str, object]] = []
    for (server, kind), turns in sorted(groups.items()):
        gen = [float(t["total_s"]) - float(t["ttft_s"]) for t in turns]
        tokens = [int(t["completion_tokens"]) for t in turns]
        per_token = [g / (n - 1) * 1e3 for g, n in zip(gen, tokens, strict=True) if n > 1]
        out.append(dict(zip(COLUMNS, (
            server, kind, len(turns),
            round(statistics.fmean(float(t["ttft_s"]) for t in turns) * 1e3, 1),
            round(statistics.fmean(gen), 3), round(statistics.fmean(tokens), 1),
            round(percentile(per_token, 50), 2) if per_token else None,
            round(percentile(per_token, 90), 2) if per_token else None), strict=True)))
    return out


def to_markdown(rows: list[dict[str, object]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join("" if r[c] is None else str(r[c]) for c in COLUMNS) + " |"
              for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", type=Path, help="an agents-http.csv of edmm bench agents --http")
    p.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = p.parse_args(argv)
    if not args.csv.is_file():
        p.error(f"csv: no file {args.csv}")
    text = to_markdown(turn_rows(args.csv))
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
