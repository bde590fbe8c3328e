"""Retention of a paused session's KV: how hard the prefix cache holds on to it.

A policy maps what is known of a paused session to an eviction class (`EntryRank`) and a
priority within it. Nothing is pinned: under memory pressure every entry can go, speculation
branches first, and a dropped session is recomputed at resume. Policies are picked by name from
``RETENTION_POLICIES`` (`AgentConfig.retention`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

from edmm.agent.registry import Registry
from edmm.engine.prefix_cache import EntryRank

MIN_REMAINING_S = 0.01  # a tool past its expected duration is treated as returning now
RANK_FRACTION = 0.25  # a rank is computed again once its estimate may be off by this much
MIN_RANK_S = 0.05  # ... but not more often than this


@dataclass(frozen=True)
class PausedSession:
    """What a retention policy sees of a session."""

    num_tokens: int  # context tokens (their KV is what retention saves)
    # True also for a turn that just ended whose tool calls are not reported yet
    # (`AgentConfig.report_window_s`: a tool of unknown duration that started then);
    # False: a running turn, or one that ended without tool calls.
    awaiting_tool: bool
    expected_remaining_s: float | None  # predicted seconds until the tool returns
    waited_s: float = 0.0  # seconds the tool has run so far


class RetentionPolicy(abc.ABC):
    """Eviction class and priority of a paused session's KV."""

    name: ClassVar[str]

    @abc.abstractmethod
    def retention(self, session: PausedSession) -> tuple[EntryRank, float]:
        """``(rank, priority)``: higher ranks and priorities are evicted later."""

    def valid_for(self, session: PausedSession) -> float | None:
        """Seconds until the rank `retention` gives ``session`` should be computed again
        (its tool has run on meanwhile); None: it never changes while the session waits."""
        return None


RETENTION_POLICIES: Registry[RetentionPolicy] = Registry("retention policy")


@RETENTION_POLICIES.register("lru")
class LRUPolicy(RetentionPolicy):
    """A paused session's KV is a plain LRU cache entry (what engines do today)."""

    name = "lru"

    def retention(self, session: PausedSession) -> tuple[EntryRank, float]:
        return EntryRank.PLAIN, 0.0


@RETENTION_POLICIES.register("keep")
class KeepPolicy(RetentionPolicy):
    """Sessions awaiting a tool outrank plain entries; LRU among them."""

    name = "keep"

    def retention(self, session: PausedSession) -> tuple[EntryRank, float]:
        return (EntryRank.RETAINED if session.awaiting_tool else EntryRank.PLAIN), 0.0


def remaining_estimate(session: PausedSession) -> float:
    """Seconds until the session's tool is expected back, never below the time it has run
    already: tool times are heavy-tailed (log-normal-like), so a call that has run ``t``
    seconds is expected to run about as long again (and a call with no expected duration is
    judged by its age alone, as LRU does). Without that floor a call past its expected
    duration would look like it returns any moment and hold memory for as long as it runs."""
    remaining = session.expected_remaining_s
    floor = max(session.waited_s, MIN_REMAINING_S)
    return floor if remaining is None else max(remaining, floor)


@RETENTION_POLICIES.register("cost")
class CostPolicy(RetentionPolicy):
    """Sessions awaiting a tool outrank plain entries; among them, keep the ones whose
    recompute costs most per second of memory held: tokens / `remaining_estimate`."""

    name = "cost"

    def retention(self, session: PausedSession) -> tuple[EntryRank, float]:
        if not session.awaiting_tool:
            return EntryRank.PLAIN, 0.0
        return EntryRank.RETAINED, session.num_tokens / remaining_estimate(session)

    def valid_for(self, session: PausedSession) -> float | None:
        """The priority moves with `remaining_estimate`: computed again once that may have
        changed by `RANK_FRACTION` (a few dozen times over a long tool call)."""
        return max(MIN_RANK_S, RANK_FRACTION * remaining_estimate(session))


@RETENTION_POLICIES.register("ttl")
class TTLPolicy(RetentionPolicy):
    """Continuum-style time to live: a session awaiting a tool outranks plain entries until its
    tool's expected duration has passed (unknown duration: not at all), then it is an ordinary
    LRU entry."""

    name = "ttl"

    def retention(self, session: PausedSession) -> tuple[EntryRank, float]:
        remaining = session.expected_remaining_s
        if session.awaiting_tool and remaining is not None and remaining > 0:
            return EntryRank.RETAINED, 0.0
        return EntryRank.PLAIN, 0.0

    def valid_for(self, session: PausedSession) -> float | None:
        """Retained until the expected duration has passed."""
        remaining = session.expected_remaining_s
        return remaining if remaining is not None and remaining > 0 else None
