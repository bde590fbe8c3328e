"""`AgentEngine`: an `Engine` that knows each agent session's execution state.

One engine loop calls `step()`; sessions move through `SessionState` as their turns run::

    agent = AgentEngine()                                  # the embedded tiny model on the CPU
    agent.add_request("t0", prompt_ids, params, session_id="s")
    ... step() until "t0" finishes                          # session "s" is FINISHED
    agent.await_tools("s", [ToolCall("c1", "get_weather", '{"city": "Paris"}')],
                      messages=messages, tools=tools)       # AWAITING_TOOL: speculation starts
    agent.feed_tool_output("s", "c1", '{"temp')              # optional: streamed output
    agent.predict_tool_result("s", "c1", '{"temp": 21}')    # optional: a predicted result
    agent.predict_prompt("s", next_prompt_ids)               # optional: the whole next prompt
    ... step() keeps running other sessions; speculation uses the capacity they leave
    agent.resume("s", "t1", [ToolResult("c1", '{"temp": 21}')], params)  # RESUMING
    ... step(): the best branch is committed by slot swap, only what is new is prefilled

Not thread-safe: call every method from the thread that calls `step()`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn

from edmm.agent.errors import (
    AgentError,
    InsertionPositionError,
    QuotaExceededError,
    ToolOutputClosedError,
    UnknownSessionError,
    UnknownToolCallError,
)
from edmm.agent.gate import BranchPlan
from edmm.agent.learning import Outcome, ToolDurations, UsageStats, window_tool
from edmm.agent.owners import OwnerStats, OwnerUsage
from edmm.agent.prompt_index import PromptIndex
from edmm.agent.render import PromptRenderer, TemplateRenderer, TokenRenderer
from edmm.agent.retention import RETENTION_POLICIES, PausedSession
from edmm.agent.session import Session
from edmm.agent.speculation import (
    SPECULATION_SOURCES,
    Branch,
    PromptSource,
    Speculation,
    SpeculationSource,
    StreamFold,
    ToolWindow,
)
from edmm.agent.timers import TimerKind, Timers
from edmm.agent.types import (
    AgentConfig,
    AgentStats,
    SessionMetrics,
    SessionState,
    SessionTag,
    TokenLayout,
    ToolCall,
    ToolContent,
    ToolResult,
    ToolSpec,
)
from edmm.engine import (
    Engine,
    EngineConfig,
    EngineConfigError,
    EntryRank,
    PrefixHit,
    Request,
    RequestOutput,
    SamplingParams,
    SlotHints,
)
from edmm.engine.engine import PromptInput
from edmm.engine.prefix_cache import common_prefix_len
from edmm.model.prompt_encoder import PromptEncoder

Message = Mapping[str, Any]
S = SessionState
T = TimerKind
_BUSY = (S.GENERATING, S.RESUMING)
_CLOSABLE = (S.FINISHED, S.ABANDONED)  # what an owner at its session quota gives up first


class AgentEngine:
    """Agent sessions over an `Engine`: pause at tool calls, speculate in the tool window,
    commit the best branch zero-copy at resume.

    What happens at a time (a tool deadline, the end of a turn's report window, a paused
    session's retention rank to be computed again, its prefetch window) is a timer
    (`edmm.agent.timers`), run by `step` or, while no request runs, by `tick`
    (`next_timer_s` says when); sessions are found through indexes (by tool call id, by
    prompt prefix, by owner), so a step or a request costs the same however many sessions
    sit idle. Each owner's sessions count against the config's `KeyQuota` (`admit`) and its
    paused KV against its fair share of the pool (`edmm.agent.owners`).

    Args:
        engine: the engine to drive, or the config to build one (None: the tiny model).
            Prefix caching must be on: retained and speculated KV are cache entries.
        config: agent settings (speculation sources, retention policy, tool deadline).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, engine: Engine | EngineConfig | None = None,
                 config: AgentConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config if config is not None else AgentConfig()
        self._sources = [SPECULATION_SOURCES.create(n) for n in self.config.speculation]
        self._retention = RETENTION_POLICIES.create(self.config.retention)
        config_in = engine.config if isinstance(engine, Engine) else engine
        if config_in is not None and not config_in.enable_prefix_caching:
            raise EngineConfigError("agent sessions need enable_prefix_caching=True")
        self._owns_engine = not isinstance(engine, Engine)
        self.engine = engine if isinstance(engine, Engine) else Engine(engine)
        self._clock = clock
        self._sessions: dict[str, Session] = {}  # least recently used first
        self._timers = Timers()
        self._prefetching: set[str] = set()  # sessions in their prefetch window
        self._by_call: dict[tuple[str | None, str], str] = {}  # (owner, call id) -> session
        self._finished = PromptIndex()  # FINISHED sessions by their last prompt
        self._owners: dict[str | None, OwnerUsage] = {}
        self._page_tokens = max(1, self.engine.kv.tokens_in_pages(1))
        self._pool_pages = self.engine.kv.stats().pages_total
        self._turns = itertools.count()  # session turns' arrival numbers (admission order)
        self._by_request: dict[str, str] = {}  # request id -> session id
        self._closed_totals: Counter[str] = Counter()  # counters of closed sessions
        self._tools: dict[str, ToolSpec] = {}
        self._durations = ToolDurations()  # per tool name: a log-normal of its seconds
        self._usage_stats = UsageStats()  # branch outcomes per (source, tool), all sessions
        self._memo: dict[tuple[str, str], ToolContent] = {}  # idempotent calls' results
        tok = self.engine.tokenizer  # template renders reuse the ids of earlier ones
        self._encoder = PromptEncoder(tok) if tok is not None else None

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (None for presets without one)."""
        return self.engine.tokenizer

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: PromptInput,
                    params: SamplingParams | None = None, *,
                    session_id: str | None = None) -> None:
        """Validate and queue a request (`Engine.make_request`, then `submit`)."""
        self.submit(self.engine.make_request(request_id, prompt, params), session_id)

    def submit(self, request: Request, session_id: str | None = None, *,
               owner: str | None = None) -> None:
        """Queue a validated request; with ``session_id``, a turn of that session (created if
        new, belonging to ``owner``; a FINISHED session takes its next user turn). Raises
        `SessionStateError` if the session is generating, awaiting a tool (use `resume`) or
        abandoned."""
        if session_id is None:
            self.engine.submit(request)
            return
        session = self._sessions.get(session_id)
        if session is not None:
            session.require(S.FINISHED, "a new turn")
        number = next(self._turns)
        if session is None:
            session = Session(session_id, owner=owner, ordinal=number)
        self._submit_turn(session, request, claim=(), resume=False, number=number)
        session.transition(S.GENERATING)
        self._touch(session)

    def admit(self, owner: str | None, session_id: str, prompt_tokens: int,
              may_await: bool) -> None:
        """Check a turn of ``owner``'s session ``session_id`` (new or not) against the
        config's `KeyQuota` before it is queued: raises `QuotaExceededError` (nothing
        changed) for a turn that may end in tool calls (``may_await``) while the owner has
        ``max_awaiting`` other sessions awaiting theirs, for a prompt of ``prompt_tokens``
        that would take its running turns past ``max_kv_pages``, and for a new session past
        ``max_sessions`` when none of the owner's sessions is finished or abandoned; else
        such a one, the least recently used, is closed to make room."""
        usage, quota = self._owners.get(owner), self.config.quota
        if usage is None:
            return  # nothing held yet
        if may_await and quota.max_awaiting is not None and (
                len(usage.awaiting) - (session_id in usage.awaiting) >= quota.max_awaiting):
            self._refuse(usage, owner, "awaiting", quota.max_awaiting)
        running = usage.running_pages - usage.running.get(session_id, 0)
        if quota.max_kv_pages is not None and running and (
                running + self._pages(prompt_tokens) > quota.max_kv_pages):
            self._refuse(usage, owner, "kv_pages", quota.max_kv_pages)
        if (session_id not in self._sessions and quota.max_sessions is not None
                and len(usage.sessions) >= quota.max_sessions):
            victim = next((sid for sid in usage.sessions
                           if self._sessions[sid].state in _CLOSABLE), None)
            if victim is None:
                self._refuse(usage, owner, "sessions", quota.max_sessions)
            self.close_session(victim)

    def _refuse(self, usage: OwnerUsage, owner: str | None, resource: str,
                limit: int) -> NoReturn:
        usage.refused[resource] += 1
        retry = 1.0
        deadline = usage.earliest_deadline() if resource != "kv_pages" else None
        if deadline is not None:
            retry = max(retry, deadline - self._clock())
        raise QuotaExceededError(owner, resource, limit, retry)

    def step(self) -> list[RequestOutput]:
        """One engine step, with the timers due (`tick`) before it and the prefetches of
        paused sessions near their tool's expected return after it. Returns the outputs of
        requests that got a token."""
        self.tick()
        outputs = self.engine.step()
        for out in outputs:
            session_id = self._by_request.get(out.request_id)
            if session_id is not None:
                self._on_output(self._sessions[session_id], out)
        if self._prefetching:
            self._prefetch()
        return outputs

    def tick(self) -> int:
        """Run the timers that are due (abandon sessions past their tool deadline, end
        report windows, rank paused sessions' KV again); how many ran. `step` calls it; a
        server calls it while no request runs, at `next_timer_s`."""
        due = self._timers.due(self._clock())
        for session_id, kind in due:
            session = self._sessions.get(session_id)
            if session is not None:
                self._on_timer(session, kind)
        return len(due)

    def next_timer_s(self) -> float | None:
        """Seconds until the next timer is due (0: now; None: there is none)."""
        due = self._timers.next_due()
        return None if due is None else max(0.0, due - self._clock())

    def has_unfinished(self) -> bool:
        """True while any request (not speculation) waits or runs."""
        return self.engine.has_unfinished()

    def has_speculation(self) -> bool:
        """True while some speculation branch is still being prefilled."""
        return self.engine.has_speculation()

    def abort(self, request_id: str) -> bool:
        """Stop a request; its session (if any) becomes FINISHED. False if unknown."""
        session_id = self._by_request.pop(request_id, None)
        found = self.engine.abort(request_id)
        if session_id is not None:
            session = self._sessions[session_id]
            if session.window is not None:
                self._drop_branches(session, session.window)
            session.request_id = None
            session.window = None
            session.resume_started = None
            session.previous = []
            session.transition(S.FINISHED)
            session.unreported = False  # an aborted turn has no calls to await
            self._usage(session).stop(session.id)
            self._finished.add(session.id, session.owner, session.context, session.prompt_len)
        return found

    # ------------------------------------------------------------------ tool window
    def declare_tool(self, spec: ToolSpec) -> None:
        """Declare a tool's properties (idempotent -> results memoised, expected duration)."""
        self._tools[spec.name] = spec

    def await_tools(self, session_id: str, tool_calls: Sequence[ToolCall], *,
                    messages: Sequence[Message] | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    layout: TokenLayout | None = None,
                    expected_duration_s: float | None = None,
                    predictions: Mapping[str, ToolContent] | None = None,
                    deadline_s: float | None = None) -> None:
        """The session's last turn ended in ``tool_calls``: FINISHED -> AWAITING_TOOL.

        ``messages`` (the conversation as the client will send it back, up to and including
        the assistant message with the tool calls) and ``tools`` let the template source render
        the next prompt with the chat template; without them the next prompt follows
        ``layout`` (token ids). ``predictions``: call id -> predicted result.
        ``deadline_s``: seconds until the session is abandoned (default: the config's).
        ``expected_duration_s``: the client's estimate of how long the tools run; None: the
        median of each tool's learned durations once trusted, else its declared one
        (`declare_tool`), the longest of the calls' (it ranks the session's KV and times its
        prefetch). Raises `SessionStateError` unless the session's turn has finished,
        `UnknownToolCallError` for predictions or positions of other calls,
        `InsertionPositionError` for a layout position outside the context.
        """
        session = self._get(session_id)
        session.require(S.FINISHED, "await_tools")
        session.unreported = False
        calls = _check_calls(tool_calls)
        for call_id in [*(predictions or {}), *(layout.positions if layout else {})]:
            if call_id not in calls:
                raise UnknownToolCallError(session_id, call_id)
        for pos in (layout.positions.values() if layout else ()):
            self._check_position(session, pos)
        renderer = self._renderer(session, calls, messages, tools, layout)
        now = self._clock()
        deadline = deadline_s if deadline_s is not None else self.config.tool_timeout_s
        expected = expected_duration_s if expected_duration_s is not None else \
            self._expected_duration(calls.values())
        window = ToolWindow(calls, renderer, now, now + deadline, expected,
                            max_tokens=self.engine.max_model_len)
        window.predictions.update(self._memoised(calls.values()))
        window.predictions.update(predictions or {})
        session.window = window
        session.ended_at = None  # reported: the window's retention replaces the hold
        self._timers.cancel(session.id, T.HOLD_END)
        session.transition(S.AWAITING_TOOL)
        self._finished.remove(session.id)
        for call_id in calls:
            self._by_call[(session.owner, call_id)] = session.id
        self._usage(session).awaiting[session.id] = window.deadline
        self._timers.set(session.id, T.DEADLINE, window.deadline)
        if self.config.prefetch and expected is not None:
            self._timers.set(session.id, T.PREFETCH,
                             window.started + expected - self.config.prefetch_lead_s)
        self._apply_retention(session)
        self._fit_shares(session)
        self._run_sources(session, lambda src: src.on_await(window))

    def end_turn(self, session_id: str) -> None:
        """The session's last turn ended without tool calls: its KV, held since the turn
        ended (`AgentConfig.report_window_s`), becomes an ordinary prefix-cache entry. A no-op
        once reported or past the window; `SessionStateError` unless the session's turn has
        finished."""
        session = self._get(session_id)
        session.require(S.FINISHED, "end_turn")
        session.unreported = False
        if session.ended_at is not None:
            self._release(session)

    def feed_tool_output(self, session_id: str, call_id: str, chunk: ToolContent, *,
                         final: bool = False) -> None:
        """Append partial output of a running tool; it is prefilled incrementally (only the
        new chunk is tokenized, up to the context). ``final``: the output is complete, later
        chunks are refused. Raises `UnknownToolCallError`, `SessionStateError`,
        `ToolOutputClosedError`, `AgentError` (text and token ids mixed); on error nothing
        changes."""
        window = self._window(session_id, call_id, "feed_tool_output")
        if call_id in window.closed:
            raise ToolOutputClosedError(session_id, call_id)
        fold = window.streamed.get(call_id)
        if fold is not None and fold.is_text != isinstance(chunk, str):
            raise AgentError("streamed output mixes text and token ids")
        if fold is None:
            fold = window.streamed[call_id] = StreamFold(isinstance(chunk, str))
        if final:
            window.closed.add(call_id)
        self._run_sources(self._sessions[session_id],
                          lambda src: src.on_output(window, call_id, chunk))

    def predict_tool_result(self, session_id: str, call_id: str, result: ToolContent, *,
                            position: int | None = None) -> None:
        """Predict a pending call's result, inserted at token ``position`` of the context (or
        where the layout puts it; the position applies to this prediction only, not to the real
        result): the next prompt with it is prefilled in a branch.
        Raises `UnknownToolCallError`, `InsertionPositionError`, `SessionStateError`."""
        window = self._window(session_id, call_id, "predict_tool_result")
        session = self._sessions[session_id]
        if position is not None:
            self._check_position(session, position)
            window.renderer.with_positions({call_id: position})  # a template cannot
            window.predicted_positions[call_id] = position
        window.predictions[call_id] = result
        self._run_sources(session, lambda src: src.on_predict(window, call_id))

    def predict_prompt(self, session_id: str, prompt: PromptInput) -> None:
        """Predict the session's whole next prompt (text or token ids) exactly as the client
        will send it at resume, e.g. with a result inserted into an earlier message: it is
        prefilled in a branch from its longest common token prefix with the session's KV (the
        ``prompt`` source). A later prediction replaces it. Raises `SessionStateError` unless
        the session awaits its tools, `InvalidRequestError` for an empty prompt, one longer
        than ``max_model_len`` or token ids outside the vocabulary; on error nothing changes."""
        session = self._get(session_id)
        session.require(S.AWAITING_TOOL, "predict_prompt")
        window = session.window
        assert window is not None
        spec_id = _spec_id(SessionTag.branch(session_id, PromptSource.name))
        window.predicted_prompt = self.engine.make_request(spec_id, prompt).prompt_token_ids
        self._run_sources(session, lambda src: src.on_prompt(window))

    def resume(self, session_id: str, request_id: str, results: Sequence[ToolResult],
               params: SamplingParams | None = None, *,
               prompt: PromptInput | None = None) -> None:
        """Results arrived: AWAITING_TOOL -> RESUMING, and queue the resume turn.

        ``prompt``: the next prompt exactly as the client sent it (text or ids); None: rendered
        from ``results`` (chat template if the session has messages, else its token layout).
        At admission the longest common token prefix with each branch (and the retained KV)
        is found, the best is committed by slot swap and truncated after the match, and only
        the rest is prefilled. All checks happen first (`SessionStateError`,
        `UnknownToolCallError`, `InsertionPositionError`): on error nothing changes.
        """
        started = self._clock()
        window = self._resumable(session_id, results)
        if prompt is None:
            positions = {r.call_id: r.position for r in results if r.position is not None}
            renderer = window.renderer.with_positions(positions)
            prompt = renderer.render({r.call_id: r.content for r in results})
        self._resume(session_id, self.engine.make_request(request_id, prompt, params), results,
                     started)

    def resume_request(self, session_id: str, request: Request,
                       results: Sequence[ToolResult]) -> None:
        """`resume` with the next prompt already validated (``request``, built once by the
        caller, e.g. the server); the same checks, and on error nothing changes."""
        started = self._clock()
        self._resumable(session_id, results)
        self._resume(session_id, request, results, started)

    def _resumable(self, session_id: str, results: Sequence[ToolResult]) -> ToolWindow:
        """The window that ``results`` resume (every check of `resume`, nothing changed)."""
        session = self._get(session_id)
        session.require(S.AWAITING_TOOL, "resume")
        window = session.window
        assert window is not None
        for r in results:
            if r.call_id not in window.calls:
                raise UnknownToolCallError(session_id, r.call_id)
            if r.position is not None:
                self._check_position(session, r.position)
        return window

    def _resume(self, session_id: str, request: Request, results: Sequence[ToolResult],
                started: float) -> None:
        session = self._sessions[session_id]
        window = session.window
        assert window is not None
        self._stop_speculation(session, window)
        self._learn(window, results, started)
        claim = tuple(SessionTag.branch(session_id, key) for key in sorted(window.branches))
        self._close_window(session)
        self._submit_turn(session, request, claim, resume=True, number=next(self._turns))
        session.resume_started = started
        session.transition(S.RESUMING)
        self._touch(session)

    # ------------------------------------------------------------------ sessions
    def session_state(self, session_id: str) -> SessionState:
        """The session's state (`UnknownSessionError` if there is none)."""
        return self._get(session_id).state

    def session_context(self, session_id: str) -> list[int]:
        """Token ids of the session's conversation as the engine last saw it (a copy): the
        last turn's prompt, and its output once the turn finished."""
        return list(self._get(session_id).context)

    def session_metrics(self, session_id: str) -> SessionMetrics:
        """The session's counters (a copy)."""
        m = self._get(session_id).metrics
        return dataclasses.replace(m, resume_ttft_s=list(m.resume_ttft_s),
                                   commit_s=list(m.commit_s))

    def session_ids(self) -> list[str]:
        """Ids of every session, abandoned ones included, least recently used first."""
        return list(self._sessions)

    def has_session(self, session_id: str) -> bool:
        """True if the session exists (in any state, abandoned included)."""
        return session_id in self._sessions

    def pending_calls(self, session_id: str) -> list[str]:
        """Ids of the tool calls the session awaits (empty unless AWAITING_TOOL)."""
        session = self._get(session_id)
        if session.state != S.AWAITING_TOOL or session.window is None:
            return []
        return list(session.window.calls)

    def session_owner(self, session_id: str) -> str | None:
        """The owner the session was created for (`UnknownSessionError` if there is none)."""
        return self._get(session_id).owner

    def session_awaiting(self, call_id: str, owner: str | None = None) -> str | None:
        """The session of ``owner`` awaiting the result of tool call ``call_id``, if any."""
        session_id = self._by_call.get((owner, call_id))
        session = self._sessions.get(session_id) if session_id is not None else None
        if session is None or session.state != S.AWAITING_TOOL:
            return None
        return session.id

    def finished_request(self, session_id: str) -> str | None:
        """The request id of the session's last turn that finished (not aborted)."""
        return self._get(session_id).finished_request_id

    def last_request(self, session_id: str) -> str | None:
        """The request id of the session's last turn (running, finished or aborted)."""
        return self._get(session_id).last_request_id

    def find_session(self, prompt_token_ids: Sequence[int], owner: str | None = None, *,
                     reported: bool = False) -> str | None:
        """The FINISHED session of ``owner`` whose last turn's prompt is the longest prefix of
        ``prompt_token_ids`` (a server without a session id finds a conversation this way:
        the next request repeats the last prompt, then the reply as re-rendered). A session
        awaiting tools is never found this way: only its id or its call ids resume it.
        ``reported``: only a session whose last turn's end was reported (`end_turn`,
        `await_tools`) or aborted, since one not reported yet may still await tools (a
        server whose requests race the report of the turn before passes it)."""
        prompt = prompt_token_ids if isinstance(prompt_token_ids, list) else list(
            prompt_token_ids)

        def match(session_id: str) -> int:
            session = self._sessions[session_id]
            if reported and session.unreported:
                return -1
            n = session.prompt_len
            if n <= len(prompt) and common_prefix_len(session.context, prompt, n) == n:
                return n
            return -1

        return self._finished.find(owner, prompt, match)

    def stats(self) -> AgentStats:
        """The live sessions by state and the session counters summed since start."""
        totals = Counter(self._closed_totals)
        states: Counter[str] = Counter()
        for session in self._sessions.values():
            states[session.state.name.lower()] += 1
            totals.update(_counters(session.metrics))
        return AgentStats(sessions=dict(states), **totals)

    def close_session(self, session_id: str) -> None:
        """Abort its request, drop its speculation and retained KV, forget it."""
        session = self._get(session_id)
        if session.request_id is not None:
            self._by_request.pop(session.request_id, None)
            self.engine.abort(session.request_id)
        self._drop_kv(session)
        self._usage_stats.forget(session_id)
        self._closed_totals.update(_counters(session.metrics))
        self._close_window(session)
        self._timers.cancel(session_id)
        self._finished.remove(session_id)
        usage = self._usage(session)
        usage.forget(session_id)
        if not usage.sessions:
            del self._owners[session.owner]
        del self._sessions[session_id]

    def owner_stats(self) -> dict[str | None, OwnerStats]:
        """What each owner with live sessions holds (`OwnerStats`)."""
        return {owner: usage.stats() for owner, usage in self._owners.items()}

    def check_integrity(self) -> None:
        """Raise if a session breaks its state's invariants, the engine its own, or the two
        disagree (speculation or KV tagged for no session, abandoned sessions holding KV)."""
        self.engine.check_integrity()
        live_specs = set(self.engine.speculation_ids())
        owned_tags: set[SessionTag] = set()
        for session in self._sessions.values():
            live_specs -= self._check_session(session, live_specs)
            owned_tags |= self._tags(session)
        if live_specs:
            raise AgentError(f"speculation without a session: {sorted(live_specs)}")
        stray = {t for t in self.engine.kv.tags() if isinstance(t, SessionTag)} - owned_tags
        if stray:
            raise AgentError(f"KV tagged for no session: {sorted(stray, key=repr)}")

    def close(self) -> None:
        """Close every session and the engine (if this object built it)."""
        for session_id in list(self._sessions):
            self.close_session(session_id)
        if self._owns_engine:
            self.engine.close()

    def __enter__(self) -> AgentEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _check_session(self, session: Session, live_specs: set[str]) -> set[str]:
        """Check one session against the engine; return the speculation ids it owns."""
        session.check()
        if session.request_id is not None and (
                self._by_request.get(session.request_id) != session.id):
            raise AgentError(f"session {session.id!r}: request map out of sync")
        if session.state == S.ABANDONED and any(
                self.engine.kv.tagged(t) for t in (SessionTag.session(session.id),
                                                   SessionTag.lost(session.id))):
            raise AgentError(f"abandoned session {session.id!r} still holds KV")
        window = session.window
        owned = live_specs & (self._spec_ids(session, window) if window is not None else set())
        if owned and session.state != S.AWAITING_TOOL:
            raise AgentError(f"session {session.id!r} speculates in {session.state}")
        return owned

    def _tags(self, session: Session) -> set[SessionTag]:
        """The tags the session's KV may carry: its own, its open window's branches, the
        branches that lost at its resumes."""
        keys = session.window.branches if session.window is not None else set()
        return {SessionTag.session(session.id), SessionTag.lost(session.id),
                *(SessionTag.branch(session.id, k) for k in keys)}

    def _get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSessionError(f"no session {session_id!r}")
        return session

    def _window(self, session_id: str, call_id: str, action: str) -> ToolWindow:
        session = self._get(session_id)
        session.require(S.AWAITING_TOOL, action)
        assert session.window is not None
        if call_id not in session.window.calls:
            raise UnknownToolCallError(session_id, call_id)
        return session.window

    def _check_position(self, session: Session, position: int) -> None:
        if not 0 <= position <= len(session.context):
            raise InsertionPositionError(session.id, position, len(session.context))

    def _renderer(self, session: Session, calls: dict[str, ToolCall],
                  messages: Sequence[Message] | None, tools: Sequence[Mapping[str, Any]] | None,
                  layout: TokenLayout | None) -> PromptRenderer:
        if messages is None:
            return TokenRenderer(tuple(session.context), tuple(calls.values()),
                                 layout if layout is not None else TokenLayout(),
                                 self.tokenizer)
        if self.tokenizer is None:
            raise AgentError("messages need a tokenizer with a chat template")
        if layout is not None:
            raise AgentError("pass messages (chat template) or a token layout, not both")
        return TemplateRenderer(self.tokenizer, tuple(messages), tuple(calls.values()),
                                tuple(tools) if tools is not None else None,
                                self.config.reserialize_arguments, self._encoder)

    def _submit_turn(self, session: Session, request: Request, claim: tuple[SessionTag, ...],
                     resume: bool, number: int) -> None:
        """Queue a turn (the ``number``-th session turn to arrive) whose slot is the session's
        (tagged) and may adopt ``claim``, at its place in the `AgentConfig.admission` order."""
        key = self._admission_key(session, resume, number)
        if key is not None:
            request = dataclasses.replace(request, priority=key)
        rank, priority = self._retention.retention(
            PausedSession(len(request.prompt_token_ids), False, None))
        self.engine.submit(request, SlotHints(SessionTag.session(session.id), rank, priority, claim,
                                              stale_tag=SessionTag.lost(session.id)))
        prompt = request.prompt_token_ids
        self._end_hold(session)
        self._finished.remove(session.id)
        self._usage(session).run(session.id, self._pages(len(prompt)))
        session.previous = session.context  # compared with the prompt when the turn ends
        session.request_id = session.last_request_id = request.request_id
        session.cache_salt = request.cache_salt
        session.context = prompt  # the request's own list, never changed: no copy of it
        session.prompt_len = len(prompt)
        self._by_request[request.request_id] = session.id

    def _admission_key(self, session: Session, resume: bool, number: int) -> float | None:
        """The turn's admission priority (`Request.priority`: lower first, then arrival), or
        None under ``arrival`` (the request's own). Session turns are numbered in arrival
        order (``number``); a key is the number a turn is ordered as:

        - ``program``: its session's first turn's number;
        - ``resumes-first``: a resume ahead of every other turn, another turn its own number;

        but never below ``number - admission_jump - 0.5`` (the half: a tie goes to the turn
        that arrived first). A key is at most its turn's own number, so turn ``j`` goes ahead
        of an earlier turn ``i`` only if ``j <= i + admission_jump``: no turn is overtaken by
        more than ``admission_jump`` later ones, whatever its kind. ``admission_jump`` None:
        no bound (a resume's key under ``resumes-first`` is -1, below every number)."""
        order, jump = self.config.admission, self.config.admission_jump
        if order == "arrival":
            return None
        earliest = -1.0 if jump is None else number - jump - 0.5
        if order == "program":
            return max(float(session.ordinal), earliest)
        return earliest if resume else float(number)

    def _touch(self, session: Session) -> None:
        """Make ``session`` the most recently used; while more than ``max_sessions`` are
        kept, close the least recently used session that is not generating of the owner
        with the most sessions (one owner's flood closes its own sessions first)."""
        self._sessions.pop(session.id, None)
        self._sessions[session.id] = session
        mine = self._usage(session).sessions
        mine.pop(session.id, None)
        mine[session.id] = None
        while len(self._sessions) > self.config.max_sessions:
            victim = self._victim()
            if victim is None:
                return
            self.close_session(victim)

    def _victim(self) -> str | None:
        """The least recently used session not generating of the owner holding the most
        sessions (the next owner if all of that one's are generating)."""
        for usage in sorted(self._owners.values(), key=lambda u: -len(u.sessions)):
            for session_id in usage.sessions:
                if self._sessions[session_id].state not in _BUSY:
                    return session_id
        return None

    def _usage(self, session: Session) -> OwnerUsage:
        """The usage record of the session's owner (made if new)."""
        usage = self._owners.get(session.owner)
        if usage is None:
            usage = self._owners[session.owner] = OwnerUsage()
        return usage

    def _pages(self, num_tokens: int) -> int:
        """KV pages that ``num_tokens`` tokens take."""
        return -(-num_tokens // self._page_tokens)

    def _on_output(self, session: Session, out: RequestOutput) -> None:
        if session.state == S.RESUMING:
            self._on_resumed(session, out)
        if out.finished:
            session.context = out.prompt_token_ids + out.outputs[0].token_ids
            self._by_request.pop(out.request_id, None)
            session.request_id = None
            session.finished_request_id = out.request_id
            session.metrics.turns += 1
            session.metrics.context_tokens_recomputed += _recomputed(
                session.previous, out.prompt_token_ids, out.num_cached_tokens)
            session.previous = []
            session.transition(S.FINISHED)
            session.unreported = True
            self._usage(session).stop(session.id)
            self._finished.add(session.id, session.owner, session.context, session.prompt_len)
            if self.config.report_window_s > 0:
                session.ended_at = self._clock()
                self._timers.set(session.id, T.HOLD_END,
                                 session.ended_at + self.config.report_window_s)
                self._hold(session)
                self._fit_shares(session)

    def _on_resumed(self, session: Session, out: RequestOutput) -> None:
        """First token of a resume: record what was reused, drop the losing branches."""
        assert session.window is not None and session.resume_started is not None
        m = session.metrics
        m.resumes += 1
        m.resume_ttft_s.append(self._clock() - session.resume_started)
        m.tokens_reused += out.num_cached_tokens
        m.tokens_recomputed += len(out.prompt_token_ids) - out.num_cached_tokens
        if out.prefix_hit is not None:
            m.commit_s.append(out.prefix_hit.seconds)
        self._classify(session, out.prefix_hit, len(out.prompt_token_ids))
        # The losing branches become speculation entries under the session's "lost" tag: no
        # unmapping here, on the resume's critical path; they are reused or evicted first
        # like any other, and freed with the session.
        tags = [SessionTag.branch(session.id, k) for k in session.window.branches]
        self.engine.kv.retag(tags, SessionTag.lost(session.id), EntryRank.SPECULATIVE)
        session.window = None
        session.resume_started = None
        session.transition(S.GENERATING)

    def _classify(self, session: Session, hit: PrefixHit | None, prompt_len: int) -> None:
        """Speculation hit (a branch, or the session's slot speculated in place, matched
        entirely), partial, or miss, for the session's counters; and each speculation's own
        outcome (the adopted one's hit or partial, a miss for every other) for its source and
        tool (`UsageStats`)."""
        window = session.window
        assert window is not None
        started = [(SessionTag.branch(session.id, k), b) for k, b in window.branches.items()]
        if window.in_place is not None and window.in_place_branch is not None:
            started.append((SessionTag.session(session.id), window.in_place_branch))
        if not started:
            return
        claimed = None
        for tag, branch in started:
            outcome = Outcome.MISS
            if hit is not None and hit.claimed == tag and (
                    tag != SessionTag.session(session.id) or hit.num_tokens > window.own_tokens):
                full = hit.num_tokens >= min(hit.source_tokens, prompt_len - 1)
                claimed = outcome = Outcome.HIT if full else Outcome.PARTIAL
            self._usage_stats.record(session.id, branch.source, branch.tool, outcome)
        m = session.metrics
        if claimed is None:
            m.spec_misses += 1
        elif claimed is Outcome.HIT:
            m.spec_hits += 1
        else:
            m.spec_partial += 1

    def _run_sources(self, session: Session,
                     hook: Callable[[SpeculationSource], list[Speculation]]) -> None:
        for source in self._sources:
            for spec in hook(source):
                self._speculate(session, spec, source.name)

    def _speculate(self, session: Session, spec: Speculation, source: str) -> None:
        window = session.window
        assert window is not None
        ids = spec.token_ids
        if not ids or len(ids) > self.engine.max_model_len:
            return
        calls = window.calls.values() if spec.call_id is None else [window.calls[spec.call_id]]
        branch = Branch(source, window_tool(c.name for c in calls))
        # The session's KV: all of its context but the last token, which has none.
        own = len(session.context) - 1
        if self._goes_in_place(session, window, spec, own):
            self._speculate_in_place(session, window, spec, branch, own)
            return
        tag = SessionTag.branch(session.id, spec.key)
        # The branch extends the session's KV: dropped if that KV is gone by the time it is
        # admitted.
        base = max(min(common_prefix_len(session.context, ids), own), 0)
        layout = self.engine.kv.layout()
        new_pages = self.engine.kv.pages_for(len(ids)) - layout.full_pages(base)
        if not self._branch_pays(session, branch, len(ids) - base, layout.full_pages(base),
                                 new_pages):
            session.metrics.spec_gated += 1
            return
        self.engine.speculate(_spec_id(tag), ids,
                              SlotHints(tag, EntryRank.SPECULATIVE, min_cached=base,
                                        cache_salt=session.cache_salt,
                                        stale_tag=SessionTag.lost(session.id)))
        window.branches[spec.key] = branch

    def _goes_in_place(self, session: Session, window: ToolWindow, spec: Speculation,
                       own: int) -> bool:
        """Whether ``spec`` is prefilled in the session's own slot: it continues all of the
        session's KV (no fork before its end), and the slot is free for it. One key at a time
        extends the slot: the first whose speculation continues the session's KV (by default
        the template source's, whose prompt up to the first result begins every other
        source's), its later speculations (cutting back only its own speculated tokens), or
        another key's speculation that continues all the tokens the slot's key asked for (a
        predicted result after the template: nothing is cut). Every other speculation branches,
        so no source's guess cuts off tokens another speculated in place."""
        ids = spec.token_ids
        if (not self.config.speculate_in_place or own < 1 or len(ids) <= own
                or common_prefix_len(session.context, ids, own) < own):
            return False
        prior = window.in_place_ids
        return (window.in_place is None or window.in_place == spec.key
                or common_prefix_len(prior, ids) == len(prior))

    def _speculate_in_place(self, session: Session, window: ToolWindow, spec: Speculation,
                            branch: Branch, own: int) -> None:
        """Prefill ``spec`` in the session's own slot after its KV (replacing the window's
        speculation in place, continued from the tokens the two share)."""
        ids, kv = spec.token_ids, self.engine.kv
        start = max(own, common_prefix_len(window.in_place_ids, ids)) if window.in_place else own
        if not self._branch_pays(session, branch, len(ids) - start, 0,
                                 kv.pages_for(len(ids)) - kv.pages_for(start)):
            session.metrics.spec_gated += 1
            return
        tag = SessionTag.session(session.id)
        self.engine.speculate(_spec_id(tag), ids,
                              SlotHints(tag, EntryRank.SPECULATIVE, min_cached=own,
                                        cache_salt=session.cache_salt, in_place=True))
        window.in_place, window.in_place_ids, window.own_tokens = spec.key, list(ids), own
        window.in_place_branch = branch
        session.metrics.spec_in_place += 1

    def _branch_pays(self, session: Session, branch: Branch, new_tokens: int,
                     shared_pages: int, new_pages: int) -> bool:
        """The config's gate on a speculation of ``new_tokens`` on a slot mapping
        ``shared_pages`` pages of the session's KV (0 in place) and ``new_pages`` of its own,
        judged on how ``branch``'s source fared for its tool (no gate: always)."""
        gate = self.config.speculation_gate
        if gate is None:
            return True
        kv, stats = self.engine.kv, self._usage_stats
        plan = BranchPlan(
            new_tokens=new_tokens, shared_pages=shared_pages, new_pages=max(new_pages, 0),
            others=stats.others(session.id, branch.source, branch.tool),
            own=stats.own(session.id, branch.source, branch.tool),
            engine_idle=not self.engine.has_unfinished(),
            padding_free=self.engine.padding_free,
            token_s=self.engine.step_cost.per_token_s(), page_s=kv.page_seconds())
        return gate.pays(plan)

    def _stop_speculation(self, session: Session, window: ToolWindow) -> None:
        """Stop the window's prefills where they are (their KV stays claimable: a branch's
        under its tag, the one in place in the session's own entry)."""
        tags = [SessionTag.branch(session.id, key) for key in window.branches]
        if window.in_place is not None:
            tags.append(SessionTag.session(session.id))
        for tag in tags:
            self.engine.stop_speculation(_spec_id(tag))
            session.metrics.tokens_speculated += self.engine.take_speculated_tokens(tag)

    def _drop_branches(self, session: Session, window: ToolWindow) -> None:
        self._stop_speculation(session, window)
        self.engine.kv.discard(SessionTag.branch(session.id, k) for k in window.branches)

    def _drop_kv(self, session: Session) -> None:
        if session.window is not None:
            self._drop_branches(session, session.window)
        self.engine.kv.discard([SessionTag.session(session.id), SessionTag.lost(session.id)])

    def _on_timer(self, session: Session, kind: TimerKind) -> None:
        """A timer of ``session`` came up (`tick`)."""
        if kind is T.DEADLINE and session.state == S.AWAITING_TOOL:
            self._abandon(session)
        elif kind is T.HOLD_END and session.ended_at is not None:
            self._release(session)
        elif kind is T.RANK and session.state == S.AWAITING_TOOL:
            self._apply_retention(session)
        elif kind is T.RANK and session.ended_at is not None:
            self._hold(session)
        elif kind is T.PREFETCH and session.state == S.AWAITING_TOOL:
            self._prefetching.add(session.id)

    def _abandon(self, session: Session) -> None:
        """The session's tool window passed its deadline: drop its KV, close the window."""
        self._drop_kv(session)
        self._close_window(session)
        session.window = None
        session.metrics.abandoned = True
        session.transition(S.ABANDONED)

    def _close_window(self, session: Session) -> None:
        """The session leaves AWAITING_TOOL (resumed, abandoned, closed): forget its calls,
        its window's timers and its retention."""
        window = session.window
        if window is None or session.state != S.AWAITING_TOOL:
            return
        for call_id in window.calls:
            if self._by_call.get((session.owner, call_id)) == session.id:
                del self._by_call[(session.owner, call_id)]
        usage = self._usage(session)
        usage.awaiting.pop(session.id, None)
        usage.release(session.id)
        session.demoted = False
        self._timers.cancel(session.id, T.DEADLINE, T.RANK, T.PREFETCH)
        self._prefetching.discard(session.id)

    def _prefetch(self) -> None:
        """Copy back the offloaded KV of paused sessions whose tool is expected back within
        `AgentConfig.prefetch_lead_s` (see `_apply_retention`); a session leaves the set once
        its tool is that far past its expected return."""
        lead, now = self.config.prefetch_lead_s, self._clock()
        for session_id in list(self._prefetching):
            session = self._sessions.get(session_id)
            window = session.window if session is not None else None
            if (session is None or window is None or session.state != S.AWAITING_TOOL
                    or session.demoted or window.expected_s is None):
                self._prefetching.discard(session_id)
                continue
            remaining = window.expected_s - (now - window.started)
            if remaining <= -lead:
                self._prefetching.discard(session_id)
                continue
            # Not while a request waits for memory: the copy would take the pages it waits
            # for and be evicted again before the resume (48 of 50 prefetches were, in a
            # modelled replay whose sessions needed twice the KV memory there was).
            tag = SessionTag.session(session.id)
            if (remaining <= lead and not self.engine.memory_short()
                    and self.engine.kv.offloaded_tokens(tag)):
                self.engine.kv.restore(tag)  # back before the tool returns, if room

    def _hold(self, session: Session) -> None:
        """A finished turn whose end is not reported yet: retained as a paused session of
        unknown tool time that started when the turn ended (its ``HOLD_END`` timer releases
        it)."""
        assert session.ended_at is not None
        paused = PausedSession(len(session.context), True, None,
                               self._clock() - session.ended_at)
        self._count_retained(session, self._retain(session, paused))

    def _release(self, session: Session) -> None:
        """End a finished turn's hold: its KV is what a turn without tool calls leaves."""
        self._end_hold(session)
        self._retain(session, PausedSession(len(session.context), False, None))

    def _end_hold(self, session: Session) -> None:
        """Forget a finished turn's hold (its timers and its retained pages)."""
        if session.ended_at is None:
            return
        session.ended_at = None
        self._timers.cancel(session.id, T.HOLD_END, T.RANK)
        self._usage(session).release(session.id)

    def _retain(self, session: Session, paused: PausedSession) -> bool:
        """Rank the session's KV as the retention policy ranks ``paused``, and set its
        ``RANK`` timer for when that rank may have changed (`RetentionPolicy.valid_for`), as
        long as it has KV (in a cache entry or a host copy)."""
        rank, priority = self._retention.retention(paused)
        tag = SessionTag.session(session.id)
        held = self.engine.kv.set_retention(tag, rank, priority)
        # Only KV that exists is ranked again: a session whose KV was evicted has nothing
        # to rank, so the work of ranks follows what memory holds, not how many sessions wait.
        valid = self._retention.valid_for(paused) if paused.awaiting_tool and (
            held or self.engine.kv.offloaded_tokens(tag)) else None
        if valid is None:
            self._timers.cancel(session.id, T.RANK)
        else:
            self._timers.set(session.id, T.RANK, self._clock() + valid)
        return bool(held) or bool(self.engine.kv.offloaded_tokens(tag))

    def _apply_retention(self, session: Session) -> None:
        """Rank an awaiting session's KV by how long its tool has run and is expected to
        (a session demoted by its owner's fair share: as an ordinary entry)."""
        window = session.window
        assert window is not None
        if session.demoted:
            self._retain(session, PausedSession(len(session.context), False, None))
            return
        waited = self._clock() - window.started
        remaining = None if window.expected_s is None else window.expected_s - waited
        held = self._retain(session, PausedSession(len(session.context), True, remaining,
                                                   waited))
        self._count_retained(session, held)

    def _count_retained(self, session: Session, held: bool) -> None:
        """Count the session's KV as retained by its owner (once, as when it paused), while
        it has any (``held``: in a cache entry or a host copy)."""
        usage = self._usage(session)
        if not held:
            usage.release(session.id)
        elif session.id not in usage.retained:
            usage.retain(session.id, self._pages(len(session.context)))

    def _fit_shares(self, paused: Session) -> None:
        """After ``paused`` retained its KV: while some owner's paused sessions retain more
        than its share (the pool divided among the owners holding KV, or the quota's
        ``max_kv_pages`` if lower), its least recently paused one becomes an ordinary cache
        entry (see `edmm.agent.owners`). A lone owner keeps the whole pool."""
        holders = [u for u in self._owners.values() if u.retained_pages or u.running_pages]
        cap = self.config.quota.max_kv_pages
        if len(holders) < 2 and cap is None:
            return
        share = self._pool_pages // max(1, len(holders))
        share = share if cap is None else min(share, cap)
        for usage in holders:
            while usage.retained and usage.retained_pages + usage.running_pages > share:
                session_id = next(iter(usage.retained))
                usage.release(session_id)
                if self._has_kv(session_id):  # else evicted since: only the count was stale
                    self._demote(self._sessions[session_id])

    def _has_kv(self, session_id: str) -> bool:
        """Whether the session's own KV is in a cache entry or a host copy."""
        tag = SessionTag.session(session_id)
        return bool(self.engine.kv.tagged(tag) or self.engine.kv.offloaded_tokens(tag))

    def _demote(self, session: Session) -> None:
        """The session's KV loses its retention (an ordinary cache entry) until it resumes."""
        if session.state == S.AWAITING_TOOL:
            session.demoted = True
            self._apply_retention(session)
        elif session.ended_at is not None:
            self._release(session)

    def _expected_duration(self, calls: Iterable[ToolCall]) -> float | None:
        """The longest expected duration among the calls' tools: the median of its learned
        durations once trusted (`ToolDurations`; unless `AgentConfig.learn_tool_durations` is
        off), else the declared one (`ToolSpec`)."""
        known = []
        for name in {call.name for call in calls}:
            learned = (self._durations.median(name) if self.config.learn_tool_durations
                       else None)
            spec = self._tools.get(name)
            declared = spec.expected_duration_s if spec is not None else None
            value = learned if learned is not None else declared
            if value is not None:
                known.append(value)
        return max(known) if known else None

    def _memoised(self, calls: Iterable[ToolCall]) -> dict[str, ToolContent]:
        """Remembered results of earlier identical calls of idempotent tools."""
        out: dict[str, ToolContent] = {}
        for call in calls:
            spec = self._tools.get(call.name)
            key = call.memo_key()
            if spec is not None and spec.cacheable and key is not None and key in self._memo:
                out[call.id] = self._memo[key]
        return out

    def _learn(self, window: ToolWindow, results: Sequence[ToolResult], now: float) -> None:
        """The window's duration, as an observation of its tool (`ToolDurations`), and results
        of idempotent tools (memo). Only a window whose calls are all of one tool is an
        observation: the resume of calls of several tools comes when the slowest returns,
        which says nothing of the others' times. (A window abandoned at its deadline is not
        one either: its duration is only known to be longer.)"""
        names = {call.name for call in window.calls.values()}
        if len(names) == 1:
            self._durations.observe(names.pop(), now - window.started)
        for r in results:
            call = window.calls[r.call_id]
            spec = self._tools.get(call.name)
            if spec is not None and spec.cacheable and (key := call.memo_key()) is not None:
                self._memo[key] = r.content

    def _spec_ids(self, session: Session, window: ToolWindow) -> set[str]:
        """The ids of the speculations ``window`` may have started."""
        ids = {_spec_id(SessionTag.branch(session.id, k)) for k in window.branches}
        if window.in_place is not None:
            ids.add(_spec_id(SessionTag.session(session.id)))
        return ids


def _recomputed(previous: list[int], prompt: list[int], cached: int) -> int:
    """Tokens of ``previous`` (a session's context before a turn) that the turn's ``prompt``
    repeated and that were computed again (not among its ``cached`` tokens); the prompts are
    compared only when the count can be above zero, after the turn (off its first token)."""
    if cached >= min(len(previous), len(prompt)):
        return 0
    return max(0, common_prefix_len(previous, prompt) - cached)


def _spec_id(tag: SessionTag) -> str:
    """The request id of the speculative prefill of branch ``tag``: outside any client's
    request id space (a client's id never starts with a NUL)."""
    return "\x00spec" + json.dumps([tag.kind.value, tag.session_id, tag.key])


def _counters(m: SessionMetrics) -> dict[str, int]:
    """The counters of `AgentStats` that ``m`` adds to."""
    return {"turns": m.turns, "resumes": m.resumes, "spec_hits": m.spec_hits,
            "spec_partial": m.spec_partial, "spec_misses": m.spec_misses,
            "tokens_speculated": m.tokens_speculated,
            "context_tokens_recomputed": m.context_tokens_recomputed, "spec_gated": m.spec_gated,
            "spec_in_place": m.spec_in_place}


def _check_calls(tool_calls: Sequence[ToolCall]) -> dict[str, ToolCall]:
    calls = {c.id: c for c in tool_calls}
    if not calls:
        raise AgentError("await_tools needs at least one tool call")
    if len(calls) != len(tool_calls):
        raise AgentError("tool call ids must be unique")
    return calls
