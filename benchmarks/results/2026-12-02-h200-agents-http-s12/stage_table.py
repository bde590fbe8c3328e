"""Median / p90 of each stage span of an `EDMM_STAGE_LOG` file (every request, and those with
no grammar: the content turns), as Markdown tables; where the records have the scheduler's
``scheduled`` mark (tree 2026-12-02 and later), ``step_start->output_put`` is also split
there, and the requests' ``memory_wait_steps`` are summed up. From the repository root:

    PYTHONPATH=. python benchmarks/results/2026-12-02-h200-agents-http-s12/stage_table.py FILE
"""
import itertools
import json
import sys
from pathlib import Path

from edmm.bench.stats import percentile
from edmm.server.stages import STAGES

HEAD = "| span | n | p50 ms | p90 ms | max ms |\n|---|---:|---:|---:|---:|"


def spans(records: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in records:
        m = r["marks"]
        present = [s for s in STAGES if s in m]
        for a, b in itertools.pairwise(present):
            out.setdefault(f"{a}->{b}", []).append((m[b] - m[a]) / 1e6)
        out.setdefault("total", []).append((m[present[-1]] - m[present[0]]) / 1e6)
        if "scheduled" in m:
            for a, b in (("step_start", "scheduled"), ("scheduled", "output_put")):
                out.setdefault(f"({a}->{b})", []).append((m[b] - m[a]) / 1e6)
            waits = r.get("counts", {}).get("memory_wait_steps", 0)
            out.setdefault("(memory_wait_steps, count)", []).append(waits)
    return out


recs = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines()]
groups = {"every request": recs,
          "no grammar (the last, content turns)": [r for r in recs if "back" not in r["marks"]]}
for label, rs in groups.items():
    print(f"\n{label}: {len(rs)} requests\n\n{HEAD}")
    for k, v in spans(rs).items():
        p50, p90 = percentile(v, 50), percentile(v, 90)
        print(f"| {k} | {len(v)} | {p50:.2f} | {p90:.2f} | {max(v):.1f} |")
