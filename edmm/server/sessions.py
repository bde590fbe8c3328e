"""How an HTTP request names its agent session; the sessions themselves are the agent layer's.

A chat request is one *turn* of an agent session. `ServerSessions.begin` names the turn's
session, in this order: the ``X-Session-Id`` header (or the ``edmm.session_id`` body field); the
session awaiting the tool calls whose results the request carries (call ids are unique); the
session whose last prompt is the longest prefix of this one; else a new session. It then hands
the turn's `Request` (validated once, on the tokenizing thread) to `edmm.agent.AgentEngine`,
which owns every session's state. A turn that ends in tool calls is reported with
`ServerSessions.end`: the session awaits them (and speculation for the next prompt starts,
unless the agent runs with `AgentConfig.off`). The next turn that carries the results resumes it.

Every method runs on the engine thread (`EngineLoop`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edmm.agent import AgentEngine, SessionState, ToolCall, ToolResult
from edmm.agent.errors import AgentError, UnknownSessionError
from edmm.engine import Engine, EngineError, Request, RequestOutput
from edmm.server.errors import ConflictError, NotFoundError
from edmm.server.tool_parser import ParsedToolCall

logger = logging.getLogger(__name__)

_BUSY = (SessionState.GENERATING, SessionState.RESUMING)


@dataclass(frozen=True)
class Turn:
    """A validated request and what names its session."""

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


class ServerSessions:
    """The HTTP side of agent sessions over one `AgentEngine` (what `EngineLoop` runs)."""

    def __init__(self, agent: AgentEngine) -> None:
        self.agent = agent

    @property
    def engine(self) -> Engine:
        """The engine under the agent layer."""
        return self.agent.engine

    # ------------------------------------------------------------------ engine protocol
    def step(self) -> list[RequestOutput]:
        """One step of the agent engine."""
        return self.agent.step()

    def has_unfinished(self) -> bool:
        """True while requests or speculation need steps."""
        return self.agent.has_unfinished() or self.agent.has_speculation()

    def abort(self, request_id: str) -> bool:
        """Stop a request; its session's turn ends without tool calls."""
        return self.agent.abort(request_id)

    def reclaim(self) -> int:
        """Release the slots retired by zero-copy commits (the loop calls it when idle)."""
        return self.engine.kv.reclaim()

    # ------------------------------------------------------------------ turns
    def begin(self, turn: Turn) -> str:
        """Name the turn's session and queue its request there; return the session id.

        Raises `ConflictError` when an explicitly named session is already generating.
        """
        session_id = self._name(turn)
        self._queue(session_id, turn)
        return session_id

    def end(self, end: TurnEnd) -> None:
        """A finished turn ended in tool calls: its session awaits them (speculation starts).

        Ignored if the session moved on (closed, or a newer turn started meanwhile).
        """
        agent, sid = self.agent, end.session_id
        if (not end.tool_calls or not agent.has_session(sid)
                or agent.session_state(sid) != SessionState.FINISHED
                or agent.finished_request(sid) != end.request_id):
            return
        calls = [ToolCall(c.id, c.name, c.arguments) for c in end.tool_calls]
        predictions = {c.id: text for c in end.tool_calls
                       if (text := end.predictions.get(c.id, end.predictions.get(c.name)))
                       is not None}
        try:
            agent.await_tools(sid, calls, messages=end.messages, tools=end.tools,
                              expected_duration_s=end.expected_duration_s,
                              predictions=predictions)
            if end.predicted_prompt:
                agent.predict_prompt(sid, end.predicted_prompt)
        except EngineError as e:  # the response stands; only speculation is lost
            logger.warning("session %s: speculation incomplete: %s", sid, e)

    def feed_tool_output(self, session_id: str, call_id: str, chunk: str) -> None:
        """Partial output of a pending call (prefilled speculatively by the agent layer);
        404 for an unknown session or a call it does not await."""
        if not self.agent.has_session(session_id):
            raise NotFoundError(f"no session {session_id!r}", param="session_id")
        if call_id not in self.agent.pending_calls(session_id):
            raise NotFoundError(f"session {session_id!r} has no pending tool call {call_id!r}",
                                param="tool_call_id")
        try:
            self.agent.feed_tool_output(session_id, call_id, chunk)
        except AgentError as e:
            raise ConflictError(str(e), param="session_id") from e

    def close(self, session_id: str) -> None:
        """Forget a session and release the KV the engine keeps for it (404 if unknown,
        409 while it generates)."""
        if self.session_state(session_id) in _BUSY:
            raise ConflictError(f"session {session_id!r} is generating", param="session_id",
                                code="session_busy")
        self.agent.close_session(session_id)

    def session_state(self, session_id: str) -> SessionState:
        """A session's state (`NotFoundError` if unknown)."""
        try:
            return self.agent.session_state(session_id)
        except UnknownSessionError as e:
            raise NotFoundError(f"no session {session_id!r}", param="session_id") from e

    def submit(self, request: Request) -> None:
        """Queue a request outside any session (text completions)."""
        self.agent.submit(request)

    # ------------------------------------------------------------------ naming
    def _name(self, turn: Turn) -> str:
        agent = self.agent
        if turn.session_id is not None:
            if agent.has_session(turn.session_id) and (
                    agent.session_state(turn.session_id) in _BUSY):
                raise ConflictError(f"session {turn.session_id!r} is already generating",
                                    param="X-Session-Id", code="session_busy")
            return turn.session_id
        for call_id, _ in turn.tool_results:
            session_id = agent.session_awaiting(call_id)
            if session_id is not None:
                return session_id
        found = agent.find_session(turn.request.prompt_token_ids)
        return found if found is not None else f"sess-{uuid.uuid4().hex}"

    def _queue(self, session_id: str, turn: Turn) -> None:
        """Resume the session if it awaits calls this turn carries results of, else queue
        a new turn (a session awaiting other results, or abandoned, starts over)."""
        agent, request = self.agent, turn.request
        if not agent.has_session(session_id):
            agent.submit(request, session_id)
            return
        pending = agent.pending_calls(session_id)
        results = [ToolResult(c, text) for c, text in turn.tool_results if c in pending]
        if results:
            try:
                agent.resume_request(session_id, request, results)
                return
            except AgentError as e:
                logger.info("session %s cannot resume (%s); starting a new turn", session_id, e)
        if agent.session_state(session_id) != SessionState.FINISHED:
            agent.close_session(session_id)
        agent.submit(request, session_id)
