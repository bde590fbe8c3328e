"""Typed errors of the agent layer, raised before anything changes: the session stays intact."""

from __future__ import annotations

from edmm.engine.errors import EngineError


class AgentError(EngineError):
    """Base class of every error raised by `edmm.agent`."""


class UnknownSessionError(AgentError, KeyError):
    """No session has this id (never created, or closed)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class SessionStateError(AgentError):
    """The session is not in a state that allows the operation (e.g. resuming a session that is
    not awaiting a tool). Attributes: ``session_id``, ``state`` (its `SessionState`), ``wanted``."""

    def __init__(self, session_id: str, state: object, wanted: str) -> None:
        self.session_id = session_id
        self.state = state
        self.wanted = wanted
        super().__init__(f"session {session_id!r} is {state!s}; {wanted}")


class UnknownToolCallError(AgentError, KeyError):
    """A tool result, prediction or output chunk names a call id the session is not waiting on."""

    def __init__(self, session_id: str, call_id: str) -> None:
        self.session_id = session_id
        self.call_id = call_id
        super().__init__(f"session {session_id!r} has no pending tool call {call_id!r}")

    def __str__(self) -> str:
        return str(self.args[0])


class ToolOutputClosedError(AgentError):
    """An output chunk for a call whose streamed output was marked final."""

    def __init__(self, session_id: str, call_id: str) -> None:
        self.session_id = session_id
        self.call_id = call_id
        super().__init__(f"session {session_id!r}: the output of tool call {call_id!r} is "
                         "complete (a chunk marked final came)")


class InsertionPositionError(AgentError, ValueError):
    """A result's insertion position lies outside the session's context ``[0, len]``."""

    def __init__(self, session_id: str, position: int, length: int) -> None:
        self.session_id = session_id
        self.position = position
        self.length = length
        super().__init__(f"session {session_id!r}: insertion position {position} outside the "
                         f"context [0, {length}]")


class UnknownPolicyError(AgentError, KeyError):
    """A speculation source or retention policy name that is not registered."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class QuotaExceededError(AgentError):
    """A turn would take its owner past a `edmm.agent.owners.KeyQuota` bound; nothing was
    queued. ``resource``: ``"sessions"``, ``"awaiting"`` or ``"kv_pages"``;
    ``retry_after_s``: when the bound may let it through (a tool deadline, or soon)."""

    def __init__(self, owner: object, resource: str, limit: int, retry_after_s: float) -> None:
        self.owner = owner
        self.resource = resource
        self.limit = limit
        self.retry_after_s = retry_after_s
        what = {"sessions": "sessions", "awaiting": "sessions awaiting tool results",
                "kv_pages": "KV pages"}[resource]
        super().__init__(f"over the quota of {limit} {what} per client; retry in "
                         f"{retry_after_s:.0f} s, or end sessions it no longer needs")
