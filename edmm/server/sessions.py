"""How an HTTP request names its agent session; the sessions themselves are the agent layer's.

A chat request is one *turn* of an agent session. Every session belongs to the client that made
it, its *owner* (`owner_of`: a hash of the API key it sends; none: one anonymous owner), and
session names are the owner's own: key A's ``agent-main`` and key B's are two sessions (the
agent layer knows them as ``"<owner>/<name>"``, `session_key`), and no owner can see, feed,
resume or close another's. `ServerSessions.begin` names the turn's session, in this order: the
``X-Session-Id`` header (or the ``edmm.session_id`` body field; an unknown name creates the
session for the owner); the owner's session awaiting the tool calls whose results the request
carries (call ids are unique and unguessable); the owner's FINISHED session whose last prompt
is the longest prefix of this one and whose last turn's end was reported (a session awaiting
tools, or one whose turn may yet await them, is never taken by a prefix); else a
new session under an unguessable name. A request that names a session awaiting tool results
must carry results of its calls, or say ``edmm.discard_pending_calls`` (the calls are dropped,
a new turn starts): else it is a 409, and the session's tool window stays open. The turn is
checked against its owner's quotas (`AgentEngine.admit`: a 429 with ``Retry-After`` past one),
then its `Request` (validated once, on the tokenizing thread) goes to `edmm.agent.AgentEngine`,
which owns every session's state. A turn that ends in tool calls is reported with
`ServerSessions.end`: the session awaits them (and speculation for the next prompt starts,
unless the agent runs with `AgentConfig.off`). The next turn that carries the results resumes it.

Every name the server hands out (``X-Session-Id`` of a response) stays addressable until the
session ends; a session whose name never reached its client (a server-made one, the client
gone before the response) is closed (`drop_unreached`).

Every method runs on the engine thread (`EngineLoop`).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING

from edmm.agent import AgentEngine, SessionState, ToolCall, ToolResult
from edmm.agent.errors import (
    AgentError,
    QuotaExceededError,
    ToolOutputClosedError,
    UnknownSessionError,
)
from edmm.engine import Engine, EngineError, Request, RequestOutput
from edmm.server.errors import ConflictError, NotFoundError, TooManyRequestsError

if TYPE_CHECKING:
    from edmm.server.turns import Turn

logger = logging.getLogger(__name__)

_BUSY = (SessionState.GENERATING, SessionState.RESUMING)
ANONYMOUS = "anonymous"  # the owner of requests that send no API key


def session_key(owner: str, name: str) -> str:
    """The agent layer's id of ``owner``'s session ``name`` (owners hold no ``/``)."""
    return f"{owner}/{name}"


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

    def tick(self) -> int:
        """Run the agent layer's due timers (tool deadlines; the loop calls it when idle)."""
        return self.agent.tick()

    def next_timer_s(self) -> float | None:
        """Seconds until the agent layer's next timer."""
        return self.agent.next_timer_s()

    # ------------------------------------------------------------------ turns
    def begin(self, turn: Turn) -> str:
        """Name the turn's session, check its owner's quotas and queue its request there;
        return the session's name (``turn.session_key``: the agent layer's id).

        Raises `ConflictError` when an explicitly named session is already generating, or
        awaits tool results the turn does not carry (and does not discard);
        `TooManyRequestsError` past a quota.
        """
        name, minted = self._name(turn)
        key = session_key(turn.owner, name)
        try:
            self.agent.admit(turn.owner, key, len(turn.request.prompt_token_ids),
                             turn.may_await)
        except QuotaExceededError as e:
            raise TooManyRequestsError(str(e), e.retry_after_s, param="X-Session-Id",
                                       code=f"quota_{e.resource}") from e
        self._queue(key, turn)
        turn.session_key, turn.minted = key, minted
        return name

    def drop_unreached(self, turn: Turn) -> None:
        """The turn's response never carried its session's name to the client (it left, or
        the turn failed): a session this turn created under a server-made name is closed,
        since nobody can name it (a client-named one stays: the client knows its name)."""
        agent, key = self.agent, turn.session_key
        if not turn.minted or not agent.has_session(key):
            return
        if agent.last_request(key) == turn.request.request_id:
            agent.close_session(key)

    def end(self, turn: Turn) -> None:
        """A turn finished: with tool calls to await (``turn.calls``) its session awaits them
        (speculation starts), without, its KV becomes an ordinary cache entry
        (`AgentEngine.end_turn`).

        Ignored if the session moved on (closed, or a newer turn started meanwhile).
        """
        agent, sid = self.agent, turn.session_key
        if (not agent.has_session(sid) or agent.session_state(sid) != SessionState.FINISHED
                or agent.finished_request(sid) != turn.request.request_id):
            if turn.calls:  # a tool window lost: no retention for it, no speculation
                logger.info("session %s: end of request %s ignored (the session moved on: "
                            "%s)", sid, turn.request.request_id, _where(agent, sid))
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
        key = session_key(owner, session_id)
        if call_id not in self.agent.pending_calls(key):
            raise NotFoundError(f"session {session_id!r} has no pending tool call {call_id!r}",
                                param="tool_call_id")
        try:
            self.agent.feed_tool_output(key, call_id, chunk, final=final)
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
        self.agent.close_session(session_key(owner, session_id))

    def session_state(self, session_id: str, owner: str) -> SessionState:
        """The state of ``owner``'s session ``session_id`` (`NotFoundError` if it has none;
        another owner's of the same name is another session)."""
        key = session_key(owner, session_id)
        try:
            if self.agent.session_owner(key) == owner:
                return self.agent.session_state(key)
        except UnknownSessionError:
            pass
        raise NotFoundError(f"no session {session_id!r}", param="session_id")

    def submit(self, request: Request) -> None:
        """Queue a request outside any session (text completions)."""
        self.agent.submit(request)

    # ------------------------------------------------------------------ naming
    def _name(self, turn: Turn) -> tuple[str, bool]:
        """The turn's session name, and whether the server made it up just now."""
        agent, owner = self.agent, turn.owner
        asked = turn.asked_session
        if asked is not None:
            key = session_key(owner, asked)
            if agent.has_session(key):
                state = agent.session_state(key)
                if state in _BUSY:
                    raise ConflictError(f"session {asked!r} is already generating",
                                        param="X-Session-Id", code="session_busy")
                pending = agent.pending_calls(key)
                if (state == SessionState.AWAITING_TOOL and not turn.discard_pending
                        and not any(c in pending for c, _ in turn.tool_results)):
                    raise ConflictError(
                        f"session {asked!r} awaits the results of its tool calls "
                        f"{pending}: send them as tool messages, or set "
                        "edmm.discard_pending_calls to start a new turn without them",
                        param="X-Session-Id", code="session_awaiting_tools")
            return asked, False
        for call_id, _ in turn.tool_results:
            awaiting = agent.session_awaiting(call_id, owner)
            if awaiting is not None:
                return _name_of(awaiting), False
        found = agent.find_session(turn.request.prompt_token_ids, owner, reported=True)
        if found is not None:
            return _name_of(found), False
        return f"sess-{secrets.token_hex(16)}", True

    def _queue(self, key: str, turn: Turn) -> None:
        """Resume the session if it awaits calls this turn carries results of, else queue
        a new turn (a session awaiting other results, or abandoned, starts over)."""
        agent, request = self.agent, turn.request
        if not agent.has_session(key):
            agent.submit(request, key, owner=turn.owner)
            return
        pending = agent.pending_calls(key)
        results = [ToolResult(c, text) for c, text in turn.tool_results if c in pending]
        if results:
            try:
                agent.resume_request(key, request, results)
                return
            except AgentError as e:
                logger.info("session %s cannot resume (%s); starting a new turn", key, e)
        if agent.session_state(key) != SessionState.FINISHED:
            agent.close_session(key)
        agent.submit(request, key, owner=turn.owner)


def _name_of(key: str) -> str:
    """The client's name of the session the agent layer knows as ``key`` (`session_key`)."""
    return key.split("/", 1)[1]


def _where(agent: AgentEngine, sid: str) -> str:
    """The session's state as the ignored end found it."""
    if not agent.has_session(sid):
        return "closed"
    return f"{agent.session_state(sid).name}, last finished {agent.finished_request(sid)}"
