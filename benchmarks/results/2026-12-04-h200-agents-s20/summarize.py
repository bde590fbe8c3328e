"""Tables of this folder's runs (run from this folder): the 2x repeats' means per policy, the
knee sweep, the open loop, and the VMM map and unmap rows."""
import json
import statistics

COLS = ("wait_mean_s", "wait_p90_s", "jct_mean_s", "resume_ttft_p50_ms", "resume_ttft_p90_ms",
        "resume_ttft_p99_ms", "busy_steps_s", "recomputed_tokens", "spec_hit", "spec_miss",
        "offloaded_MiB", "restored_MiB")


def rows(folder: str) -> list[dict]:
    with open(f"{folder}/agents.json") as f:
        return json.load(f)["summary"]


def table(title: str, groups: dict[tuple, list[dict]], key_names: tuple[str, ...]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(key_names) + " | runs | " + " | ".join(COLS) + " |")
    print("|" + "---|" * len(key_names) + "---:|" + "---:|" * len(COLS))
    for key, group in groups.items():
        cells = [f"{statistics.mean(r[c] or 0 for r in group):.4g}" for c in COLS]
        print("| " + " | ".join(str(k) for k in key) + f" | {len(group)} | " + " | ".join(cells)
              + " |")


repeats: dict[tuple, list[dict]] = {}
for folder in ("x2a", "x2b"):
    for r in rows(folder):
        repeats.setdefault((r["policy"],), []).append(r)
table("2x, 24 sessions (x2a, x2b): means", repeats, ("policy",))
knee = {(r["policy"], f"{r['load']:g}"): [r] for r in rows("knee")}
table("2x knee sweep (knee)", knee, ("policy", "sessions"))
opened = {(r["policy"], f"{r['load']:g}"): [r] for r in rows("open4")}
table("open loop, pool for 16 sessions at 2x: 547 pages (open4)", opened, ("policy", "jobs/s"))
bad = {(r["policy"], f"{r['load']:g}"): [r] for r in
       rows("open-undersized-pool/open2") + rows("open-undersized-pool/open3")}
table("open loop before c4a8939: a 99-page pool, one longest sequence (open-undersized-pool)",
      bad, ("policy", "jobs/s"))
with open("vmm/vmm-cuda.json") as f:
    vmm = json.load(f)["summary"]
print("\nVMM per page (vmm)\n")
for r in vmm:
    if "unmap" in r["op"] or r["op"].startswith("map"):
        print(f"- {r['op']}: median {r['median_us']:.2f} us (p10 {r['p10_us']:.2f}, "
              f"p90 {r['p90_us']:.2f}, n {r['n']})")
