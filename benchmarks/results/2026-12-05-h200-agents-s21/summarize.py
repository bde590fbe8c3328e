"""Tables of this folder's runs (run from this folder): the 128-job knee sweep with its repeat,
the 1x runs, and the open loop. Prints Markdown."""
import json

COLS = ("wait_mean_s", "resume_ttft_p50_ms", "resume_ttft_p90_ms", "resume_ttft_p99_ms",
        "busy_steps_s", "makespan_s", "recomputed_tokens", "spec_hit", "spec_miss", "spec_gated",
        "offloaded_MiB", "restore_GiB_s", "mem_wait_steps", "mem_wait_running_share",
        "outputs_digest")


def rows(folder: str) -> list[dict]:
    with open(f"{folder}/agents.json") as f:
        return [dict(r, source=folder) for r in json.load(f)["summary"]]


def cell(value: object) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def table(title: str, runs: list[dict], load: str) -> None:
    print(f"\n{title}\n")
    print(f"| policy | {load} | folder | " + " | ".join(COLS) + " |")
    print("|---|---:|---|" + "---:|" * len(COLS))
    for r in sorted(runs, key=lambda r: (r["policy"], r["load"], r["source"])):
        print(f"| {r['policy']} | {r['load']:g} | {r['source']} | "
              + " | ".join(cell(r.get(c)) for c in COLS) + " |")


table("2x, 128-job trace, closed loop (knee128, knee128-48, knee128-lru; repeat: knee128-rep)",
      rows("knee128") + rows("knee128-48") + rows("knee128-lru") + rows("knee128-rep"),
      "sessions")
table("1x, 64-job trace, 32 sessions (x1-a: lru, edmm; x1-b: lru again)",
      rows("x1-a") + rows("x1-b"), "sessions")
table("2x, 64-job trace, open loop, pool for 16 sessions (open, open567)",
      rows("open") + rows("open567"), "jobs/s")
