"""Agent-workload traces: one JSON object per line, one agent session (job) per object.

A job is a task prompt followed by turns; each turn generates ``output_tokens`` tokens and,
except the last, ends in one tool call whose result enters the next prompt::

    {"job_id": "j0", "arrival_s": 0.0, "system_tokens": 4096, "turns": [
      {"output_tokens": 180, "tool": "bash", "tool_s": 0.31, "result_tokens": 1200,
       "arguments": "{\\"cmd\\": 7}", "mid_prompt": null, "reasoning_stripped": false,
       "cacheable": false, "predictable": false, "streamed": false},
      ...,
      {"output_tokens": 90, "tool": null}]}

Per turn: ``tool`` (null: the job ends after this turn), ``tool_s`` (seconds the tool runs),
``result_tokens`` (tokens of its result), ``arguments`` (JSON text of the call; two calls of a
cacheable tool with the same arguments return the same result), ``mid_prompt`` (null: the result
is appended; a fraction in [0, 1]: it is inserted at that fraction of the context, like a memory
block), ``reasoning_stripped`` (the template drops the first half of this turn's output, its
reasoning, from the next prompt), ``cacheable`` (the tool is idempotent: results are memoised),
``predictable`` (the client predicts the result exactly), ``streamed`` (the tool streams half of
its output halfway through). Missing optional fields take these defaults.

Fleet fields (all optional; a trace without them reads and writes exactly as before):

- per job: ``agent`` (the agent type), ``prefix_tokens`` (the first ``prefix_tokens`` of the
  task prompt are that agent type's shared system prompt and tool schemas, token-identical in
  every job of the type), ``parent`` (a subagent: the job whose tool call runs it; its
  ``arrival_s`` is not used, it starts when that call is made);
- per turn: ``reasoning_tokens`` (the first ``reasoning_tokens`` of the output are reasoning,
  dropped from the prompt at the next user message, as reasoning models' chat templates do),
  ``user_tokens`` and ``user_s`` (the turn calls no tool; the user answers after ``user_s``
  seconds with a message of ``user_tokens`` tokens), ``keep_tokens`` (the next prompt keeps
  only the first ``keep_tokens`` tokens of the context before the result is appended: a
  compaction, the context rewritten to a summary the result carries), ``subagent`` (the job id
  of the subagent this tool call runs: the call returns when that job ends).

Every turn but a job's last continues it (a tool call or a user message); the last does not.

`generate` draws the first generator's seeded trace (v1: tool time per call P50 0.3 s, P90 13.6
s, mean 18.4 s; 10-40 turns; context 2-8K growing 1-2.5K a turn; 50-600 output tokens a turn; no
token shared between jobs); `edmm.bench.agents.fleet` draws fleets of agent types (v2), and
`edmm.bench.agents.tracelab` reads TraceLab's replay CSV. `scale` shrinks token counts (a tiny
CPU model) and times (a run of minutes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

TOOL_NAMES = ("bash", "read_file", "edit_file", "search", "run_tests", "web_fetch")


class TraceError(ValueError):
    """A trace line or generator setting is malformed (names the line and the field)."""


@dataclass(frozen=True)
class Turn:
    """One model turn; all but a job's last end in a tool call."""

    output_tokens: int
    tool: str | None = None
    tool_s: float = 0.0
    result_tokens: int = 0
    arguments: str = "{}"
    mid_prompt: float | None = None
    reasoning_stripped: bool = False
    cacheable: bool = False
    predictable: bool = False
    streamed: bool = False
    reasoning_tokens: int = 0
    user_tokens: int = 0
    user_s: float = 0.0
    keep_tokens: int | None = None
    subagent: str | None = None

    def __post_init__(self) -> None:
        _check(self.output_tokens >= 1, "output_tokens", self.output_tokens, ">= 1")
        _check(self.tool_s >= 0 and math.isfinite(self.tool_s), "tool_s", self.tool_s, ">= 0")
        _check(self.result_tokens >= 0, "result_tokens", self.result_tokens, ">= 0")
        if self.tool is not None:
            _check(self.result_tokens >= 1, "result_tokens", self.result_tokens,
                   ">= 1 for a tool call")
        if self.mid_prompt is not None:
            _check(0 <= self.mid_prompt <= 1, "mid_prompt", self.mid_prompt, "in [0, 1]")
        _check(0 <= self.reasoning_tokens <= self.output_tokens, "reasoning_tokens",
               self.reasoning_tokens, "in [0, output_tokens]")
        _check(self.user_tokens >= 0, "user_tokens", self.user_tokens, ">= 0")
        _check(self.user_s >= 0 and math.isfinite(self.user_s), "user_s", self.user_s, ">= 0")
        if self.user_tokens:
            _check(self.tool is None, "tool", self.tool, "null on a turn the user answers")
        if self.keep_tokens is not None:
            _check(self.keep_tokens >= 0, "keep_tokens", self.keep_tokens, ">= 0")
        if self.subagent is not None:
            _check(self.tool is not None, "subagent", self.subagent, "on a tool call")

    @property
    def continues(self) -> bool:
        """True when the job goes on after this turn (a tool call or a user message)."""
        return self.tool is not None or self.user_tokens > 0

    @property
    def appended_tokens(self) -> int:
        """Tokens the next prompt adds after the kept context: the result or user message."""
        return self.result_tokens if self.tool is not None else self.user_tokens

    @property
    def wait_s(self) -> float:
        """Seconds the client waits after this turn: the tool's or the user's."""
        return self.tool_s if self.tool is not None else self.user_s


@dataclass(frozen=True)
class Job:
    """One agent session: a task prompt of ``system_tokens`` tokens (its first
    ``prefix_tokens`` shared by every job of its ``agent`` type), then its turns."""

    job_id: str
    system_tokens: int
    turns: tuple[Turn, ...]
    arrival_s: float = 0.0
    agent: str = ""
    prefix_tokens: int = 0
    parent: str | None = None

    def __post_init__(self) -> None:
        _check(self.system_tokens >= 1, "system_tokens", self.system_tokens, ">= 1")
        _check(len(self.turns) >= 1, "turns", len(self.turns), "at least one turn")
        _check(self.arrival_s >= 0, "arrival_s", self.arrival_s, ">= 0")
        _check(0 <= self.prefix_tokens <= self.system_tokens, "prefix_tokens",
               self.prefix_tokens, "in [0, system_tokens]")
        if self.prefix_tokens:
            _check(bool(self.agent), "agent", self.agent, "named where prefix_tokens > 0")
        for t in self.turns[:-1]:
            _check(t.continues, "tool", t.tool,
                   "a tool (or a user message) on every turn but the last")
        last = self.turns[-1]
        _check(last.tool is None, "tool", last.tool, "null on the last turn")
        _check(last.user_tokens == 0, "user_tokens", last.user_tokens, "0 on the last turn")
        _check(last.keep_tokens is None, "keep_tokens", last.keep_tokens,
               "null on the last turn")

    @property
    def tool_time_s(self) -> float:
        """Seconds the job's tools run in all."""
        return sum(t.tool_s for t in self.turns if t.tool is not None)

    @property
    def final_context(self) -> int:
        """Tokens of every prompt piece and output of the job (an upper bound of its KV)."""
        return self.system_tokens + sum(t.output_tokens + t.appended_tokens for t in self.turns)

    @property
    def peak_context(self) -> int:
        """The largest context (prompt + output) the job reaches, following its compactions
        and the reasoning dropped at user messages (`final_context` when it has neither)."""
        return max(s.prompt + s.output for s in turn_shapes(self))


@dataclass(frozen=True)
class TurnShape:
    """One turn's prompt in trace tokens (no template tokens): its length, how many of its
    leading tokens the session's context before it already held (0 on the first turn) and
    the output's length."""

    prompt: int
    kept: int
    output: int


def turn_shapes(job: Job) -> list[TurnShape]:
    """Each turn's `TurnShape` as the context is built: the result or user message appended
    to the context, after a turn's ``keep_tokens`` cut it (compaction) and a user message
    dropped the reasoning of the turns since the last one (reasoning is the first part of an
    output). The first generator's ``mid_prompt`` and ``reasoning_stripped`` are not followed
    (an upper bound of those traces' contexts)."""
    prompt, kept, out = job.system_tokens, 0, []
    loop_reasoning, first_reasoning = 0, None  # reasoning since the last user message
    for t in job.turns:
        out.append(TurnShape(prompt, kept, t.output_tokens))
        ctx = prompt + t.output_tokens
        if t.reasoning_tokens and first_reasoning is None:
            first_reasoning = prompt
        loop_reasoning += t.reasoning_tokens
        if t.keep_tokens is not None and t.keep_tokens < ctx:
            base = kept = t.keep_tokens
            loop_reasoning, first_reasoning = 0, None
        elif t.user_tokens and first_reasoning is not None:
            base, kept = ctx - loop_reasoning, first_reasoning
        else:
            base = kept = ctx
        if t.user_tokens:
            loop_reasoning, first_reasoning = 0, None
        prompt = base + t.appended_tokens
    return out


def check_jobs(jobs: Sequence[Job], where: str = "trace") -> None:
    """Raise `TraceError` unless job ids are unique and every subagent is run by exactly one
    tool call of its parent (and every such call names a subagent of that job)."""
    by_id = {j.job_id: j for j in jobs}
    if len(by_id) != len(jobs):
        raise TraceError(f"{where}: job ids repeat")
    calls: dict[str, str] = {}
    for job in jobs:
        for t in job.turns:
            if t.subagent is None:
                continue
            child = by_id.get(t.subagent)
            if child is None or child.parent != job.job_id:
                raise TraceError(f"{where}: job {job.job_id} calls subagent {t.subagent!r}, "
                                 "not a job whose parent it is")
            if t.subagent in calls:
                raise TraceError(f"{where}: subagent {t.subagent} is called twice")
            calls[t.subagent] = job.job_id
    for job in jobs:
        if job.parent is not None and job.job_id not in calls:
            raise TraceError(f"{where}: subagent {job.job_id} is called by no tool call of "
                             f"{job.parent!r}")
    if not any(j.parent is None for j in jobs):
        raise TraceError(f"{where}: no top-level job")


def top_level(jobs: Sequence[Job]) -> list[Job]:
    """The jobs that are not subagents (a closed loop's sessions; open-loop arrivals)."""
    return [j for j in jobs if j.parent is None]


def subagents_of(jobs: Sequence[Job]) -> dict[str, Job]:
    """Subagent jobs by id."""
    return {j.job_id: j for j in jobs if j.parent is not None}


def first_jobs(jobs: Sequence[Job], n: int) -> list[Job]:
    """The first ``n`` top-level jobs with the subagents they run (a trace of its own)."""
    keep = {j.job_id for j in top_level(jobs)[:n]}
    grew = True
    while grew:  # subagents of kept jobs, at any depth
        more = {j.job_id for j in jobs if j.parent in keep} - keep
        keep |= more
        grew = bool(more)
    return [j for j in jobs if j.job_id in keep]


@dataclass(frozen=True)
class GeneratorConfig:
    """Settings of `generate` (defaults: the published statistics, see the module docstring).

    ``tool_mix``: ``"long"`` (the heavy-tailed spread) or ``"short"`` (every call under 1 s).
    Flags are drawn per tool call with the given probabilities.
    """

    num_jobs: int = 64
    turns: tuple[int, int] = (10, 40)
    context_start: tuple[int, int] = (2048, 8192)
    growth_per_turn: tuple[int, int] = (1024, 2560)
    output_tokens: tuple[int, int] = (50, 600)
    tool_p50_s: float = 0.3
    tool_p90_s: float = 13.6
    tool_mean_s: float = 18.4
    tool_mix: str = "long"
    arrival_rate_per_s: float = 0.1
    p_mid_prompt: float = 0.1
    p_reasoning_stripped: float = 0.1
    p_cacheable: float = 0.2
    p_predictable: float = 0.1
    p_streamed: float = 0.2

    def __post_init__(self) -> None:
        _check(self.num_jobs >= 1, "num_jobs", self.num_jobs, ">= 1")
        for name in ("turns", "context_start", "growth_per_turn", "output_tokens"):
            lo, hi = getattr(self, name)
            _check(1 <= lo <= hi, name, (lo, hi), "1 <= low <= high")
        _check(self.tool_mix in ("long", "short"), "tool_mix", self.tool_mix, "long or short")
        _check(0 < self.tool_p50_s < self.tool_p90_s and self.tool_mean_s > 0, "tool times",
               (self.tool_p50_s, self.tool_p90_s, self.tool_mean_s), "0 < p50 < p90, mean > 0")
        _check(self.arrival_rate_per_s > 0, "arrival_rate_per_s", self.arrival_rate_per_s, "> 0")
        for name in ("p_mid_prompt", "p_reasoning_stripped", "p_cacheable", "p_predictable",
                     "p_streamed"):
            _check(0 <= getattr(self, name) <= 1, name, getattr(self, name), "in [0, 1]")


@dataclass
class ToolTimes:
    """A log-normal through the given P50 and P90, capped where its mean is the given mean."""

    mu: float
    sigma: float
    cap_s: float

    @classmethod
    def fit(cls, p50: float, p90: float, mean: float) -> ToolTimes:
        """Fit ``mu``/``sigma`` to the quantiles, then bisect the cap for the mean."""
        mu = math.log(p50)
        sigma = math.log(p90 / p50) / NormalDist().inv_cdf(0.9)
        if math.exp(mu + sigma * sigma / 2) <= mean:
            return cls(mu, sigma, math.inf)  # the mean needs no cap
        lo, hi = p90, 1e9
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if _capped_mean(mu, sigma, mid) < mean else (lo, mid)
        return cls(mu, sigma, lo)

    def draw(self, rng: random.Random) -> float:
        """One tool duration in seconds."""
        return min(rng.lognormvariate(self.mu, self.sigma), self.cap_s)


def _capped_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] of a log-normal X."""
    n = NormalDist()
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * n.cdf(z - sigma) + cap * (1 - n.cdf(z))


def generate(cfg: GeneratorConfig, seed: int) -> list[Job]:
    """A seeded synthetic trace (the same ``cfg`` and ``seed`` give the same jobs)."""
    rng = random.Random(seed)
    if cfg.tool_mix == "long":
        times = ToolTimes.fit(cfg.tool_p50_s, cfg.tool_p90_s, cfg.tool_mean_s)
    else:  # every call under a second, median as published
        times = ToolTimes(math.log(cfg.tool_p50_s), 0.6, 0.95)
    jobs, t = [], 0.0
    for j in range(cfg.num_jobs):
        jobs.append(_job(cfg, rng, times, f"j{j}", t))
        t += rng.expovariate(cfg.arrival_rate_per_s)
    return jobs


def _job(cfg: GeneratorConfig, rng: random.Random, times: ToolTimes, job_id: str,
         arrival: float) -> Job:
    n = rng.randint(*cfg.turns)
    turns: list[Turn] = []
    seen: list[str] = []  # arguments of earlier calls (a cacheable call may repeat one)
    for i in range(n):
        out = rng.randint(*cfg.output_tokens)
        if i == n - 1:
            turns.append(Turn(out))
            break
        growth = rng.randint(*cfg.growth_per_turn)
        cacheable = rng.random() < cfg.p_cacheable
        args = rng.choice(seen) if cacheable and seen and rng.random() < 0.5 else \
            json.dumps({"arg": rng.randrange(1 << 30)})
        seen.append(args)
        turns.append(Turn(
            out, rng.choice(TOOL_NAMES), round(times.draw(rng), 4), max(1, growth - out), args,
            round(rng.uniform(0.2, 0.8), 3) if rng.random() < cfg.p_mid_prompt else None,
            rng.random() < cfg.p_reasoning_stripped, cacheable,
            rng.random() < cfg.p_predictable, rng.random() < cfg.p_streamed))
    return Job(job_id, rng.randint(*cfg.context_start), tuple(turns), round(arrival, 4))


def scale(jobs: Iterable[Job], *, tokens: float = 1.0, time: float = 1.0) -> list[Job]:
    """Token counts times ``tokens`` (at least 1 each), tool times and arrivals times ``time``."""
    _check(tokens > 0, "token scale", tokens, "> 0")
    _check(time > 0, "time scale", time, "> 0")

    def tok(n: int) -> int:
        return max(1, round(n * tokens)) if n else 0

    out = []
    for job in jobs:
        turns = tuple(dataclasses.replace(
            t, output_tokens=tok(t.output_tokens), result_tokens=tok(t.result_tokens),
            tool_s=t.tool_s * time,
            reasoning_tokens=min(tok(t.reasoning_tokens), tok(t.output_tokens)),
            user_tokens=tok(t.user_tokens), user_s=t.user_s * time,
            keep_tokens=None if t.keep_tokens is None else tok(t.keep_tokens))
            for t in job.turns)
        out.append(dataclasses.replace(job, system_tokens=tok(job.system_tokens), turns=turns,
                                       arrival_s=job.arrival_s * time,
                                       prefix_tokens=tok(job.prefix_tokens)))
    return out


def as_forced_calls(jobs: Iterable[Job], call_tokens: int) -> list[Job]:
    """The jobs as the HTTP replay sends them (`edmm.bench.agents.http`), for an in-process
    run of the same work: each call turn decodes ``call_tokens`` tokens (the forced call's
    length) and the rest of its trace output joins its result (prefilled, not decoded); no
    reasoning is left to drop (over HTTP it is part of that padded result). Other turns are
    unchanged."""
    _check(call_tokens >= 1, "call_tokens", call_tokens, ">= 1")

    def forced(t: Turn) -> Turn:
        if t.tool is None:
            return t
        pad = max(0, t.output_tokens - call_tokens)
        return dataclasses.replace(t, output_tokens=call_tokens, reasoning_tokens=0,
                                   result_tokens=t.result_tokens + pad)

    return [dataclasses.replace(job, turns=tuple(forced(t) for t in job.turns))
            for job in jobs]


# ---------------------------------------------------------------- JSONL

# Fields written only where they differ from their defaults (a trace without them reads and
# writes, and digests, as before they existed).
_FLEET_TURN_FIELDS = ("reasoning_tokens", "user_tokens", "user_s", "keep_tokens", "subagent")
_FLEET_JOB_FIELDS = ("agent", "prefix_tokens", "parent")
_TURN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Turn)}
_JOB_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Job)}


def job_to_dict(job: Job) -> dict[str, Any]:
    """The JSON object of a trace line."""
    out: dict[str, Any] = {"job_id": job.job_id, "arrival_s": job.arrival_s,
                           "system_tokens": job.system_tokens}
    out.update({k: getattr(job, k) for k in _FLEET_JOB_FIELDS
                if getattr(job, k) != _JOB_DEFAULTS[k]})
    out["turns"] = [_turn_to_dict(t) for t in job.turns]
    return out


def _turn_to_dict(turn: Turn) -> dict[str, Any]:
    d = dataclasses.asdict(turn)
    for k in _FLEET_TURN_FIELDS:
        if d[k] == _TURN_DEFAULTS[k]:
            del d[k]
    return d


def job_from_dict(obj: Any, where: str = "job") -> Job:
    """A job from a trace line's object; `TraceError` names where and what is wrong."""
    try:
        return _job_from_dict(obj)
    except TraceError as e:
        raise TraceError(f"{where}: {e}") from None


def _job_from_dict(obj: Any) -> Job:
    if not isinstance(obj, dict):
        raise TraceError(f"expected an object, got {type(obj).__name__}")
    unknown = set(obj) - {"job_id", "arrival_s", "system_tokens", "turns", *_FLEET_JOB_FIELDS}
    if unknown:
        raise TraceError(f"unknown fields {sorted(unknown)}")
    for name in ("job_id", "system_tokens", "turns"):
        if name not in obj:
            raise TraceError(f"missing field {name!r}")
    if not isinstance(obj["turns"], list):
        raise TraceError("'turns' must be a list")
    turns = []
    for i, t in enumerate(obj["turns"]):
        try:
            turns.append(_turn(t))
        except TraceError as e:
            raise TraceError(f"turn {i}: {e}") from None
    arrival = obj.get("arrival_s", 0.0)
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)):
        raise TraceError(f"arrival_s must be a number, got {arrival!r}")
    agent = obj.get("agent", "")
    if not isinstance(agent, str):
        raise TraceError(f"agent must be a string, got {agent!r}")
    parent = obj.get("parent")
    if parent is not None and not isinstance(parent, str):
        raise TraceError(f"parent must be a string or null, got {parent!r}")
    return Job(str(obj["job_id"]), _int(obj["system_tokens"], "system_tokens"), tuple(turns),
               float(arrival), agent, _int(obj.get("prefix_tokens", 0), "prefix_tokens"),
               parent)


_TURN_FIELDS = {f.name for f in dataclasses.fields(Turn)}


def _turn(obj: Any) -> Turn:
    if not isinstance(obj, dict):
        raise TraceError("expected an object")
    unknown = set(obj) - _TURN_FIELDS
    if unknown:
        raise TraceError(f"unknown fields {sorted(unknown)}")
    if "output_tokens" not in obj:
        raise TraceError("missing field 'output_tokens'")
    kw = dict(obj)
    for name in ("output_tokens", "result_tokens", "reasoning_tokens", "user_tokens"):
        if name in kw:
            kw[name] = _int(kw[name], name)
    if kw.get("keep_tokens") is not None:
        kw["keep_tokens"] = _int(kw["keep_tokens"], "keep_tokens")
    try:
        return Turn(**kw)
    except TypeError as e:
        raise TraceError(str(e)) from None


def _int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"{name} must be an integer, got {v!r}")
    return v


def to_jsonl(jobs: Sequence[Job]) -> str:
    """A trace as JSONL text, one job per line."""
    return "".join(json.dumps(job_to_dict(j)) + "\n" for j in jobs)


def trace_digest(jobs: Sequence[Job]) -> str:
    """SHA-256 of the trace's JSONL text: two runs replayed the same trace iff equal."""
    return hashlib.sha256(to_jsonl(jobs).encode()).hexdigest()


def write_jsonl(jobs: Sequence[Job], path: Path | str) -> Path:
    """Write a trace, one job per line."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_jsonl(jobs), encoding="utf-8")
    return out


def read_jsonl(path: Path | str) -> list[Job]:
    """Read a trace (blank lines skipped); `TraceError` names the bad line."""
    jobs = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{n}: not JSON ({e.msg})") from None
        jobs.append(job_from_dict(obj, f"{path}:{n}"))
    if not jobs:
        raise TraceError(f"{path}: no jobs")
    check_jobs(jobs, str(path))
    return jobs


def _check(ok: bool, name: str, value: Any, want: str) -> None:
    if not ok:
        raise TraceError(f"{name} must be {want}, got {value!r}")


__all__ = ["GeneratorConfig", "Job", "ToolTimes", "TraceError", "Turn", "TurnShape",
           "as_forced_calls", "check_jobs", "first_jobs", "generate", "job_from_dict",
           "job_to_dict", "read_jsonl", "scale", "subagents_of", "top_level", "turn_shapes",
           "write_jsonl"]
