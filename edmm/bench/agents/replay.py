"""Replay an agent trace against an in-process `AgentEngine`, closed or open loop.

One thread runs the engine loop: between steps it admits jobs, reports tool calls, feeds
streamed output and sends the resumes whose tool has run its (scaled) duration, all against
wall-clock deadlines. With ``clock="virtual"`` (the default) the loop skips the time when the
engine has nothing at all to compute (no request, no speculation) by moving its clock forward
instead of sleeping: every step still takes its real time, so TTFTs and queueing are as
measured, while hours of tool time replay in the minutes of compute they leave (a
speculation-only step that could not advance counts as nothing to compute). With
``clock="wall"`` it sleeps instead. With ``clock="model"`` time is the engine's modelled step
seconds alone (`edmm.engine.step_cost.StepTimeModel`, set on the engine by the caller): the
host's own speed and load do not count, so a run is deterministic and plays out at the
modelled GPU's speeds on a machine without it.

Each turn is forced to the trace's output length (greedy, ``min_tokens = max_tokens``, EOS
ignored). Token ids are synthetic: the job's task prompt and each tool result are seeded draws
(the same call of a cacheable tool, the same arguments, returns the same ids; the first
``prefix_tokens`` of a task prompt are its agent type's, the same in every job of the type),
and a result enters the next prompt as ``BEFORE + result + AFTER`` appended (or inserted at the
trace's ``mid_prompt`` fraction of the context), then ``SUFFIX``; a user message as
``USER_BEFORE + message + USER_AFTER + SUFFIX`` after the user's time, once the reasoning of
the turns since the last user message is dropped (`edmm.bench.agents.context`). A turn's
``keep_tokens`` cuts the context first (compaction). A subagent starts when its parent's call
is made, beside the loop's sessions, and its end returns that call.

Every turn's row says what kind it is (``turn_kind``: ``first``, ``tool`` after a tool result,
``user`` after a user message), its TTFT (from the request to its first token) and its
``new_tokens``: the prompt less what an unbounded prefix cache would hold (the session's
context before it up to the first changed token; on a first turn, the agent type's shared
prefix once a session of the type has started). A job's ``tool_s`` is every wait on tools
and users, its subagents' included; its engine-wait the rest of its completion time.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edmm.agent import AgentEngine, TokenLayout, ToolCall, ToolResult
from edmm.agent.types import ToolSpec
from edmm.bench.agents.context import Context, common_prefix
from edmm.bench.agents.engine_io import (
    EngineCounters,
    pages_by_state,
    read_counters,
    speculated_tokens_now,
)
from edmm.bench.agents.policies import Policy
from edmm.bench.agents.trace import Job, Turn, subagents_of
from edmm.engine import SamplingParams

BEFORE, AFTER = (3,), (4,)  # e.g. <tool_response> ... </tool_response>
USER_BEFORE, USER_AFTER = (5,), (6,)  # e.g. <|im_start|>user ... <|im_end|>
SUFFIX = (2, 1, 10)  # e.g. <|im_end|> <|im_start|> assistant
FIRST_ID = 16  # synthetic token ids start above the special ones
DURATION_EMA = 0.5  # weight of the newest duration in the client's estimate (rewarm)
CLOCKS = ("virtual", "wall", "model")


class ReplayError(RuntimeError):
    """The replay broke an invariant (pages not returned, a job that never ends)."""


@dataclass(frozen=True)
class ReplayConfig:
    """How a trace is replayed.

    ``mode``: ``"closed"`` (``load`` sessions run at once; a finished job's place goes to the
    next) or ``"open"`` (jobs arrive as a Poisson process of ``load`` jobs per second).
    ``prefetch_lead_s``: how long before a tool's expected return offloaded KV is prefetched
    (edmm) and the known history re-sent (rewarm); the expected duration is the client's
    running average per tool, the same rule the agent layer learns by, and an idle loop wakes
    then. ``sample_s``: spacing of the KV-pages timeline. ``seed``: the open loop's arrivals.
    ``step_log``: keep one row per engine step (`RunResult.steps`: what it computed, the
    engine's seconds and the agent layer's around them).
    """

    mode: str = "closed"
    load: float = 8
    clock: str = "virtual"
    prefetch_lead_s: float = 0.05
    tool_timeout_s: float = 1e6
    sample_s: float = 0.05
    seed: int = 0
    max_wall_s: float = 3600.0
    step_log: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode must be 'closed' or 'open', got {self.mode!r}")
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {self.clock!r}")
        if not self.load > 0:
            raise ValueError(f"load must be > 0, got {self.load}")


class ReplayClock:
    """Seconds of a replay (`CLOCKS`): ``wall`` is monotonic time; ``virtual`` jumps over
    idle time instead of sleeping; ``model`` advances only by idle jumps and the engine's
    modelled step seconds (`charge`)."""

    def __init__(self, kind: str) -> None:
        if kind not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {kind!r}")
        self.kind = kind
        self._offset = 0.0

    @property
    def modelled(self) -> bool:
        """True when steps are charged their modelled seconds (host time does not pass)."""
        return self.kind == "model"

    def __call__(self) -> float:
        return self._offset if self.modelled else time.monotonic() + self._offset

    def charge(self, seconds: float) -> None:
        """A modelled step took ``seconds``."""
        self._offset += seconds

    def wait_until(self, t: float) -> None:
        """Idle until ``t``: jump there (virtual, model) or sleep (wall)."""
        gap = t - self()
        if gap <= 0:
            return
        if self.kind == "wall":
            time.sleep(gap)
        else:
            self._offset += gap


@dataclass
class RunResult:
    """What one replay measured (rows are plain dicts for the report)."""

    turns: list[dict[str, Any]]
    jobs: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    sessions: dict[str, int]  # summed `SessionMetrics` counters
    makespan_s: float
    spec_only_step_s: float  # engine time of steps that ran speculation only
    busy_step_s: float  # engine time of steps that ran requests
    counters_before: EngineCounters
    counters_after: EngineCounters
    outputs: dict[str, str] = field(default_factory=dict)  # "job/turn" -> digest of its ids
    steps: list[dict[str, Any]] = field(default_factory=list)  # with ``step_log``: per step
    extra_prefill_tokens: int = 0  # prefilled by requests that are no turn (re-warms)


@dataclass
class _JobRun:
    job: Job
    sid: str
    admitted: float
    parent: _JobRun | None = None  # a subagent: the session whose call it answers
    turn: int = 0
    kind: str = "first"  # of the current turn: first, tool, user
    context: Context = field(default_factory=lambda: Context([]))  # the current prompt
    kept: int = 0  # tokens of the current prompt an unbounded prefix cache holds
    tool_start: float = 0.0
    tool_waited: float = 0.0  # tools, users and subagents, in all
    user_start: float = 0.0
    user_waited: float = 0.0
    resumed_at: float | None = None
    first_seen: bool = False
    next_prompt: list[int] = field(default_factory=list)
    result: list[int] = field(default_factory=list)
    position: int | None = None
    rewarm_due: bool = False
    awaiting: bool = False  # the tool runs


class Replayer:
    """Replays ``jobs`` under ``policy`` on ``agent`` (built with the policy's config);
    ``reserved_pages``: pages of the pool a `KVBallast` holds (left out of the counters)."""

    def __init__(self, agent: AgentEngine, policy: Policy, jobs: list[Job], cfg: ReplayConfig,
                 clock: ReplayClock, run_id: str,
                 on_job_done: Callable[[str], None] | None = None,
                 reserved_pages: int = 0) -> None:
        self.agent, self.policy, self.jobs, self.cfg = agent, policy, jobs, cfg
        self.clock, self.run_id = clock, run_id
        self.reserved_pages = reserved_pages  # held by a ballast: not the run's
        self.vocab = agent.engine.model_config.vocab_size
        self.page_bytes = agent.engine.kv.layout().page_size
        self._on_job_done = on_job_done or (lambda _: None)
        self._events: list[tuple[float, int, str, _JobRun]] = []
        self._seq = itertools.count()
        self._requests: dict[str, tuple[_JobRun, str]] = {}  # request id -> (job, kind)
        self._active: dict[str, _JobRun] = {}
        self._subagents = subagents_of(jobs)
        self._top = [i for i, j in enumerate(jobs) if j.parent is None]
        self._seen_agents: set[str] = set()  # agent types with a session started
        self._durations: dict[str, float] = {}  # tool -> the client's EMA (rewarm)
        self.turn_rows: list[dict[str, Any]] = []
        self.job_rows: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.outputs: dict[str, str] = {}
        self.steps: list[dict[str, Any]] = []
        self.sessions: dict[str, int] = {}
        self._extra_prefill = 0
        self._declare_tools()

    # ------------------------------------------------------------------ driving
    def run(self) -> RunResult:
        """Replay every job to its end; return what was measured."""
        before = read_counters(self.agent, self.reserved_pages)
        t0 = self.clock()
        arrivals = self._arrivals(t0)
        pending = list(range(len(arrivals)))
        spec_s = busy_s = 0.0
        next_sample = t0
        wall_end = time.monotonic() + self.cfg.max_wall_s
        while pending or self._active or self.agent.has_unfinished():
            if time.monotonic() > wall_end:
                raise ReplayError(f"replay {self.run_id} ran past {self.cfg.max_wall_s} s")
            now = self.clock()
            self._admit(pending, arrivals, now)
            self._fire(now)
            if now >= next_sample:
                self._sample(now - t0)
                next_sample = now + self.cfg.sample_s
            busy = self.agent.has_unfinished()
            if busy:
                start = time.perf_counter()
                outputs = self.agent.step()
                took = self._took(start)
                busy_s += took
                self._log_step("busy", now - t0, took)
                for out in outputs:
                    self._on_output(out)
                continue
            if self.agent.has_speculation():
                done = speculated_tokens_now(self.agent)
                start = time.perf_counter()
                self.agent.step()
                took = self._took(start)
                spec_s += took
                self._log_step("spec", now - t0, took)
                if speculated_tokens_now(self.agent) != done or not self.agent.has_speculation():
                    continue  # it advanced: speculation keeps the engine busy
            else:  # idle: retention and prefetch decisions still run
                self.agent.step()
            self.clock.wait_until(self._next_wake(pending, arrivals, now))
        makespan = self.clock() - t0
        self._sample(makespan)
        after = read_counters(self.agent, self.reserved_pages)
        return RunResult(self.turn_rows, self.job_rows, self.timeline, self.sessions, makespan,
                         spec_s, busy_s, before, after, self.outputs, self.steps,
                         self._extra_prefill)

    def _took(self, start: float) -> float:
        """Seconds the step begun at ``start`` took: host-measured, or (model clock) the
        engine's modelled seconds, charged to the clock."""
        if not self.clock.modelled:
            return time.perf_counter() - start
        shape = self.agent.engine.last_step
        seconds = shape.seconds if shape is not None else 0.0
        self.clock.charge(seconds)
        return seconds

    def _log_step(self, phase: str, t_s: float, took_s: float) -> None:
        """With ``step_log``: one row for the step the agent layer just ran (``took_s``: its
        seconds with the agent layer's work around the engine step)."""
        shape = self.agent.engine.last_step
        if not self.cfg.step_log or shape is None:
            return
        decode = [c for q, c in zip(shape.query_lens, shape.context_lens, strict=True) if q == 1]
        self.steps.append({
            "t_s": round(t_s, 6), "phase": phase, "agent_step_s": round(took_s, 6),
            "engine_step_s": round(shape.seconds, 6), "seqs": len(shape.query_lens),
            "tokens": shape.num_tokens, "speculative_tokens": shape.speculative_tokens,
            "decode_rows": len(decode), "decode_context": sum(decode),
            "prefill_context": sum(shape.context_lens) - sum(decode),
            "restored_tokens": round(shape.restored_tokens, 1)})

    def _arrivals(self, t0: float) -> list[float]:
        """Arrival times of the top-level jobs (subagents start with their parent's call)."""
        if self.cfg.mode == "closed":
            return [t0] * len(self._top)
        rng = random.Random(self.cfg.seed)
        t, out = t0, []
        for _ in self._top:
            out.append(t)
            t += rng.expovariate(self.cfg.load)
        return out

    def _has_room(self) -> bool:
        """Another top-level job may start (open loop: always; closed: under the load)."""
        running = sum(1 for jr in self._active.values() if jr.parent is None)
        return self.cfg.mode == "open" or running < self.cfg.load

    def _admit(self, pending: list[int], arrivals: list[float], now: float) -> None:
        while pending and arrivals[pending[0]] <= now and self._has_room():
            i = pending.pop(0)
            self._start(self.jobs[self._top[i]],
                        arrivals[i] if self.cfg.mode == "open" else now)

    def _start(self, job: Job, admitted: float, parent: _JobRun | None = None) -> None:
        """Send the job's first turn: its agent type's shared prefix, then its own task."""
        jr = _JobRun(job, f"{self.run_id}/{job.job_id}", admitted, parent)
        shared = self._ids(job.agent, "prefix", job.prefix_tokens) if job.prefix_tokens else []
        own = self._ids(job.job_id, "system", job.system_tokens - job.prefix_tokens)
        jr.context = Context([*shared, *own])
        jr.kept = job.prefix_tokens if job.agent in self._seen_agents else 0
        self._seen_agents.add(job.agent)
        self._active[jr.sid] = jr
        rid = self._rid(jr, "t0")
        self.agent.add_request(rid, list(jr.context.ids), _params(job.turns[0]),
                               session_id=jr.sid)
        self._requests[rid] = (jr, "turn")

    def _next_wake(self, pending: list[int], arrivals: list[float], now: float) -> float:
        """The next moment something happens: an event, an arrival, a prefetch decision."""
        times = [self._events[0][0]] if self._events else []
        if pending and self._has_room():
            times.append(arrivals[pending[0]])
        if self.policy.prefetch or self.policy.rewarm:  # the engine prefetches at this point
            times += [t for jr in self._active.values() if jr.awaiting
                      and (t := jr.tool_start + self._expected(jr) - self.cfg.prefetch_lead_s)
                      > now]
        return min(times) if times else now

    def _fire(self, now: float) -> None:
        while self._events and self._events[0][0] <= now:
            _, _, kind, jr = heapq.heappop(self._events)
            if kind == "stream":
                call = _call_id(jr)
                self.agent.feed_tool_output(jr.sid, call, jr.result[: len(jr.result) // 2])
            elif kind == "user":
                self._send_user(jr, now)
            else:
                self._resume(jr, now)
        if self.policy.rewarm:
            for jr in self._active.values():
                if jr.rewarm_due and now >= jr.tool_start + self._expected(jr) - \
                        self.cfg.prefetch_lead_s:
                    self._rewarm(jr)

    # ------------------------------------------------------------------ turns
    def _on_output(self, out: Any) -> None:
        entry = self._requests.get(out.request_id)
        if entry is None:
            return
        jr, kind = entry
        if kind == "rewarm":
            if out.finished:
                del self._requests[out.request_id]
                self._extra_prefill += len(out.prompt_token_ids) - out.num_cached_tokens
            return
        if not jr.first_seen:
            jr.first_seen = True
            self._record_first(jr, out)
        if out.finished:
            del self._requests[out.request_id]
            self._turn_done(jr, list(out.prompt_token_ids), list(out.outputs[0].token_ids))

    def _record_first(self, jr: _JobRun, out: Any) -> None:
        now = self.clock()
        prompt = len(out.prompt_token_ids)
        self.turn_rows.append({
            "job": jr.job.job_id, "turn": jr.turn, "prompt_tokens": prompt,
            "cached_tokens": out.num_cached_tokens,
            "ttft_s": now - (jr.resumed_at if jr.resumed_at is not None else jr.admitted),
            "resume": jr.turn > 0, "turn_kind": jr.kind, "new_tokens": prompt - jr.kept,
            "agent": jr.job.agent, "subagent": jr.parent is not None})

    def _turn_done(self, jr: _JobRun, prompt: list[int], output: list[int]) -> None:
        turn = jr.job.turns[jr.turn]
        self.outputs[f"{jr.job.job_id}/{jr.turn}"] = hashlib.sha1(
            repr(output).encode()).hexdigest()[:16]
        if not turn.continues:
            self._job_done(jr)
            return
        if prompt != jr.context.ids:
            raise ReplayError(f"{jr.sid} turn {jr.turn}: the engine's prompt is not the one sent")
        before = len(prompt)
        jr.context.add_output(output, turn.reasoning_tokens)
        old = list(jr.context.ids)
        if turn.keep_tokens is not None and turn.keep_tokens < len(old):
            jr.context.keep(turn.keep_tokens)  # compaction: the rest is rewritten
            jr.context.reasoning = []
        if turn.tool is None:
            self._await_user(jr, turn, old)
            return
        if turn.reasoning_stripped:  # the template drops the first half of this output
            jr.context.cut(before, before + len(output) // 2)
        self._await(jr, turn, old)

    def _await(self, jr: _JobRun, turn: Turn, old: list[int]) -> None:
        assert turn.tool is not None
        ctx = jr.context
        jr.result = self._ids(f"{turn.tool}{turn.arguments}", jr.job.job_id if not
                              turn.cacheable else "cacheable", turn.result_tokens)
        jr.position = None if turn.mid_prompt is None else int(turn.mid_prompt * len(ctx.ids))
        cut = len(ctx.ids) if jr.position is None else jr.position
        head = [*ctx.ids[:cut], *BEFORE]
        ctx.insert(cut, [*BEFORE, *jr.result, *AFTER])
        ctx.ids.extend(SUFFIX)
        jr.next_prompt = list(ctx.ids)
        jr.kept = common_prefix(old, jr.next_prompt)
        call = ToolCall(_call_id(jr), turn.tool, turn.arguments)
        positions = {} if jr.position is None else {call.id: jr.position}
        self.agent.await_tools(jr.sid, [call], layout=TokenLayout(BEFORE, AFTER, SUFFIX,
                                                                   positions))
        now = self.clock()
        jr.tool_start = now
        self._predict(jr, turn, head)
        if turn.streamed and self.policy.streamed:
            self._push(now + turn.tool_s / 2, "stream", jr)
        if turn.subagent is not None:  # the call returns when the subagent's job ends
            self._start(self._subagents[turn.subagent], now, parent=jr)
        else:
            self._push(now + turn.tool_s, "resume", jr)
        jr.rewarm_due = self.policy.rewarm
        jr.awaiting = True

    def _await_user(self, jr: _JobRun, turn: Turn, old: list[int]) -> None:
        """The turn ended without a tool call: the user answers after ``user_s``; the
        reasoning since the last user message leaves the prompt."""
        self.agent.end_turn(jr.sid)
        ctx = jr.context
        ctx.drop_reasoning()
        message = self._ids(f"user{jr.turn}", jr.job.job_id, turn.user_tokens)
        ctx.ids.extend([*USER_BEFORE, *message, *USER_AFTER, *SUFFIX])
        jr.next_prompt = list(ctx.ids)
        jr.kept = common_prefix(old, jr.next_prompt)
        jr.user_start = self.clock()
        self._push(jr.user_start + turn.user_s, "user", jr)

    def _send_user(self, jr: _JobRun, now: float) -> None:
        jr.user_waited += now - jr.user_start
        jr.tool_waited += now - jr.user_start
        jr.turn += 1
        jr.kind = "user"
        jr.first_seen = False
        jr.resumed_at = self.clock()
        rid = self._rid(jr, f"t{jr.turn}")
        self.agent.add_request(rid, jr.next_prompt, _params(jr.job.turns[jr.turn]),
                               session_id=jr.sid)
        self._requests[rid] = (jr, "turn")

    def _predict(self, jr: _JobRun, turn: Turn, head: list[int]) -> None:
        """What the client (or a template-aware renderer) knows ahead of the result."""
        if turn.reasoning_stripped:
            if self.policy.predicted and turn.predictable:
                self.agent.predict_prompt(jr.sid, jr.next_prompt)
            elif self.policy.template:
                self.agent.predict_prompt(jr.sid, head)
        elif self.policy.predicted and turn.predictable:
            self.agent.predict_tool_result(jr.sid, _call_id(jr), jr.result)

    def _rewarm(self, jr: _JobRun) -> None:
        jr.rewarm_due = False
        cut = len(jr.next_prompt) - len(SUFFIX) - len(AFTER) - len(jr.result) if \
            jr.position is None else jr.position + len(BEFORE)
        rid = self._rid(jr, f"rewarm{jr.turn}")
        self.agent.add_request(rid, jr.next_prompt[:cut],
                               SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        self._requests[rid] = (jr, "rewarm")

    def _resume(self, jr: _JobRun, now: float) -> None:
        turn = jr.job.turns[jr.turn]
        assert turn.tool is not None
        if turn.subagent is None:  # a subagent's waits were added when it ended
            jr.tool_waited += now - jr.tool_start
        old = self._durations.get(turn.tool)
        elapsed = now - jr.tool_start
        self._durations[turn.tool] = elapsed if old is None else \
            DURATION_EMA * elapsed + (1 - DURATION_EMA) * old
        jr.rewarm_due = jr.awaiting = False
        jr.turn += 1
        jr.kind = "tool"
        jr.first_seen = False
        jr.resumed_at = self.clock()
        rid = self._rid(jr, f"t{jr.turn}")
        self.agent.resume(jr.sid, rid, [ToolResult(_call_id_at(jr, jr.turn - 1), jr.result,
                                                   jr.position)],
                          _params(jr.job.turns[jr.turn]), prompt=jr.next_prompt)
        self._requests[rid] = (jr, "turn")

    def _job_done(self, jr: _JobRun) -> None:
        now = self.clock()
        m = self.agent.session_metrics(jr.sid)
        for key in ("resumes", "tokens_reused", "tokens_recomputed", "tokens_speculated",
                    "spec_hits", "spec_partial", "spec_misses", "spec_gated"):
            self.sessions[key] = self.sessions.get(key, 0) + int(getattr(m, key))
        self.agent.close_session(jr.sid)
        jct = now - jr.admitted
        self.job_rows.append({"job": jr.job.job_id, "turns": len(jr.job.turns),
                              "jct_s": jct, "tool_s": jr.tool_waited,
                              "engine_wait_s": jct - jr.tool_waited,
                              "output_tokens": sum(t.output_tokens for t in jr.job.turns),
                              "user_s": jr.user_waited, "agent": jr.job.agent,
                              "subagent": jr.parent is not None})
        del self._active[jr.sid]
        if jr.parent is not None:  # the parent's call returns now
            jr.parent.tool_waited += jr.tool_waited
            self._push(now, "resume", jr.parent)
        self._on_job_done(jr.job.job_id)

    # ------------------------------------------------------------------ helpers
    def _declare_tools(self) -> None:
        """Tools whose every call in the trace is cacheable are declared idempotent."""
        calls: dict[str, bool] = {}
        for job in self.jobs:
            for t in job.turns:
                if t.tool is not None:
                    calls[t.tool] = calls.get(t.tool, True) and t.cacheable
        for name, cacheable in calls.items():
            self.agent.declare_tool(ToolSpec(name, cacheable=cacheable))

    def _expected(self, jr: _JobRun) -> float:
        tool = jr.job.turns[jr.turn].tool
        return self._durations.get(tool, 0.0) if tool is not None else 0.0

    def _push(self, t: float, kind: str, jr: _JobRun) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, jr))

    def _sample(self, t: float) -> None:
        c = read_counters(self.agent, self.reserved_pages)
        self.timeline.append({"t_s": t, "pages_used": c.pages_used,
                              "pages_total": c.pages_total,
                              "offloaded_bytes_held": c.offloaded_bytes_held,
                              "sessions": len(self._active),
                              **pages_by_state(c.pages_total, c.pages_used, c.cached_pages,
                                               c.offloaded_bytes_held, self.page_bytes)})

    def _rid(self, jr: _JobRun, what: str) -> str:
        return f"{jr.sid}/{what}"

    def _ids(self, key: str, salt: str, n: int) -> list[int]:
        """``n`` seeded token ids for ``(key, salt)``."""
        seed = int.from_bytes(hashlib.sha1(f"{key}|{salt}".encode()).digest()[:8], "little")
        rng = random.Random(seed)
        return [rng.randrange(FIRST_ID, self.vocab) for _ in range(n)]


def _params(turn: Turn) -> SamplingParams:
    n = turn.output_tokens
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)


def _call_id(jr: _JobRun) -> str:
    return _call_id_at(jr, jr.turn)


def _call_id_at(jr: _JobRun, turn: int) -> str:
    return f"{jr.job.job_id}-call{turn}"
