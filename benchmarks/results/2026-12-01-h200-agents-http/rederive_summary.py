"""Re-derive agents-http's client-side summary columns from its own rows (k19, after the fix
of their definition to the in-process matrix's); the rows and /metrics deltas are unchanged."""
import dataclasses
import json
import sys
from pathlib import Path

from edmm.bench.agents.http import HttpReplayConfig, _Run, client_columns, write_http_results
from edmm.bench.agents.matrix import AgentsBenchConfig
from edmm.bench.agents.policies import POLICIES
from edmm.bench.agents.trace import GeneratorConfig
from edmm.bench.results import Environment

folder = Path(sys.argv[1])
doc = json.loads((folder / "agents-http.json").read_text())
env = Environment(**{k: doc["environment"].get(k) for k in Environment.__dataclass_fields__})
meta = doc["meta"]
bench = AgentsBenchConfig(model=meta["model"], device="cuda", dtype="bfloat16", jobs=meta["jobs"],
                          seed=meta["seed"], token_scale=meta["token_scale"],
                          time_scale=meta["time_scale"], oversubscription=meta["oversub"],
                          generator=dataclasses.replace(GeneratorConfig(), turns=(3, 4)))
policies = tuple(r["policy"] for r in doc["summary"])
cfg = HttpReplayConfig(bench=bench, load=meta["load"], policies=policies, overlap_tail=1)
runs = []
for old in doc["summary"]:
    p = old["policy"]
    jobs = [r for r in doc["rows"] if r["kind"] == "job" and r["policy"] == p]
    nturns = {j["job"]: j["turns"] for j in jobs}
    turns = [dict(r, ends_in_call=r["turn"] != nturns[r["job"]] - 1) for r in doc["rows"]
             if r["kind"] == "turn" and r["policy"] == p]
    cols = client_columns(turns)
    summary = {}
    ttft = [c for c in cols if "ttft" in c]
    for k, v in old.items():
        if k == "resume_ttft_p50_ms":
            summary.update({c: cols[c] for c in ttft})
        elif k == "recomputed_tokens":  # it was the /metrics counter
            summary.update(recomputed_tokens=cols["recomputed_tokens"],
                           prefix_hit_rate=cols["prefix_hit_rate"], lost_context_tokens=v)
        elif k not in cols and k not in ("cached_share", "outputs_as_lru"):
            summary[k] = v
    run = _Run(POLICIES.create(p), cfg)
    run.turns, run.jobs, run.summary = turns, jobs, summary
    runs.append(run)
print(write_http_results(runs, cfg, env, folder))
