"""Execution-aware sessions behind the HTTP API.

A chat request is one *turn* of an agent session. `SessionBackend.begin` finds the turn's
session, in this order: the ``X-Session-Id`` header (or the ``edmm.session_id`` body field); the
session that is awaiting the tool calls whose results the request carries (call ids are unique);
the session whose last prompt is the longest prefix of this one; else a new session. A turn that
ends in tool calls is reported with `SessionBackend.end`, which puts the session in
AWAITING_TOOL; with the agent layer, speculation for the next prompt starts there. The next
turn that carries the results resumes it.

Two backends, one interface (every method runs on the engine thread):

- `AgentSessions` drives `edmm.agent.AgentEngine`: retention, speculation, zero-copy commit.
- `PlainSessions` drives a plain `Engine`: the same session bookkeeping and metrics, and
  prefix-cache reuse only (no speculation). It serves when the agent layer is off.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import uuid
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edmm.agent import AgentEngine, SessionState, ToolCall, ToolResult
from edmm.agent.errors import (
    AgentError,
    SessionStateError,
    UnknownSessionError,
    UnknownToolCallError,
)
from edmm.engine import Engine, EngineError, RequestOutput
from edmm.engine.engine import Request
from edmm.server.errors import ConflictError, NotFoundError
from edmm.server.tool_parser import ParsedToolCall

logger = logging.getLogger(__name__)

MAX_SESSIONS = 4096  # server-side records kept (least recently used dropped first)
_BUSY = (SessionState.GENERATING, SessionState.RESUMING)


@dataclass(frozen=True)
class Turn:
    """A validated request and what identifies its session."""

    request: Request
    session_id: str | None = None  # asked for explicitly (header or body)
    tool_results: Sequence[tuple[str, str]] = ()  # (tool_call_id, content) of trailing tool msgs


@dataclass(frozen=True)
class TurnEnd:
    """A turn that ended in tool calls, and what speculation needs to know."""

    session_id: str
    request_id: str
    tool_calls: Sequence[ParsedToolCall]
    messages: Sequence[Mapping[str, Any]] = ()  # the conversation incl. the assistant message
    tools: Sequence[Mapping[str, Any]] | None = None
    expected_duration_s: float | None = None
    predictions: Mapping[str, str] = field(default_factory=dict)  # call id or tool name -> text
    predicted_prompt: Sequence[int] = ()  # the whole next prompt, as the client predicts it


@dataclass
class SessionStats:
    """Counters for /metrics (cumulative since start, but ``states``)."""

    states: Counter[str] = field(default_factory=Counter)  # live sessions by state name
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused
    recomputed_tokens: int = 0  # tokens a session had computed before and computed again
    resumes: int = 0
    speculation: Counter[str] = field(default_factory=Counter)  # hit / partial / miss
    speculated_tokens: int = 0


@dataclass
class _Record:
    """The server's view of a session."""

    state: SessionState
    prompt: list[int] = field(default_factory=list)  # the last turn's prompt
    context: list[int] = field(default_factory=list)  # the last finished turn's prompt + output
    request_id: str | None = None  # the running turn's request
    finished_request_id: str | None = None  # the last finished turn's request
    pending: set[str] = field(default_factory=set)  # tool call ids awaiting results


class SessionBackend(abc.ABC):
    """Session bookkeeping shared by both backends; see the module docstring."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions: OrderedDict[str, _Record] = OrderedDict()
        self._by_call: dict[str, str] = {}  # pending tool call id -> session id
        self._by_request: dict[str, str] = {}  # running request id -> session id
        self._repeated: dict[str, int] = {}  # running request id -> tokens of its session's
        # previous context that its prompt repeats (computed before)
        self._stats = SessionStats()

    # ------------------------------------------------------------------ engine protocol
    def step(self) -> list[RequestOutput]:
        """One engine step; a finished turn's session is FINISHED at once (whether or not its
        client is still there to call `end`)."""
        outputs = self._step()
        for out in outputs:
            if out.finished and out.request_id in self._by_request:
                self._turn_finished(out)
        return outputs

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """True while requests (or speculation) need steps."""

    def abort(self, request_id: str) -> bool:
        """Stop a request; its session's turn ends without tool calls."""
        session_id = self._by_request.pop(request_id, None)
        self._repeated.pop(request_id, None)
        if session_id is not None and session_id in self._sessions:
            self._sessions[session_id].state = SessionState.FINISHED
        return self._abort(request_id)

    # ------------------------------------------------------------------ turns
    def begin(self, turn: Turn) -> str:
        """Find or create the turn's session and queue its request; return the session id.

        Raises `ConflictError` when an explicitly named session is already generating.
        """
        session_id, record = self._lookup(turn)
        request = turn.request
        resumed = record is not None and record.state == SessionState.AWAITING_TOOL
        self._queue(session_id, turn, resumed)
        if record is not None:
            self._repeated[request.request_id] = _common_prefix(
                record.context, request.prompt_token_ids)
        if resumed:
            self._stats.resumes += 1
        record = self._touch(session_id)
        self._forget_calls(record)
        record.state, record.request_id = SessionState.GENERATING, request.request_id
        record.prompt = list(request.prompt_token_ids)
        self._by_request[request.request_id] = session_id
        return session_id

    def end(self, end: TurnEnd) -> None:
        """A finished turn ended in tool calls: its session awaits them (speculation starts).

        Ignored if the session moved on (closed, or a newer turn started meanwhile).
        """
        record = self._sessions.get(end.session_id)
        if (not end.tool_calls or record is None or record.state != SessionState.FINISHED
                or record.finished_request_id != end.request_id):
            return
        self._await(end)
        record.state = SessionState.AWAITING_TOOL
        record.pending = {call.id for call in end.tool_calls}
        for call_id in record.pending:
            self._by_call[call_id] = end.session_id

    def feed_tool_output(self, session_id: str, call_id: str, chunk: str) -> None:
        """Partial output of a pending call (prefilled speculatively by the agent layer)."""
        record = self._sessions.get(session_id)
        if record is None:
            raise NotFoundError(f"no session {session_id!r}", param="session_id")
        if call_id not in record.pending:
            raise NotFoundError(f"session {session_id!r} has no pending tool call {call_id!r}",
                                param="tool_call_id")
        self._feed(session_id, call_id, chunk)

    def close(self, session_id: str) -> None:
        """Forget a session and release the KV the engine keeps for it (404 if unknown,
        409 while it generates)."""
        record = self._sessions.get(session_id)
        if record is None:
            raise NotFoundError(f"no session {session_id!r}", param="session_id")
        if record.state in _BUSY:
            raise ConflictError(f"session {session_id!r} is generating", param="session_id",
                                code="session_busy")
        del self._sessions[session_id]
        self._forget_calls(record)
        self._drop(session_id)

    def session_state(self, session_id: str) -> SessionState:
        """A session's state (`NotFoundError` if unknown)."""
        record = self._sessions.get(session_id)
        if record is None:
            raise NotFoundError(f"no session {session_id!r}", param="session_id")
        return self._state(session_id, record)

    def stats(self) -> SessionStats:
        """A snapshot of the counters, with the live sessions counted by state."""
        snap = SessionStats(**{**self._stats.__dict__, "states": Counter(),
                               "speculation": Counter(self._stats.speculation)})
        for session_id, record in self._sessions.items():
            snap.states[self._state(session_id, record).name.lower()] += 1
        self._add_agent_stats(snap)
        return snap

    def submit(self, request: Request) -> None:
        """Queue a request outside any session (text completions)."""
        self._submit(request)

    def count_usage(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count a finished request's prompt tokens and how many of them were reused."""
        self._stats.prompt_tokens += prompt_tokens
        self._stats.cached_tokens += cached_tokens

    # ------------------------------------------------------------------ lookup
    def _turn_finished(self, out: RequestOutput) -> None:
        session_id = self._by_request.pop(out.request_id)
        repeated = self._repeated.pop(out.request_id, 0)
        self._stats.recomputed_tokens += max(0, repeated - out.num_cached_tokens)
        record = self._sessions.get(session_id)
        if record is not None and record.request_id == out.request_id:
            record.context = [*out.prompt_token_ids, *out.outputs[0].token_ids]
            record.state, record.request_id = SessionState.FINISHED, None
            record.finished_request_id = out.request_id

    def _lookup(self, turn: Turn) -> tuple[str, _Record | None]:
        if turn.session_id is not None:
            record = self._sessions.get(turn.session_id)
            if record is not None and record.state in _BUSY:
                raise ConflictError(f"session {turn.session_id!r} is already generating",
                                    param="X-Session-Id", code="session_busy")
            return turn.session_id, record
        for call_id, _ in turn.tool_results:
            session_id = self._by_call.get(call_id)
            if session_id is not None and self._free(session_id):
                return session_id, self._sessions[session_id]
        session_id = self._find_by_prefix(turn.request.prompt_token_ids)
        if session_id is not None and self._free(session_id):
            return session_id, self._sessions[session_id]
        return f"sess-{uuid.uuid4().hex}", None

    def _find_by_prefix(self, prompt: Sequence[int]) -> str | None:
        """The free session whose last prompt is the longest prefix of ``prompt``."""
        best, best_len = None, 0
        for session_id, record in self._sessions.items():
            n = len(record.prompt)
            if best_len < n <= len(prompt) and record.state not in _BUSY and (
                    list(prompt[:n]) == record.prompt):
                best, best_len = session_id, n
        return best

    def _free(self, session_id: str) -> bool:
        record = self._sessions.get(session_id)
        return record is not None and record.state not in _BUSY

    def _touch(self, session_id: str) -> _Record:
        record = self._sessions.pop(session_id, None) or _Record(SessionState.GENERATING)
        self._sessions[session_id] = record
        while len(self._sessions) > MAX_SESSIONS:
            old_id, old = next(iter(self._sessions.items()))
            if old.state in _BUSY:
                break
            self._sessions.pop(old_id)
            self._forget_calls(old)
            self._drop(old_id)
        return record

    def _forget_calls(self, record: _Record) -> None:
        for call_id in record.pending:
            self._by_call.pop(call_id, None)
        record.pending = set()

    # ------------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _step(self) -> list[RequestOutput]:
        """One step of the engine."""

    @abc.abstractmethod
    def _queue(self, session_id: str, turn: Turn, resumed: bool) -> None:
        """Queue the turn's request in the engine."""

    @abc.abstractmethod
    def _submit(self, request: Request) -> None:
        """Queue a request outside any session."""

    @abc.abstractmethod
    def _abort(self, request_id: str) -> bool:
        """Abort a request in the engine."""

    @abc.abstractmethod
    def _await(self, end: TurnEnd) -> None:
        """The session waits on ``end.tool_calls`` (start speculation here)."""

    @abc.abstractmethod
    def _feed(self, session_id: str, call_id: str, chunk: str) -> None:
        """Partial output of a pending call."""

    @abc.abstractmethod
    def _drop(self, session_id: str) -> None:
        """The server forgot a session (LRU); release what the engine keeps for it."""

    @abc.abstractmethod
    def _state(self, session_id: str, record: _Record) -> SessionState:
        """The session's state as the engine sees it."""

    @abc.abstractmethod
    def _add_agent_stats(self, snap: SessionStats) -> None:
        """Add speculation counters to ``snap``."""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PlainSessions(SessionBackend):
    """Sessions over a plain `Engine`: bookkeeping and prefix-cache reuse, no speculation."""

    def _step(self) -> list[RequestOutput]:
        return self.engine.step()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def _queue(self, session_id: str, turn: Turn, resumed: bool) -> None:
        self.engine.submit(turn.request)

    def _submit(self, request: Request) -> None:
        self.engine.submit(request)

    def _abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def _await(self, end: TurnEnd) -> None:
        return None  # nothing to prepare: the finished turn's KV sits in the prefix cache

    def _feed(self, session_id: str, call_id: str, chunk: str) -> None:
        return None  # accepted and dropped: no speculation without the agent layer

    def _drop(self, session_id: str) -> None:
        return None

    def _state(self, session_id: str, record: _Record) -> SessionState:
        return record.state

    def _add_agent_stats(self, snap: SessionStats) -> None:
        return None


class AgentSessions(SessionBackend):
    """Sessions over `edmm.agent.AgentEngine`: a turn ending in tool calls starts speculation,
    the turn carrying their results resumes by committing the best branch."""

    def __init__(self, agent: AgentEngine, engine: Engine) -> None:
        super().__init__(engine)
        self.agent = agent
        self._folded: Counter[str] = Counter()  # counters of sessions already forgotten

    def _step(self) -> list[RequestOutput]:
        return self.agent.step()

    def has_unfinished(self) -> bool:
        return self.agent.has_unfinished() or self.agent.has_speculation()

    def _queue(self, session_id: str, turn: Turn, resumed: bool) -> None:
        request = turn.request
        if resumed and self._resume(session_id, turn):
            return
        try:
            self.agent.add_request(request.request_id, request.prompt_token_ids, request.params,
                                   session_id=session_id)
        except SessionStateError:  # awaiting results this turn does not carry, or abandoned
            self._close(session_id)
            self.agent.add_request(request.request_id, request.prompt_token_ids, request.params,
                                   session_id=session_id)

    def _resume(self, session_id: str, turn: Turn) -> bool:
        pending = self._sessions[session_id].pending
        results = [ToolResult(call_id, text) for call_id, text in turn.tool_results
                   if call_id in pending]
        if not results:
            return False
        request = turn.request
        try:
            self.agent.resume(session_id, request.request_id, results, request.params,
                              prompt=request.prompt_token_ids)
        except AgentError as e:
            logger.info("session %s cannot resume (%s); starting a new turn", session_id, e)
            return False
        return True

    def _submit(self, request: Request) -> None:
        self.agent.add_request(request.request_id, request.prompt_token_ids, request.params)

    def _abort(self, request_id: str) -> bool:
        return self.agent.abort(request_id)

    def _await(self, end: TurnEnd) -> None:
        calls = [ToolCall(c.id, c.name, c.arguments) for c in end.tool_calls]
        predictions = {c.id: text for c in end.tool_calls
                       if (text := end.predictions.get(c.id, end.predictions.get(c.name)))
                       is not None}
        try:
            self.agent.await_tools(end.session_id, calls, messages=end.messages,
                                   tools=end.tools, expected_duration_s=end.expected_duration_s,
                                   predictions=predictions)
            if end.predicted_prompt:
                self.agent.predict_prompt(end.session_id, end.predicted_prompt)
        except EngineError as e:  # the response stands; only speculation is lost
            logger.warning("session %s: speculation incomplete: %s", end.session_id, e)

    def _feed(self, session_id: str, call_id: str, chunk: str) -> None:
        try:
            self.agent.feed_tool_output(session_id, call_id, chunk)
        except (UnknownSessionError, UnknownToolCallError) as e:
            raise NotFoundError(str(e), param="tool_call_id") from e
        except AgentError as e:
            raise ConflictError(str(e), param="session_id") from e

    def _drop(self, session_id: str) -> None:
        self._fold(session_id)
        self._close(session_id)

    def _close(self, session_id: str) -> None:
        with contextlib.suppress(UnknownSessionError):
            self.agent.close_session(session_id)

    def _state(self, session_id: str, record: _Record) -> SessionState:
        try:
            return self.agent.session_state(session_id)
        except UnknownSessionError:
            return record.state

    def _fold(self, session_id: str) -> None:
        try:
            m = self.agent.session_metrics(session_id)
        except UnknownSessionError:
            return
        self._folded.update(hit=m.spec_hits, partial=m.spec_partial, miss=m.spec_misses,
                            speculated=m.tokens_speculated)

    def _add_agent_stats(self, snap: SessionStats) -> None:
        totals = Counter(self._folded)
        for session_id in self._sessions:
            try:
                m = self.agent.session_metrics(session_id)
            except UnknownSessionError:
                continue
            totals.update(hit=m.spec_hits, partial=m.spec_partial, miss=m.spec_misses,
                          speculated=m.tokens_speculated)
        snap.speculated_tokens = totals.pop("speculated", 0)
        snap.speculation.update(totals)
