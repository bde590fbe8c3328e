"""Trace v2: a seeded fleet of coding agents, calibrated to published agent-trace statistics.

A fleet is a mix of agent types (`AgentProfile`). Every session of a type starts with that
type's shared prefix, its system prompt and tool schemas (``Job.prefix_tokens``, 6.5K to 21K
tokens in `AGENTS`), token-identical across the type's sessions, then a task of its own. A
session runs 20-60 model calls (median about 33), in tool loops separated by user messages
(the user's thinking time, ``Turn.user_s``; at each user message the reasoning of the loop
before it leaves the prompt, as reasoning models' chat templates drop it). Each call's tool is
drawn from the type's tools with its own weight, a log-normal duration of that tool's median
and spread (so a tool's time can be learned from its name) and a log-normal result length.
A ``Task`` call of ``claude-code`` runs a subagent: a session of its own type
(``claude-code-subagent``, a 13K prefix) whose end returns the call. Contexts grow to the
model's limit (``FleetConfig.context_limit``); a session whose next prompt would pass
``compact_at`` of it is compacted: the context is rewritten to the shared prefix plus a summary
(``Turn.keep_tokens``), mid tool loop where the crossing falls there. Sessions arrive as a
Poisson process (``arrival_rate_per_s``).

The published figures the defaults aim at (`edmm.bench.agents.trace_stats.TARGETS` lists them
beside what a trace measures): median tool latency ~0.13 s (Claude Code) and ~0.6 s (Codex),
about half of all tool time in calls of 1-10 minutes; median ~33 model calls a session, ~80K
tokens of context by call 30; input:output ~100:1; a ~25K first request of which ~15K tool
schemas and ~6K system prompt (subagents ~13K); ~10% of sessions compacting at least once;
idle KV ~1.9x the active KV at a 5-minute horizon. `generate_fleet` is deterministic in its
config and seed.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field

from edmm.bench.agents.trace import Job, TraceError, Turn, check_jobs, turn_shapes

# An idealised engine, used to time the turns of a trace when none runs it (a subagent's
# duration as its parent's tool time; the idle / active KV statistic): seconds per output
# token of one session and prompt tokens per second.
IDEAL_DECODE_S = 0.015
IDEAL_PREFILL_TOKENS_S = 20_000.0
SUBAGENT_TOOL = "Task"


def _check(ok: bool, name: str, want: str) -> None:
    if not ok:
        raise TraceError(f"fleet setting {name}: must be {want}")


@dataclass(frozen=True)
class ToolProfile:
    """One tool of an agent type: its share of the type's calls, a log-normal duration
    (median seconds, sigma of its log) and a log-normal result length (median tokens)."""

    name: str
    weight: float
    median_s: float
    sigma: float
    result_tokens: int
    result_sigma: float = 0.9
    cacheable: bool = False

    def __post_init__(self) -> None:
        _check(self.weight > 0 and self.median_s > 0 and self.sigma >= 0, self.name,
               "weight > 0, median_s > 0, sigma >= 0")
        _check(self.result_tokens >= 1, self.name, "result_tokens >= 1")


@dataclass(frozen=True)
class AgentProfile:
    """One agent type: its shared prefix (system prompt + tool schemas), its tools, how its
    sessions run. ``share``: its part of the top-level sessions (0: a subagent only);
    ``subagent``: the type a `SUBAGENT_TOOL` call runs (None: it has no such tool)."""

    name: str
    system_tokens: int
    tool_schema_tokens: int
    share: float
    tools: tuple[ToolProfile, ...]
    task_tokens: int = 4000  # median first user message (task, project notes, environment)
    turns_median: int = 33
    output_median: int = 320
    reasoning_share: float = 0.0  # of each output, on average
    user_messages_mean: float = 4.0  # user messages after the first, on average
    subagent: str | None = None

    def __post_init__(self) -> None:
        _check(self.system_tokens >= 1 and self.tool_schema_tokens >= 0, self.name,
               "system_tokens >= 1, tool_schema_tokens >= 0")
        _check(self.share >= 0 and bool(self.tools), self.name, "share >= 0 and some tools")
        _check(0 <= self.reasoning_share <= 1, self.name, "reasoning_share in [0, 1]")

    @property
    def prefix_tokens(self) -> int:
        """Tokens every session of the type shares: the system prompt and the tool schemas."""
        return self.system_tokens + self.tool_schema_tokens


_READ = ToolProfile("Read", 0.30, 0.08, 0.7, 2800, 0.9, cacheable=True)
_SEARCH = ToolProfile("Grep", 0.14, 0.18, 0.8, 750)
_GLOB = ToolProfile("Glob", 0.06, 0.1, 0.7, 250, cacheable=True)
_EDIT = ToolProfile("Edit", 0.18, 0.12, 0.6, 250)
_TODO = ToolProfile("TodoWrite", 0.04, 0.02, 0.4, 80)
_FETCH = ToolProfile("WebFetch", 0.02, 3.5, 1.0, 3500)

AGENTS: tuple[AgentProfile, ...] = (
    AgentProfile(
        "claude-code", system_tokens=6000, tool_schema_tokens=15000, share=0.45,
        tools=(_READ, _SEARCH, _GLOB, _EDIT, _TODO, _FETCH,
               ToolProfile("Bash", 0.21, 2.0, 2.5, 1150, 1.1),
               ToolProfile(SUBAGENT_TOOL, 0.05, 60.0, 0.0, 1)),
        task_tokens=4000, output_median=380, reasoning_share=0.3,
        subagent="claude-code-subagent"),
    AgentProfile(
        "codex", system_tokens=6500, tool_schema_tokens=2000, share=0.40,
        tools=(ToolProfile("shell", 0.74, 1.05, 2.4, 1400, 1.1),
               ToolProfile("apply_patch", 0.20, 0.4, 0.7, 250),
               ToolProfile("update_plan", 0.06, 0.01, 0.4, 50)),
        task_tokens=3500, output_median=420, reasoning_share=0.5),
    AgentProfile(
        "mini-swe", system_tokens=5500, tool_schema_tokens=1000, share=0.15,
        tools=(ToolProfile("bash", 1.0, 0.8, 2.4, 1250, 1.1),),
        task_tokens=3000, output_median=350, user_messages_mean=1.0),
    AgentProfile(
        "claude-code-subagent", system_tokens=4000, tool_schema_tokens=9000, share=0.0,
        tools=(_READ, _SEARCH, _GLOB, ToolProfile("Bash", 0.2, 2.0, 1.8, 1000, 1.1)),
        task_tokens=800, turns_median=12, output_median=300, reasoning_share=0.3,
        user_messages_mean=0.0),
)


@dataclass(frozen=True)
class FleetConfig:
    """Settings of `generate_fleet` (defaults: the published statistics; module docstring).

    ``turns``: the range of model calls of a top-level session (``turns_median`` of each
    profile drawn log-normal inside it); ``subagent_turns`` the same for subagents.
    ``context_limit``: the model's context; a session compacts where its next prompt would
    pass ``compact_at`` of it, to its shared prefix plus a summary of ``summary_tokens``
    (median). ``growth_sigma``: spread of a per-session factor on result lengths (some sessions
    read much more than others). ``user_s``: median seconds a user takes to answer
    (log-normal, ``user_sigma``, capped at ``user_cap_s``). ``tool_cap_s``: longest tool call.
    ``tool_mix``: ``"long"`` (the profiles' spread) or ``"short"`` (every call under 1 s).
    """

    num_jobs: int = 64
    agents: tuple[AgentProfile, ...] = AGENTS
    turns: tuple[int, int] = (20, 60)
    subagent_turns: tuple[int, int] = (6, 20)
    turns_sigma: float = 0.3
    context_limit: int = 131072
    compact_at: float = 0.92
    summary_tokens: int = 3000
    growth_sigma: float = 0.15
    output_sigma: float = 0.8
    user_s: float = 120.0
    user_sigma: float = 0.8
    user_cap_s: float = 1800.0
    user_tokens: int = 120
    tool_cap_s: float = 1800.0
    tool_mix: str = "long"
    arrival_rate_per_s: float = 0.05
    names: tuple[str, ...] = field(default=())  # agent types to draw from (empty: all)

    def __post_init__(self) -> None:
        _check(self.num_jobs >= 1, "num_jobs", ">= 1")
        for name in ("turns", "subagent_turns"):
            lo, hi = getattr(self, name)
            _check(2 <= lo <= hi, name, "2 <= low <= high")
        _check(self.context_limit >= 1024, "context_limit", ">= 1024")
        _check(0.1 <= self.compact_at <= 0.95, "compact_at", "in [0.1, 0.95]")
        _check(self.tool_mix in ("long", "short"), "tool_mix", "long or short")
        _check(self.arrival_rate_per_s > 0, "arrival_rate_per_s", "> 0")
        known = {a.name for a in self.agents}
        unknown = [n for n in self.names if n not in known]
        _check(not unknown, "names", f"among {sorted(known)}, got {unknown}")
        top = [a for a in self.agents if a.share > 0 and (not self.names or a.name in self.names)]
        _check(bool(top), "agents", "at least one with share > 0")
        for a in self.agents:
            _check(a.subagent is None or a.subagent in known, a.name,
                   f"subagent {a.subagent!r} among the agents")
            _check(a.prefix_tokens + a.task_tokens < self.compact_at * self.context_limit,
                   a.name, "a first prompt under compact_at x context_limit")

    def profile(self, name: str) -> AgentProfile:
        """The agent type named ``name``."""
        return next(a for a in self.agents if a.name == name)


def generate_fleet(cfg: FleetConfig, seed: int) -> list[Job]:
    """A seeded fleet trace: ``cfg.num_jobs`` top-level sessions in arrival order, each
    followed by the subagents it runs (the same ``cfg`` and ``seed`` give the same jobs)."""
    rng = random.Random(f"fleet/{seed}")
    top = [a for a in cfg.agents if a.share > 0 and (not cfg.names or a.name in cfg.names)]
    jobs: list[Job] = []
    t = 0.0
    for j in range(cfg.num_jobs):
        profile = rng.choices(top, weights=[a.share for a in top])[0]
        jobs += _Session(cfg, rng, profile, f"j{j}", round(t, 4)).draw()
        t += rng.expovariate(cfg.arrival_rate_per_s)
    check_jobs(jobs, "generated fleet")
    return jobs


class _Session:
    """Draws one session (and its subagents) turn by turn, following its context."""

    def __init__(self, cfg: FleetConfig, rng: random.Random, profile: AgentProfile,
                 job_id: str, arrival: float, parent: str | None = None) -> None:
        self.cfg, self.rng, self.p = cfg, rng, profile
        self.job_id, self.arrival, self.parent = job_id, arrival, parent
        self.growth = rng.lognormvariate(0.0, cfg.growth_sigma)
        self.children: list[Job] = []

    def draw(self) -> list[Job]:
        cfg, rng, p = self.cfg, self.rng, self.p
        n = self._turn_count()
        system = p.prefix_tokens + self._lognormal(p.task_tokens, 0.5, 1, None)
        users = self._user_turns(n)
        ctx, reasoning, turns = system, 0, []
        for i in range(n):
            out = self._lognormal(p.output_median, cfg.output_sigma, 8,
                                  int(0.03 * cfg.context_limit))
            think = min(out, round(out * p.reasoning_share * rng.uniform(0.5, 1.5)))
            ctx += out
            reasoning += think
            if i == n - 1:
                turns.append(Turn(out, reasoning_tokens=think))
                break
            turn = self._user_turn(out, think) if i in users else self._tool_turn(out, think, i)
            after = ctx - reasoning if turn.user_tokens else ctx
            if after + turn.appended_tokens > cfg.compact_at * cfg.context_limit:
                turn = self._compact(turn)
                ctx, reasoning = p.prefix_tokens, 0
            elif turn.user_tokens:
                ctx, reasoning = after, 0
            ctx += turn.appended_tokens
            turns.append(turn)
        job = Job(self.job_id, system, tuple(turns), self.arrival, p.name, p.prefix_tokens,
                  self.parent)
        return [job, *self.children]

    def _turn_count(self) -> int:
        lo, hi = self.cfg.subagent_turns if self.parent else self.cfg.turns
        median = min(max(self.p.turns_median, lo), hi)
        return min(max(round(self.rng.lognormvariate(math.log(median), self.cfg.turns_sigma)),
                       lo), hi)

    def _user_turns(self, n: int) -> set[int]:
        """Turns after which the user answers (none in the first two or the last two)."""
        rng, mean = self.rng, self.p.user_messages_mean
        count = 0
        while mean > 0 and rng.random() < mean / (mean + 1):  # geometric, mean ``mean``
            count += 1
        slots = list(range(2, n - 2))
        return set(rng.sample(slots, min(count, len(slots) // 2)))

    def _tool_turn(self, out: int, think: int, index: int) -> Turn:
        cfg, rng = self.cfg, self.rng
        tool = rng.choices(self.p.tools, weights=[t.weight for t in self.p.tools])[0]
        args = json.dumps({"arg": rng.randrange(1 << 16 if tool.cacheable else 1 << 30)})
        if tool.name == SUBAGENT_TOOL and self.p.subagent is not None:
            child = self._subagent(index)
            result = child.turns[-1].output_tokens + 40
            return Turn(out, tool.name, round(_ideal_duration(child), 4), result, args,
                        reasoning_tokens=think, subagent=child.job_id)
        seconds = self._duration(tool)
        limit = int(0.05 * cfg.context_limit)
        result = self._lognormal(tool.result_tokens * self.growth, tool.result_sigma, 1, limit)
        return Turn(out, tool.name, seconds, result, args, cacheable=tool.cacheable,
                    reasoning_tokens=think)

    def _user_turn(self, out: int, think: int) -> Turn:
        cfg = self.cfg
        seconds = min(self.rng.lognormvariate(math.log(cfg.user_s), cfg.user_sigma),
                      cfg.user_cap_s)
        tokens = self._lognormal(cfg.user_tokens, 0.8, 1, int(0.05 * cfg.context_limit))
        return Turn(out, reasoning_tokens=think, user_tokens=tokens, user_s=round(seconds, 4))

    def _compact(self, turn: Turn) -> Turn:
        """``turn`` with the context rewritten to the shared prefix plus a summary, which the
        result (or the user message) carries ahead of its own tokens."""
        summary = self._lognormal(self.cfg.summary_tokens, 0.3, 16,
                                  int(0.1 * self.cfg.context_limit))
        if turn.user_tokens:
            return Turn(turn.output_tokens, reasoning_tokens=turn.reasoning_tokens,
                        user_tokens=turn.user_tokens + summary, user_s=turn.user_s,
                        keep_tokens=self.p.prefix_tokens)
        return Turn(turn.output_tokens, turn.tool, turn.tool_s, turn.result_tokens + summary,
                    turn.arguments, cacheable=turn.cacheable,
                    reasoning_tokens=turn.reasoning_tokens, keep_tokens=self.p.prefix_tokens,
                    subagent=turn.subagent)

    def _subagent(self, index: int) -> Job:
        assert self.p.subagent is not None
        child_id = f"{self.job_id}.s{index}"
        jobs = _Session(self.cfg, self.rng, self.cfg.profile(self.p.subagent), child_id,
                        self.arrival, parent=self.job_id).draw()
        self.children += jobs
        return jobs[0]

    def _duration(self, tool: ToolProfile) -> float:
        cfg, rng = self.cfg, self.rng
        if cfg.tool_mix == "short":
            return round(min(rng.lognormvariate(math.log(min(tool.median_s, 0.3)), 0.6), 0.95), 4)
        return round(min(rng.lognormvariate(math.log(tool.median_s), tool.sigma),
                         cfg.tool_cap_s), 4)

    def _lognormal(self, median: float, sigma: float, lo: int, hi: int | None) -> int:
        x = round(self.rng.lognormvariate(math.log(median), sigma))
        return max(lo, x if hi is None else min(x, hi))


def ideal_seconds(job: Job) -> list[float]:
    """Each turn's seconds on the idealised engine (its new tokens prefilled, its output
    decoded; the shared prefix counted as cached), the wait after it not included."""
    out = []
    for i, shape in enumerate(turn_shapes(job)):
        kept = shape.kept if i else job.prefix_tokens
        out.append((shape.prompt - kept) / IDEAL_PREFILL_TOKENS_S + shape.output * IDEAL_DECODE_S)
    return out


def _ideal_duration(job: Job) -> float:
    """Seconds ``job`` takes on the idealised engine, with its tools' and users' time."""
    return sum(ideal_seconds(job)) + sum(t.wait_s for t in job.turns)


__all__ = ["AGENTS", "IDEAL_DECODE_S", "IDEAL_PREFILL_TOKENS_S", "SUBAGENT_TOOL", "AgentProfile",
           "FleetConfig", "ToolProfile", "generate_fleet", "ideal_seconds"]
