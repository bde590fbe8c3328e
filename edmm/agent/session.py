"""`Session`: one agent conversation's execution state, with guarded transitions.

The state machine (`SessionState`, an ordered enum) allows exactly the transitions of
``TRANSITIONS``; any other raises `SessionStateError` and changes nothing. `check` verifies the
invariants each state implies about the session's own fields (the agent engine checks the
engine side).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edmm.agent.errors import AgentError, SessionStateError
from edmm.agent.speculation import ToolWindow
from edmm.agent.types import SessionMetrics, SessionState

S = SessionState
TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    S.GENERATING: frozenset({S.FINISHED, S.ABANDONED}),
    S.AWAITING_TOOL: frozenset({S.RESUMING, S.ABANDONED}),
    S.RESUMING: frozenset({S.GENERATING, S.FINISHED, S.ABANDONED}),
    S.FINISHED: frozenset({S.GENERATING, S.AWAITING_TOOL, S.ABANDONED}),
    S.ABANDONED: frozenset(),
}


@dataclass
class Session:
    """State of one agent session (owned by `AgentEngine`)."""

    id: str
    state: SessionState = SessionState.FINISHED
    context: list[int] = field(default_factory=list)  # prompt + output of the last turn
    request_id: str | None = None  # the turn being generated (GENERATING / RESUMING)
    window: ToolWindow | None = None  # the open tool window (AWAITING_TOOL / RESUMING)
    resume_started: float | None = None  # clock time of `resume` (RESUMING)
    prompt_len: int = 0  # the last turn's prompt: context[:prompt_len]
    finished_request_id: str | None = None  # the last turn that finished (not aborted)
    last_request_id: str | None = None  # the last turn submitted (running, ended or aborted)
    previous: list[int] = field(default_factory=list)  # context before the running turn
    owner: str | None = None  # the client it belongs to (opaque to the agent layer)
    cache_salt: str | None = None  # its last turn's (`Request.cache_salt`): speculation's too
    ordinal: int = 0  # the arrival number of its first turn among all sessions' turns
    ended_at: float | None = None  # FINISHED, its end not reported yet: clock time it ended
    unreported: bool = False  # its last turn finished, `end_turn` / `await_tools` not called
    demoted: bool = False  # AWAITING_TOOL past its owner's fair share: its KV not retained
    metrics: SessionMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = SessionMetrics(self.id)

    def require(self, wanted: SessionState, action: str) -> None:
        """Raise `SessionStateError` unless the session is in state ``wanted``."""
        if self.state != wanted:
            raise SessionStateError(self.id, self.state, f"{action} needs {wanted}")

    def transition(self, new: SessionState) -> None:
        """Move to ``new`` if `TRANSITIONS` allows it, else raise `SessionStateError`."""
        if new not in TRANSITIONS[self.state]:
            raise SessionStateError(self.id, self.state, f"cannot move to {new}")
        self.state = new

    def check(self) -> None:
        """Raise `AgentError` if the fields contradict the state."""
        busy = self.state in (S.GENERATING, S.RESUMING)
        if busy != (self.request_id is not None):
            raise AgentError(f"session {self.id!r}: {self.state} with request "
                             f"{self.request_id!r}")
        windowed = self.state in (S.AWAITING_TOOL, S.RESUMING)
        if windowed != (self.window is not None):
            raise AgentError(f"session {self.id!r}: {self.state} with window {self.window}")
        if (self.state == S.RESUMING) != (self.resume_started is not None):
            raise AgentError(f"session {self.id!r}: resume clock set in {self.state}")
        if self.ended_at is not None and self.state != S.FINISHED:
            raise AgentError(f"session {self.id!r}: an unreported turn end in {self.state}")
        if self.state == S.AWAITING_TOOL and self.window is not None and not self.window.calls:
            raise AgentError(f"session {self.id!r} awaits no tool call")
