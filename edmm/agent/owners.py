"""What each owner (a client, e.g. an API key) holds, and the quotas that bound it.

`AgentEngine` keeps one `OwnerUsage` per owner with live sessions, updated at the events that
change it (a session created or closed, a tool window opened or closed, a turn submitted or
ended), never by a pass over the sessions. `KeyQuota` bounds what one owner may hold; a turn
that would go over a bound is refused with `QuotaExceededError` before anything changes,
which says when to try again.

KV memory is shared fairly without a hard bound: the pages an owner's paused sessions retain
count against its *fair share*, the pool divided among the owners holding KV (or the quota's
``max_kv_pages``, if lower); past it, that owner's least recently paused sessions lose their
retention (their KV becomes an ordinary cache entry, evicted before any retained KV). So under
memory pressure one owner's sessions go before it takes another's retained KV, and a lone
owner keeps the whole pool.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from edmm.engine.errors import EngineConfigError


@dataclass(frozen=True)
class KeyQuota:
    """Bounds on what one owner holds (None: no bound).

    Attributes:
        max_sessions: live sessions. A new session past it closes the owner's least recently
            used session that is finished or abandoned; with none, the turn is refused.
        max_awaiting: sessions awaiting tool results. A turn that may end in tool calls is
            refused while the owner has this many others awaiting.
        max_kv_pages: KV pages held: its running turns' prompts (a turn whose prompt would
            take them past it, while others run, is refused) and its paused sessions'
            retained KV (past it, its least recently paused sessions lose their retention).
    """

    max_sessions: int | None = None
    max_awaiting: int | None = None
    max_kv_pages: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_awaiting", "max_kv_pages"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EngineConfigError(f"{name} must be >= 1 or None, got {value}")


@dataclass(frozen=True)
class OwnerStats:
    """A snapshot of one owner's usage (`AgentEngine.owner_stats`)."""

    sessions: int
    awaiting: int
    kv_pages: int  # retained by its paused sessions plus its running turns' prompts
    refused: dict[str, int]  # turns refused, by quota (`QuotaExceededError.resource`)


@dataclass
class OwnerUsage:
    """One owner's live sessions and what they hold (kept by `AgentEngine`; its refusal
    counts go with it once the owner has no session left)."""

    sessions: OrderedDict[str, None] = field(default_factory=OrderedDict)  # LRU first
    awaiting: dict[str, float] = field(default_factory=dict)  # session -> window deadline
    retained: OrderedDict[str, int] = field(default_factory=OrderedDict)  # -> pages, oldest 1st
    running: dict[str, int] = field(default_factory=dict)  # session -> its turn's prompt pages
    refused: Counter[str] = field(default_factory=Counter)
    retained_pages: int = 0  # the sum of ``retained``
    running_pages: int = 0  # the sum of ``running``

    def retain(self, session_id: str, pages: int) -> None:
        """The session's KV (``pages``) is retained, as the most recently paused."""
        self.release(session_id)
        self.retained[session_id] = pages
        self.retained_pages += pages

    def release(self, session_id: str) -> None:
        """The session's KV is retained no more."""
        self.retained_pages -= self.retained.pop(session_id, 0)

    def run(self, session_id: str, pages: int) -> None:
        """The session runs a turn whose prompt takes ``pages``."""
        self.stop(session_id)
        self.running[session_id] = pages
        self.running_pages += pages

    def stop(self, session_id: str) -> None:
        """The session's turn ended."""
        self.running_pages -= self.running.pop(session_id, 0)

    def forget(self, session_id: str) -> None:
        """The session is closed."""
        self.sessions.pop(session_id, None)
        self.awaiting.pop(session_id, None)
        self.release(session_id)
        self.stop(session_id)

    def stats(self) -> OwnerStats:
        """A snapshot."""
        return OwnerStats(len(self.sessions), len(self.awaiting),
                          self.retained_pages + self.running_pages, dict(self.refused))

    def earliest_deadline(self) -> float | None:
        """The soonest tool deadline of the owner's awaiting sessions."""
        return min(self.awaiting.values(), default=None)
