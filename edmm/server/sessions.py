"""How an HTTP request names its agent session; the sessions themselves are the agent layer's.

A chat request is one *turn* of an agent session. Every session belongs to the client that made
it, its *owner* (`owner_of`: a hash of the API key it sends; none: one anonymous owner), and
only that owner can see, feed, resume or close it: another owner naming it gets a 404.
`ServerSessions.begin` names the turn's session, in this order: the ``X-Session-Id`` header (or
the ``edmm.session_id`` body field; an unknown id creates the session for the owner); the
owner's session awaiting the tool calls whose results the request carries (call ids are unique
and unguessable); the owner's FINISHED session whose last prompt is the longest prefix of this
one (a session awaiting tools is never taken by a prefix); else a new session under an
unguessable id. It then hands
the turn's `Request` (validated once, on the tokenizing thread) to `edmm.agent.AgentEngine`,
which owns every session's state. A turn that ends in tool calls is reported with
`ServerSessions.end`: the session awaits them (and speculation for the next prompt starts,
unless the agent runs with `AgentConfig.off`). The next turn that carries the results resumes it.

Every method runs on the engine thread (`EngineLoop`).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING

from edmm.agent import AgentEngine, SessionState, ToolCall, ToolResult
from edmm.agent.errors import AgentError, ToolOutputClosedError, UnknownSessionError
from edmm.engine import Engine, EngineError, Request, RequestOutput
from edmm.server.errors import ConflictError, NotFoundError

if TYPE_CHECKING:
    from edmm.server.turns import Turn

logger = logging.getLogger(__name__)

_BUSY = (SessionState.GENERATING, SessionState.RESUMING)
ANONYMOUS = "anonymous"  # the owner of requests that send no API key


def owner_of(headers: Mapping[str, str]) -> str:
    """The client a request comes from: a hash of its ``Authorization`` header (the API key;
    never kept in clear), or `ANONYMOUS` without one."""
    key = headers.get("authorization")
    if not key:
        return ANONYMOUS
    return "key-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


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
        return self.engine.reclaim()

    # ------------------------------------------------------------------ turns
    def begin(self, turn: Turn) -> str:
        """Name the turn's session and queue its request there; return the session id.

        Raises `ConflictError` when an explicitly named session is already generating.
        """
        session_id = self._name(turn)
        self._queue(session_id, turn)
        return session_id

    def end(self, turn: Turn) -> None:
        """A turn finished: with tool calls to await (``turn.calls``) its session awaits them
        (speculation starts), without, its KV becomes an ordinary cache entry
        (`AgentEngine.end_turn`).

        Ignored if the session moved on (closed, or a newer turn started meanwhile).
        """
        agent, sid = self.agent, turn.session_id
        if (not agent.has_session(sid) or agent.session_state(sid) != SessionState.FINISHED
                or agent.finished_request(sid) != turn.request.request_id):
            return
        if not turn.calls:
            agent.end_turn(sid)
            return
        calls = [ToolCall(c.id, c.name, c.arguments) for c in turn.calls]
        hints = turn.predictions
        predictions = {c.id: text for c in turn.calls
                       if (text := hints.get(c.id, hints.get(c.name))) is not None}
        try:
            agent.await_tools(sid, calls, messages=turn.next_messages, tools=turn.tools,
                              expected_duration_s=turn.expected_duration_s,
                              predictions=predictions)
            if turn.predicted_prompt:
                agent.predict_prompt(sid, turn.predicted_prompt)
        except EngineError as e:  # the response stands; only speculation is lost
            logger.warning("session %s: speculation incomplete: %s", sid, e)

    def feed_tool_output(self, session_id: str, owner: str, call_id: str, chunk: str,
                         final: bool = False) -> None:
        """Partial output of a pending call (prefilled speculatively by the agent layer);
        ``final``: the last chunk. 404 for a session unknown to ``owner`` or a call it does
        not await, 409 for a chunk after the final one."""
        self.session_state(session_id, owner)
        if call_id not in self.agent.pending_calls(session_id):
            raise NotFoundError(f"session {session_id!r} has no pending tool call {call_id!r}",
                                param="tool_call_id")
        try:
            self.agent.feed_tool_output(session_id, call_id, chunk, final=final)
        except ToolOutputClosedError as e:
            raise ConflictError(str(e), param="tool_call_id", code="tool_output_closed") from e
        except AgentError as e:
            raise ConflictError(str(e), param="session_id") from e

    def close(self, session_id: str, owner: str) -> None:
        """Forget a session and release the KV the engine keeps for it (404 if unknown to
        ``owner``, 409 while it generates)."""
        if self.session_state(session_id, owner) in _BUSY:
            raise ConflictError(f"session {session_id!r} is generating", param="session_id",
                                code="session_busy")
        self.agent.close_session(session_id)

    def session_state(self, session_id: str, owner: str) -> SessionState:
        """A session's state (`NotFoundError` if unknown, or another owner's: the two are
        told apart by nobody)."""
        try:
            if self.agent.session_owner(session_id) == owner:
                return self.agent.session_state(session_id)
        except UnknownSessionError:
            pass
        raise NotFoundError(f"no session {session_id!r}", param="session_id")

    def submit(self, request: Request) -> None:
        """Queue a request outside any session (text completions)."""
        self.agent.submit(request)

    # ------------------------------------------------------------------ naming
    def _name(self, turn: Turn) -> str:
        agent, owner = self.agent, turn.owner
        asked = turn.asked_session
        if asked is not None:
            if not agent.has_session(asked):
                return asked  # created for this owner
            if self.session_state(asked, owner) in _BUSY:  # 404: another owner's
                raise ConflictError(f"session {asked!r} is already generating",
                                    param="X-Session-Id", code="session_busy")
            return asked
        for call_id, _ in turn.tool_results:
            session_id = agent.session_awaiting(call_id, owner)
            if session_id is not None:
                return session_id
        found = agent.find_session(turn.request.prompt_token_ids, owner)
        return found if found is not None else f"sess-{secrets.token_hex(16)}"

    def _queue(self, session_id: str, turn: Turn) -> None:
        """Resume the session if it awaits calls this turn carries results of, else queue
        a new turn (a session awaiting other results, or abandoned, starts over)."""
        agent, request = self.agent, turn.request
        if not agent.has_session(session_id):
            agent.submit(request, session_id, owner=turn.owner)
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
        agent.submit(request, session_id, owner=turn.owner)
