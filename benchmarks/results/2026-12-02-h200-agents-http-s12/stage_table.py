"""Each stage span of an `EDMM_STAGE_LOG` file as Markdown tables (`edmm.bench.agents.http.
stage_summary`, what `bench agents --http --http-stages` writes): every request, and those with
no grammar (the content turns). From the repository root:

    PYTHONPATH=. python benchmarks/results/2026-12-02-h200-agents-http-s12/stage_table.py FILE
"""
import json
import sys
from pathlib import Path

from edmm.bench.agents.http import stage_summary

HEAD = "| span | n | p50 ms | p90 ms | max ms |\n|---|---:|---:|---:|---:|"

recs = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines()]
groups = {"every request": recs,
          "no grammar (the last, content turns)": [r for r in recs if "back" not in r["marks"]]}
for label, rs in groups.items():
    print(f"\n{label}: {len(rs)} requests\n\n{HEAD}")
    for row in stage_summary("", rs):
        print(f"| {row['span']} | {row['n']} | {row['p50']:.2f} | {row['p90']:.2f} "
              f"| {row['max']:.1f} |")
