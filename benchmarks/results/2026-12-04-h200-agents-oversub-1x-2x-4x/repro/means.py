"""Means over this folder's runs, per condition and policy (run from this folder)."""
import glob
import json
import statistics

METRICS = ("wait_mean_s", "wait_p90_s", "jct_mean_s", "resume_ttft_p50_ms", "resume_ttft_p90_ms",
           "resume_ttft_p99_ms", "busy_steps_s", "recomputed_tokens", "spec_hit", "spec_miss",
           "offloaded_MiB", "restore_GiB_s")
groups: dict[tuple[str, float, str], list[dict]] = {}
for path in sorted(glob.glob("*/*.json")):
    if "restore-overlap" in path or "profile" in path:
        continue
    with open(path) as f:
        summary = json.load(f)["summary"]
    for row in summary:
        key = (path.split("/")[0], row["oversub"], row["policy"])
        if "nopad" in path:
            key = (key[0], key[1], key[2] + " (no padding spec.)")
        groups.setdefault(key, []).append(row)
print("| tree | oversub | policy | runs | " + " | ".join(METRICS) + " |")
print("|---|---:|---|---:|" + "---:|" * len(METRICS))
for (tree, oversub, policy), rows in sorted(groups.items()):
    cells = [f"{statistics.mean(r.get(m) or 0 for r in rows):.4g}" for m in METRICS]
    print(f"| {tree} | {oversub:g}x | {policy} | {len(rows)} | " + " | ".join(cells) + " |")
