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


@dataclass(frozen=True)
class PausedSession:
    """What a retention policy sees of a session."""

    num_tokens: int  # context tokens (their KV is what retention saves)
    awaiting_tool: bool  # False: the last turn ended and no tool call was reported (yet)
    expected_remaining_s: float | None  # predicted seconds until the tool returns


class RetentionPolicy(abc.ABC):
    """Eviction class and priority of a paused session's KV."""

    name: ClassVar[str]

    @abc.abstractmethod
    def retention(self, session: PausedSession) -> tuple[EntryRank, float]:
        """``(rank, priority)``: higher ranks and priorities are evicted later."""


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


@RETENTION_POLICIES.register("cost")
class CostPolicy(RetentionPolicy):
    """Sessions awaiting a tool outrank plain entries; among them, keep the ones whose
    recompute costs most per second of memory held: tokens / expected remaining seconds
    (unknown duration: one second)."""

    name = "cost"

    def retention(self, session: PausedSession) -> tuple[EntryRank, float]:
        if not session.awaiting_tool:
            return EntryRank.PLAIN, 0.0
        remaining = session.expected_remaining_s
        remaining = 1.0 if remaining is None else max(remaining, MIN_REMAINING_S)
        return EntryRank.RETAINED, session.num_tokens / remaining


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
