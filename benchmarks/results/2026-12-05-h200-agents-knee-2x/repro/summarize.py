"""Tables of this folder's runs (run from this folder): the 128-job knee sweep with its repeat,
the 1x runs, the open loop, the short-tool mix (H200 and modelled) and its resume TTFT by
turn. Prints Markdown."""
import json
import statistics

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
table("2x, short-tool mix, 32 sessions, 64-job trace (short: H200, call 7)", rows("short"),
      "sessions")
table("the same on the modelled H200 clock, CPU (modelled-cpu-short/a, b)",
      rows("modelled-cpu-short/a") + rows("modelled-cpu-short/b"), "sessions")

print("\nResume TTFT (ms) by turn, short-tool mix on the H200 (short)\n")
print("| policy | resumed turn | resumes | p50 | mean |")
print("|---|---:|---:|---:|---:|")
with open("short/agents.json") as f:
    turns = [r for r in json.load(f)["rows"] if r["kind"] == "turn" and r.get("resume")]
for policy in sorted({r["policy"] for r in turns}):
    for turn in sorted({r["turn"] for r in turns}):
        ms = [r["ttft_s"] * 1e3 for r in turns if r["policy"] == policy and r["turn"] == turn]
        print(f"| {policy} | {turn} | {len(ms)} | {statistics.median(ms):.0f} | "
              f"{statistics.mean(ms):.0f} |")
    ms = [r["ttft_s"] * 1e3 for r in turns if r["policy"] == policy]
    print(f"| {policy} | all | {len(ms)} | {statistics.median(ms):.0f} | "
          f"{statistics.mean(ms):.0f} |")
