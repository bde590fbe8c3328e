"""What `edmm bench agents` reports: one summary row per run, sustainable loads, plots.

Files written (at most 8): ``agents.csv`` (one row per job and per turn of every run),
``agents.json`` (environment, summary, those rows, notes), ``agents.md`` (the summary table),
``agents-timeline.csv`` (KV pages in use over time, every run), ``agents-trace.jsonl`` (the
long-tool trace replayed), and three PNGs: the resume-TTFT CDF per policy, engine-wait per job
against memory oversubscription, and pages in use over time. With ``lean`` (a subset run that
`edmm.bench.agents.merge` combines with others) only ``agents.json``, ``agents.md`` and the
timeline. With ``step_log``, also ``agents-steps.csv`` (one row per engine step of every run:
where a policy's engine time goes). ``agents.json`` keeps under ``meta`` what merged runs must
share (`run_meta`).
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edmm.bench.agents.engine_io import PAGE_STATES
from edmm.bench.agents.matrix import AgentsBenchConfig, Matrix, RunRecord
from edmm.bench.agents.plots import load_label, plot_pages, plot_ttft_cdf, plot_wait_vs_oversub
from edmm.bench.agents.policies import BASELINES
from edmm.bench.agents.targets import (
    ALL_TURN_P90,
    MARGIN_NOTE,
    SUSTAIN_TTFT_MS,
    check_targets,
    knee_line,
)
from edmm.bench.agents.trace import Job, top_level, trace_digest, write_jsonl
from edmm.bench.results import Environment, ResultWriter, collect_environment
from edmm.bench.stats import mean, percentile

NAME = "agents"
GIB = float(1 << 30)


def summarize_run(rec: RunRecord, reference: dict[str, str] | None) -> dict[str, Any]:
    """The summary row of one run (``reference``: the outputs of ``lru`` in the same condition,
    for the greedy-identity column)."""
    res, cond = rec.result, rec.condition
    top = [j for j in res.jobs if not j.get("subagent")]  # subagents are part of their job
    jct = [j["jct_s"] for j in top]
    wait = [j["engine_wait_s"] for j in top]
    resumes = [t["ttft_s"] for t in res.turns if t["resume"]]
    s = res.sessions
    reused, recomputed = s.get("tokens_reused", 0), s.get("tokens_recomputed", 0)
    b, a = res.counters_before, res.counters_after
    off_b, res_b = a.offloaded_bytes - b.offloaded_bytes, a.restored_bytes - b.restored_bytes
    off_s, res_s = a.offload_s - b.offload_s, a.restore_s - b.restore_s
    pages = [p["pages_used"] for p in res.timeline]
    waits = a.memory_wait_steps - b.memory_wait_steps
    held = a.memory_wait_running_pages - b.memory_wait_running_pages
    minutes = res.makespan_s / 60
    spec_tokens = s.get("tokens_speculated", 0)
    row: dict[str, Any] = {
        "policy": cond.policy, "tools": cond.mix, "oversub": cond.oversubscription,
        "oversub_reached": round(rec.working_set_pages / rec.pages, 2), "load": cond.load,
        "jobs": len(top), "pages": rec.pages,
        "jct_mean_s": mean(jct), "jct_p50_s": percentile(jct, 50), "jct_p90_s": percentile(jct, 90),
        "wait_mean_s": mean(wait), "wait_p50_s": percentile(wait, 50),
        "wait_p90_s": percentile(wait, 90),
        "resume_ttft_p50_ms": _p(resumes, 50), "resume_ttft_p90_ms": _p(resumes, 90),
        "resume_ttft_p99_ms": _p(resumes, 99),
        **ttft_columns(res.turns),
        "jobs_per_min": len(top) / minutes if minutes > 0 else None,
        "out_tok_per_s": sum(j["output_tokens"] for j in res.jobs) / res.makespan_s
        if res.makespan_s > 0 else None,
        **prefill_columns(res.turns, spec_tokens + res.extra_prefill_tokens),
        "recomputed_tokens": recomputed,
        "prefix_hit_rate": reused / (reused + recomputed) if reused + recomputed else None,
        "spec_hit": s.get("spec_hits", 0), "spec_partial": s.get("spec_partial", 0),
        "spec_miss": s.get("spec_misses", 0), "spec_gated": s.get("spec_gated", 0),
        "spec_tokens": s.get("tokens_speculated", 0),
        "spec_only_steps_s": res.spec_only_step_s, "busy_steps_s": res.busy_step_s,
        "offloaded_MiB": off_b / (1 << 20), "restored_MiB": res_b / (1 << 20),
        "host_device_MiB": (off_b + res_b) / (1 << 20),
        "offload_GiB_s": off_b / GIB / off_s if off_s > 0 else None,
        "restore_GiB_s": res_b / GIB / res_s if res_s > 0 else None,
        "pages_used_mean": mean(pages) if pages else None,
        "pages_used_max": max(pages) if pages else None,
        **state_columns(res.timeline),
        "mem_wait_steps": waits,
        "mem_wait_running_share": held / waits / rec.pages if waits else None,
        "makespan_s": res.makespan_s,
    }
    row["outputs_digest"] = outputs_digest(res.outputs)
    if reference is not None:
        row["outputs_as_lru"] = res.outputs == reference
        row["turns_as_lru"] = sum(reference.get(k) == v for k, v in res.outputs.items()) / max(
            len(res.outputs), 1)
    return row


TURN_KINDS = ("first", "tool", "user")


def ttft_columns(turns: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """TTFT p50 / p90 / p99 in ms of every turn (``ttft_*``) and of each kind of turn
    (``first_ttft_*``, ``tool_ttft_*``: after a tool result, ``user_ttft_*``: after a user
    message); None where a run has no such turn. Rows without a kind (written before turns had
    one) count their resumes as tool resumes."""
    out: dict[str, float | None] = {}
    groups: dict[str, list[float]] = {"": [t["ttft_s"] for t in turns]}
    for kind in TURN_KINDS:
        groups[f"{kind}_"] = [t["ttft_s"] for t in turns if _kind(t) == kind]
    for prefix, xs in groups.items():
        for q in (50, 90, 99):
            out[f"{prefix}ttft_p{q}_ms"] = _p(xs, q)
    return out


def _kind(turn: dict[str, Any]) -> str:
    return str(turn.get("turn_kind") or ("tool" if turn["resume"] else "first"))


def prefill_columns(turns: Sequence[dict[str, Any]], off_path: int) -> dict[str, Any]:
    """Tokens prefilled (prompt less cached of every turn, plus ``off_path``: speculation and
    re-warm prefills), the truly new tokens (what an unbounded prefix cache could not serve,
    the turns' ``new_tokens``) and their ratio, the prefill amplification (None without
    ``new_tokens``)."""
    prefilled = sum(t["prompt_tokens"] - t["cached_tokens"] for t in turns) + off_path
    if not turns or any(t.get("new_tokens") is None for t in turns):
        return {"prefilled_tokens": prefilled, "new_tokens": None, "prefill_amp": None}
    new = sum(t["new_tokens"] for t in turns)
    return {"prefilled_tokens": prefilled, "new_tokens": new,
            "prefill_amp": prefilled / new if new else None}


def state_columns(timeline: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Means over the timeline of the pages by state (`engine_io.PAGE_STATES`) and the paused
    (on the GPU or the host) over the running (None where the samples have no states, or
    nothing ran)."""
    out: dict[str, float | None] = {}
    for name in PAGE_STATES:
        xs = [float(t[name]) for t in timeline if t.get(name) is not None]
        out[f"{name}_mean"] = mean(xs) if xs else None
    run, gpu, host = (out[f"{n}_mean"] for n in PAGE_STATES[:3])
    out["paused_to_running"] = (gpu + (host or 0.0)) / run if run and gpu is not None else None
    return out


def outputs_digest(outputs: dict[str, str]) -> str:
    """One digest of a run's greedy outputs (every turn's), comparable across runs and files:
    two runs of the same trace whose digests differ computed different tokens somewhere."""
    text = "\n".join(f"{k}={v}" for k, v in sorted(outputs.items()))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _p(xs: list[float], q: float) -> float | None:
    return percentile(xs, q) * 1e3 if xs else None


def summary_rows(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """One row per run, in run order, with the greedy-identity column against ``lru``."""
    refs = {(r.condition.mix, r.condition.oversubscription, r.condition.load): r.result.outputs
            for r in records if r.condition.policy == "lru"}
    return [summarize_run(r, refs.get((r.condition.mix, r.condition.oversubscription,
                                       r.condition.load))) for r in records]


def sustainable(rows: Sequence[dict[str, Any]], tools: str = "long",
                oversub: float | None = None) -> dict[str, float | None]:
    """Per policy: the highest load whose p90 resume TTFT is <= 1 s (None: no load does)."""
    out: dict[str, float | None] = {}
    for r in rows:
        if r["tools"] != tools or (oversub is not None and r["oversub"] != oversub):
            continue
        out.setdefault(r["policy"], None)
        p90 = r["resume_ttft_p90_ms"]
        best = out[r["policy"]]
        if p90 is not None and p90 <= SUSTAIN_TTFT_MS and (best is None or r["load"] > best):
            out[r["policy"]] = r["load"]
    return out


def best_baseline(rows: Sequence[dict[str, Any]], oversub: float) -> str | None:
    """The baseline with the highest sustainable load, then the shortest mean engine-wait at
    the highest load."""
    sus = sustainable(rows, "long", oversub)
    top = max((r["load"] for r in rows), default=None)
    waits = {r["policy"]: r["wait_mean_s"] for r in rows
             if r["load"] == top and r["tools"] == "long" and r["oversub"] == oversub}
    cands = [p for p in BASELINES if p in waits]
    if not cands:
        return None
    return max(cands, key=lambda p: (sus.get(p) or 0.0, -waits[p]))


def check_load(rows: Sequence[dict[str, Any]], oversub: float, loads: Sequence[float]) -> float:
    """The highest load ``lru`` sustains (the lowest load if none)."""
    got = sustainable(rows, "long", oversub).get("lru")
    return got if got is not None else min(loads)


# ---------------------------------------------------------------- files

def write_timeline(records: Sequence[RunRecord], path: Path) -> Path:
    """KV pages in use over time of every run (one row per sample)."""
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["policy", "tools", "oversub", "load", "t_s", "pages_used", "pages_total",
                    "offloaded_bytes_held", "sessions", *PAGE_STATES])
        for r in records:
            c = r.condition
            for s in r.result.timeline:
                w.writerow([c.policy, c.mix, c.oversubscription, c.load, f"{s['t_s']:.4f}",
                            s["pages_used"], r.pages, s["offloaded_bytes_held"], s["sessions"],
                            *(s.get(k, "") for k in PAGE_STATES)])
    return path


def write_steps(records: Sequence[RunRecord], path: Path) -> Path:
    """One row per engine step of every run (`ReplayConfig.step_log`)."""
    fields = ["policy", "tools", "oversub", "load", *next(
        (list(r.result.steps[0]) for r in records if r.result.steps), [])]
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in records:
            c = r.condition
            for step in r.result.steps:
                w.writerow({"policy": c.policy, "tools": c.mix, "oversub": c.oversubscription,
                            "load": c.load, **step})
    return path


def detail_rows(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """One row per job and per turn of every run."""
    out = []
    for r in records:
        c = r.condition
        key = {"policy": c.policy, "tools": c.mix, "oversub": c.oversubscription, "load": c.load}
        out += [{**key, "kind": "job", **j} for j in r.result.jobs]
        out += [{**key, "kind": "turn", **t} for t in r.result.turns]
    return out


def plot_all(records: Sequence[RunRecord], rows: Sequence[dict[str, Any]],
             cfg: AgentsBenchConfig, out: Path, device: str) -> list[Path]:
    """The three PNGs (nothing without matplotlib)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return []
    top = max(cfg.loads)
    main = [r for r in records if r.condition.mix == cfg.mix
            and r.condition.oversubscription == cfg.oversubscription and r.condition.load == top]
    series = {r.condition.policy: [t["ttft_s"] * 1e3 for t in r.result.turns if t["resume"]]
              for r in main}
    title = (f"Resume TTFT per policy ({device}, {load_label(top, cfg.mode)}, "
             f"{cfg.oversubscription:g}x KV oversubscription)")
    paths = [plot_ttft_cdf(Figure, series, out / "agents-resume-ttft-cdf.png", title),
             _plot_pages(Figure, main, out / "agents-pages.png", device, cfg, top)]
    jct = plot_wait_vs_oversub(Figure, rows, out / "agents-wait-vs-oversub.png", device,
                               cfg.mode)
    return paths + ([jct] if jct is not None else [])


def _plot_pages(figure: Any, recs: Sequence[RunRecord], path: Path, device: str,
                cfg: AgentsBenchConfig, load: float) -> Path:
    series = {r.condition.policy: ([s["t_s"] for s in r.result.timeline],
                                   [s["pages_used"] for s in r.result.timeline]) for r in recs}
    return plot_pages(figure, series, recs[0].pages if recs else 0, path,
                      f"KV pages in use ({device}, {load_label(load, cfg.mode)}, "
                      f"{cfg.oversubscription:g}x KV oversubscription)")


def run_agents_bench(cfg: AgentsBenchConfig, out_dir: Path,
                     log: Any = print) -> dict[str, Path]:
    """Run the matrix (main, then checks) and write every file; return their paths. The tables
    are rewritten after every run, and the plots drawn however the matrix ends, so an
    interrupted matrix leaves what it measured."""
    matrix = Matrix(cfg, log=log)
    env = collect_environment(cfg.device)

    def write(_: object = None) -> dict[str, Path]:
        return write_results(matrix, cfg, env, out_dir)

    paths: dict[str, Path] = {}
    try:
        main = matrix.run(matrix.plan_main(), on_record=write)
        if cfg.checks and cfg.mix == "long":
            rows = summary_rows(main)
            load = check_load(rows, cfg.oversubscription, cfg.loads)
            matrix.run(matrix.plan_checks(best_baseline(rows, cfg.oversubscription), load),
                       on_record=write)
    finally:  # interrupted too (e.g. SIGTERM from a time limit): keep what was measured
        matrix.close()
        if matrix.records:
            paths = write()
            rows = summary_rows(matrix.records)
        if matrix.records and not cfg.lean:
            for p in plot_all(matrix.records, rows, cfg, out_dir, env.gpu_name or env.device):
                paths[p.stem] = p
    return paths


def write_results(matrix: Matrix, cfg: AgentsBenchConfig, env: Environment,
                  out_dir: Path) -> dict[str, Path]:
    """The tables, the timeline and the trace of the runs so far."""
    rows = summary_rows(matrix.records)
    writer = ResultWriter(out_dir, NAME, env)
    writer.add_rows(detail_rows(matrix.records))
    checks = check_targets(rows, cfg.oversubscription, cfg.check_oversubscription)
    notes = [knee_line(rows, cfg.oversubscription, ALL_TURN_P90),
             knee_line(rows, cfg.oversubscription), *(c.line() for c in checks), MARGIN_NOTE,
             *_method_notes(cfg)]
    paths = writer.write(rows, "Agent workloads: policies on one trace", notes,
                         meta=run_meta(cfg, matrix.mixes["long"]))
    paths["timeline"] = write_timeline(matrix.records, out_dir / f"{NAME}-timeline.csv")
    if cfg.step_log:
        paths["steps"] = write_steps(matrix.records, out_dir / f"{NAME}-steps.csv")
    if cfg.lean:  # the merge step writes the rest
        paths.pop("csv").unlink()
    else:
        paths["trace"] = write_jsonl(matrix.mixes["long"], out_dir / f"{NAME}-trace.jsonl")
    return paths


def run_meta(cfg: AgentsBenchConfig, jobs: Sequence[Job]) -> dict[str, Any]:
    """What runs merged into one report must share (`edmm.bench.agents.merge`)."""
    return {"trace_sha256": trace_digest(jobs), "seed": cfg.seed, "jobs": len(top_level(jobs)),
            "token_scale": cfg.token_scale, "time_scale": cfg.time_scale, "mode": cfg.mode,
            "model": cfg.model, "device": cfg.device, "dtype": cfg.dtype, "clock": cfg.clock,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "graph_sizes": list(cfg.cuda_graph_token_sizes or ()),
            "oversub": cfg.oversubscription, "check_oversub": cfg.check_oversubscription,
            "call_tokens": cfg.call_tokens}


_CLOCK_NOTES = {
    "virtual": "idle time skipped, every step timed for real",
    "wall": "tools slept through",
    "model": "idle time skipped, every step charged the {model} step-time model's seconds, "
             "not measured: how the policies behave at those speeds, not a result of them"}


def _method_notes(cfg: AgentsBenchConfig) -> list[str]:
    return [
        f"trace: {cfg.trace or f'generated, {cfg.jobs} jobs, seed {cfg.seed}'}; tokens x"
        f"{cfg.token_scale:g}, tool times x{cfg.time_scale:g}; {cfg.mode} loop, load = "
        + ("concurrent sessions" if cfg.mode == "closed" else "jobs per second")
        + (f"; call turns decode {cfg.call_tokens} tokens, the rest of their output joins the "
           "tool result (--call-tokens: the HTTP replay's forced calls)"
           if cfg.call_tokens else ""),
        f"clock: {cfg.clock} (" + _CLOCK_NOTES[cfg.clock].format(model=cfg.step_model) + ")",
        "engine-wait = JCT minus the time the job waited on tools, users and subagents' tools "
        "(JCT, engine-wait and jobs/min of top-level jobs; a subagent is part of its job); "
        "TTFT from each request to its first token: ttft_* every turn, first_ttft_* first turns "
        "(subagents' too), tool_ttft_* after a tool result, user_ttft_* after a user message, "
        "resume_ttft_* every turn but first ones; prefix hit rate = reused / (reused + "
        "recomputed) prompt tokens of resumes",
        "prefill_amp = prefilled_tokens / new_tokens: prompt less cached tokens of every turn, "
        "plus speculative and re-warm prefills, over the tokens an unbounded prefix cache "
        "could not serve (the session's context before a turn up to its first changed token; "
        "an agent type's shared prefix once a session of it started); recomputation after a "
        "preemption is not counted; host_device_MiB: offloaded + restored",
        "pages by state (timeline, and their means): running_pages mapped by running or "
        "waiting requests, paused_gpu_pages held by prefix-cache entries (paused sessions, "
        "shared prefixes), host_pages the host copies (bytes over the page size), free_pages; "
        "paused_to_running = (paused_gpu + host) / running, means over the run",
        "spec_only_steps_s: engine time of steps that ran speculation alone (speculation riding "
        "along in busy steps is in busy_steps_s); offload/restore GiB/s: bytes over the copies' "
        "own time (CUDA: side-stream copies timed by events; CPU: synchronous)",
        "oversub_reached: working set / pool pages (a pool never holds less than one longest "
        "sequence); outputs_as_lru: greedy tokens of every turn identical to lru's; "
        "turns_as_lru: the share of turns that are; outputs_digest: one hash of all of a run's "
        "outputs (equal digests across runs or files: the same tokens)",
        "mem_wait_steps: engine steps in which a waiting turn could not be admitted for lack "
        "of KV memory; mem_wait_running_share: the pool's share mapped by running turns in "
        "those steps, averaged (near 1: memory is full of turns being computed, with no paused "
        "session's KV left to offload or evict)",
    ]
