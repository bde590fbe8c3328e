"""What a trace looks like beside the published agent-trace statistics it should reproduce.

`trace_statistics` measures a trace (generated, imported or read back) and returns one
`Statistic` per published figure (`TARGETS`: TraceLab's Claude Code and Codex sessions, Codex
on SWE-bench Pro, Claude Code request captures), with the target beside the trace's value;
`stats_table` renders them as Markdown (statistic, published, this trace, and the trace as
replayed when it is scaled).

The idle / active figure is TraceLab's KV active ratio read the other way: the waits (tool
calls, subagents, users) of at most ``horizon_s`` each, over the time the model generates
(each turn timed on an idealised engine: `edmm.bench.agents.fleet.IDEAL_DECODE_S` per output
token, `IDEAL_PREFILL_TOKENS_S` for the new prompt tokens). A cache that keeps a paused
session's KV for ``horizon_s`` holds idle KV that much longer than active KV, session for
session.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from edmm.bench.agents.fleet import SUBAGENT_TOOL, ideal_seconds
from edmm.bench.agents.trace import Job, top_level, turn_shapes
from edmm.bench.stats import percentile

HORIZON_S = 300.0
LONG_CALL_S = (60.0, 600.0)  # "calls of 1-10 minutes"

# Published figures: statistic -> (target as text, the number a test holds a trace to or None).
TARGETS: dict[str, tuple[str, float | None]] = {
    "sessions (top-level / subagents)": ("4,265 sessions (TraceLab)", None),
    "shared prefix per agent type (system + tool schemas)": ("6-25K; subagents ~13K", None),
    "first request, largest agent type, median": ("~25K (~15K tools + ~6K system)", 25_000),
    "model calls per session, median [min-max]": ("~33 [20-60]", 33),
    "context at call 30, median": ("~80K", 80_000),
    "input : output tokens": ("~100 : 1", 100),
    "tool latency median, claude-code": ("~0.13 s", 0.13),
    "tool latency median, codex": ("~0.6 s", 0.6),
    "share of tool time in calls of 1-10 min": ("~50%", 0.5),
    "sessions compacting at least once": ("~10%", 0.10),
    "compactions mid tool loop": ("most", None),
    "prefix hit rate, unbounded retention": ("94-99%", 0.965),
    "idle / active KV time, 5-min horizon": ("~1.9x", 1.9),
    "user messages per session, mean": ("-", None),
    "reasoning dropped at user messages (tokens)": ("-", None),
    "largest context": ("the model's limit", None),
}


@dataclass(frozen=True)
class Statistic:
    """One statistic of a trace: its name, the published target (text, and the number tests
    compare against where there is one) and the trace's value (text, number)."""

    name: str
    target: str
    goal: float | None
    value: str
    number: float | None


def trace_statistics(jobs: Sequence[Job], time_scale: float = 1.0) -> list[Statistic]:
    """Every statistic of `TARGETS` that ``jobs`` can speak to (rows for statistics the trace
    has nothing for, e.g. a codex median in a trace without codex sessions, read "-").
    ``time_scale``: the trace's times were scaled by it (the 1-10 minute calls and the 5-minute
    horizon are scaled alike; the idealised engine's speeds are not)."""
    values = _measure(jobs, time_scale)
    return [Statistic(name, target, goal, *values.get(name, ("-", None)))
            for name, (target, goal) in TARGETS.items()]


def stats_table(stats: Sequence[Statistic],
                replayed: Sequence[Statistic] | None = None, scales: str = "") -> str:
    """The Markdown table: statistic, published, this trace (and the trace as replayed, with
    ``scales`` naming them, when ``replayed`` is given)."""
    head = "| statistic | published | this trace |"
    rule = "|---|---|---|"
    if replayed is not None:
        head += f" replayed ({scales}) |"
        rule += "---|"
    lines = [head, rule]
    again = {s.name: s for s in replayed or ()}
    for s in stats:
        row = f"| {s.name} | {s.target} | {s.value} |"
        if replayed is not None:
            row += f" {again[s.name].value if s.name in again else '-'} |"
        lines.append(row)
    return "\n".join(lines)


def _measure(jobs: Sequence[Job], time_scale: float) -> dict[str, tuple[str, float | None]]:
    out: dict[str, tuple[str, float | None]] = {}
    top = top_level(jobs)
    shapes = {j.job_id: turn_shapes(j) for j in jobs}
    out["sessions (top-level / subagents)"] = (f"{len(top)} / {len(jobs) - len(top)}", None)
    out.update(_prefix_stats(jobs))
    calls = [len(j.turns) for j in top]
    out["model calls per session, median [min-max]"] = (
        f"{percentile(calls, 50):.0f} [{min(calls)}-{max(calls)}]", percentile(calls, 50))
    at30 = [shapes[j.job_id][29].prompt + shapes[j.job_id][29].output
            for j in top if len(j.turns) >= 30]
    if at30:
        out["context at call 30, median"] = (_tokens(percentile(at30, 50)),
                                             percentile(at30, 50))
    prompt = sum(s.prompt for ss in shapes.values() for s in ss)
    output = sum(s.output for ss in shapes.values() for s in ss)
    out["input : output tokens"] = (f"{prompt / output:.0f} : 1", prompt / output)
    out.update(_tool_stats(jobs, time_scale))
    out.update(_compaction_stats(top))
    out["prefix hit rate, unbounded retention"] = _hit_rate(jobs, shapes)
    out["idle / active KV time, 5-min horizon"] = _idle_active(jobs, HORIZON_S * time_scale)
    users = [sum(1 for t in j.turns if t.user_tokens) for j in top]
    out["user messages per session, mean"] = (f"{sum(users) / len(users):.2f}",
                                              sum(users) / len(users))
    dropped = sum(s.prompt + s.output - nxt.kept for j in jobs
                  for t, s, nxt in zip(j.turns, shapes[j.job_id], shapes[j.job_id][1:],
                                       strict=False)
                  if t.user_tokens and t.keep_tokens is None and nxt.kept < s.prompt + s.output)
    out["reasoning dropped at user messages (tokens)"] = (
        f"{dropped / max(prompt, 1):.2%} of prompt tokens recomputed", dropped / max(prompt, 1))
    peak = max(j.peak_context for j in jobs)
    out["largest context"] = (_tokens(peak), float(peak))
    return out


def _prefix_stats(jobs: Sequence[Job]) -> dict[str, tuple[str, float | None]]:
    prefixes: dict[str, Counter[int]] = defaultdict(Counter)
    for j in jobs:
        if j.agent:
            prefixes[j.agent][j.prefix_tokens] += 1
    if not prefixes:
        return {"shared prefix per agent type (system + tool schemas)": ("none shared", 0.0)}
    common = {a: c.most_common(1)[0][0] for a, c in prefixes.items()}
    text = ", ".join(f"{a} {_tokens(n)}" for a, n in sorted(common.items(), key=lambda x: -x[1]))
    largest = max((a for a in common if any(j.agent == a and j.parent is None for j in jobs)),
                  key=lambda a: common[a], default=None)
    out: dict[str, tuple[str, float | None]] = {
        "shared prefix per agent type (system + tool schemas)": (text, None)}
    if largest is not None:
        first = [j.system_tokens for j in jobs if j.agent == largest and j.parent is None]
        med = percentile(first, 50)
        out["first request, largest agent type, median"] = (
            f"{_tokens(med)} ({largest}: {_tokens(common[largest])} shared)", med)
    return out


def _tool_stats(jobs: Sequence[Job], time_scale: float) -> dict[str, tuple[str, float | None]]:
    out: dict[str, tuple[str, float | None]] = {}
    by_agent: dict[str, list[float]] = defaultdict(list)
    times = []
    for j in jobs:
        for t in j.turns:
            if t.tool is not None:
                by_agent[j.agent].append(t.tool_s)
                times.append(t.tool_s)
    for agent in ("claude-code", "codex"):
        if by_agent.get(agent):
            med = percentile(by_agent[agent], 50)
            out[f"tool latency median, {agent}"] = (f"{med:.3g} s", med)
    if not any(j.agent for j in jobs) and times:  # a trace without agent types: all calls
        med = percentile(times, 50)
        out["tool latency median, claude-code"] = (f"{med:.3g} s (all calls)", None)
    total = sum(times)
    if total > 0:
        lo, hi = (x * time_scale for x in LONG_CALL_S)
        share = sum(x for x in times if lo <= x <= hi) / total
        out["share of tool time in calls of 1-10 min"] = (f"{share:.0%}", share)
    return out


def _compaction_stats(top: Sequence[Job]) -> dict[str, tuple[str, float | None]]:
    compacting, mid, total = 0, 0, 0
    for j in top:
        cuts = [t for t in j.turns if t.keep_tokens is not None]
        compacting += bool(cuts)
        total += len(cuts)
        mid += sum(1 for t in cuts if t.tool is not None)
    share = compacting / len(top)
    return {"sessions compacting at least once": (f"{share:.0%} ({compacting})", share),
            "compactions mid tool loop": (f"{mid} of {total}" if total else "none",
                                          mid / total if total else None)}


def _hit_rate(jobs: Sequence[Job], shapes: dict[str, list]  # type: ignore[type-arg]
              ) -> tuple[str, float | None]:
    """Prompt tokens an unbounded prefix cache serves: the kept context of every later turn,
    and the shared prefix of every first turn but the first of its agent type."""
    seen: set[str] = set()
    hit = prompt = 0
    for j in sorted(jobs, key=lambda j: j.arrival_s):
        for i, s in enumerate(shapes[j.job_id]):
            prompt += s.prompt
            hit += s.kept if i else (j.prefix_tokens if j.agent in seen else 0)
        if j.agent:
            seen.add(j.agent)
    rate = hit / prompt if prompt else 0.0
    return f"{rate:.1%}", rate


def _idle_active(jobs: Sequence[Job], horizon_s: float) -> tuple[str, float | None]:
    """Waits of at most ``horizon_s`` (each counted whole; longer ones left out, as a cache
    evicting after that long would drop their KV) over the generation time of every turn."""
    active = idle = 0.0
    for j in jobs:
        active += sum(ideal_seconds(j))
        idle += sum(t.wait_s for t in j.turns if t.continues and t.wait_s <= horizon_s)
    if active <= 0:
        return "-", None
    return f"{idle / active:.2f}x", idle / active


def _tokens(n: float) -> str:
    return f"{n / 1000:.1f}K" if n >= 1000 else f"{n:.0f}"


__all__ = ["HORIZON_S", "SUBAGENT_TOOL", "TARGETS", "Statistic", "stats_table",
           "trace_statistics"]
