"""What the agent layer learns from the sessions it has seen, pooled across them.

- `UsageStats`: how often a speculation branch was used, per (speculation source, tool): the
  one owner of those counts. A branch's outcome is recorded when its session resumes; the
  gate (`edmm.agent.gate.SpeculationGate`) reads the pool of the other sessions and the
  session's own counts for the branch's source and tool.
- `ToolDurations`: how long each tool (by name) runs, as a log-normal: the running mean of
  the log of its observed seconds (its median is ``exp`` of that mean). A tool window's
  expected duration, when the client gives none, is the median of its tools' learned
  distributions, once each has ``min_count`` observations. (The spread of the log is not
  kept: nothing uses it yet.)

Both are keyed by names a client chooses (tool names), so each keeps at most ``max_keys``
keys, forgetting the least recently updated past it.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from edmm.engine.errors import EngineConfigError

MAX_KEYS = 4096  # tools (or source and tool pairs) remembered; least recently updated go first
MIN_DURATION_S = 1e-3  # observed durations are floored here (the log of 0 is not a number)


class Outcome(enum.Enum):
    """What became of a speculation branch at its session's resume."""

    HIT = "hit"  # committed, matching all of its tokens
    PARTIAL = "partial"  # committed, matching part of them
    MISS = "miss"  # not committed (another branch or the retained KV won, or none matched)


@dataclass(frozen=True)
class Outcomes:
    """Counts of branch outcomes."""

    hits: int = 0
    partials: int = 0
    misses: int = 0

    @property
    def total(self) -> int:
        """Branches counted."""
        return self.hits + self.partials + self.misses

    @property
    def used(self) -> float:
        """Branches used, a partial counting half."""
        return self.hits + 0.5 * self.partials

    def add(self, outcome: Outcome, n: int = 1) -> Outcomes:
        """These counts with ``n`` more of ``outcome``."""
        return Outcomes(self.hits + n * (outcome is Outcome.HIT),
                        self.partials + n * (outcome is Outcome.PARTIAL),
                        self.misses + n * (outcome is Outcome.MISS))

    def minus(self, other: Outcomes) -> Outcomes:
        """These counts without ``other``, each at least 0 (``other`` may not be a part of
        them: counts the pool forgot)."""
        return Outcomes(max(0, self.hits - other.hits), max(0, self.partials - other.partials),
                        max(0, self.misses - other.misses))


def window_tool(names: Iterable[str]) -> str:
    """The tool key of a window's calls: their distinct names, sorted, joined by ``+`` (one
    call, or parallel calls of one tool: that tool's name)."""
    return "+".join(sorted(set(names)))


_Key = tuple[str, str]  # (speculation source name, tool key)


@dataclass
class UsageStats:
    """Branch outcomes per (speculation source, tool key), pooled over every session seen, and
    per live session (what `SpeculationGate` refines the pool with). A closed session's
    counts stay in the pool (`forget`). A key the pool forgets (past ``max_keys``) stays in
    the live sessions' own counts; if it comes back, the pool without a session's own is
    counted at no less than 0 each."""

    max_keys: int = MAX_KEYS
    _pooled: OrderedDict[_Key, Outcomes] = field(default_factory=OrderedDict)
    _own: dict[str, dict[_Key, Outcomes]] = field(default_factory=dict)

    def record(self, session_id: str, source: str, tool: str, outcome: Outcome) -> None:
        """One branch of ``session_id`` from ``source`` for ``tool`` ended in ``outcome``."""
        key = (source, tool)
        self._pooled[key] = self._pooled.pop(key, Outcomes()).add(outcome)
        if len(self._pooled) > self.max_keys:
            self._pooled.popitem(last=False)
        own = self._own.setdefault(session_id, {})
        own[key] = own.get(key, Outcomes()).add(outcome)

    def own(self, session_id: str, source: str, tool: str) -> Outcomes:
        """The session's own outcomes for ``source`` and ``tool``."""
        return self._own.get(session_id, {}).get((source, tool), Outcomes())

    def others(self, session_id: str, source: str, tool: str) -> Outcomes:
        """Every other session's outcomes for ``source`` and ``tool`` (the pool without the
        session's own, so the gate does not count them twice)."""
        pooled = self._pooled.get((source, tool), Outcomes())
        return pooled.minus(self.own(session_id, source, tool))

    def forget(self, session_id: str) -> None:
        """The session closed: its counts stay in the pool only."""
        self._own.pop(session_id, None)


@dataclass
class _LogStats:
    """The running mean of log seconds."""

    count: int = 0
    mean: float = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        self.mean += (x - self.mean) / self.count


@dataclass
class ToolDurations:
    """Per tool name, a log-normal fitted online to its observed durations (module
    docstring); trusted once it has ``min_count`` observations."""

    min_count: int = 3
    max_keys: int = MAX_KEYS
    _stats: OrderedDict[str, _LogStats] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.min_count < 1:
            raise EngineConfigError(f"min_count must be >= 1, got {self.min_count}")

    def observe(self, tool: str, seconds: float) -> None:
        """A call of ``tool`` took ``seconds`` (floored at `MIN_DURATION_S`)."""
        stats = self._stats.pop(tool, None) or _LogStats()
        stats.add(math.log(max(seconds, MIN_DURATION_S)))
        self._stats[tool] = stats
        if len(self._stats) > self.max_keys:
            self._stats.popitem(last=False)

    def count(self, tool: str) -> int:
        """Observations of ``tool`` so far."""
        stats = self._stats.get(tool)
        return 0 if stats is None else stats.count

    def median(self, tool: str) -> float | None:
        """The median seconds of ``tool`` (``exp`` of the mean log), or None until it has
        ``min_count`` observations. The median, not the mean: tool times are heavy-tailed,
        and a retention rank or a prefetch timed by the mean would wait on the rare long call
        for the typical one."""
        stats = self._stats.get(tool)
        if stats is None or stats.count < self.min_count:
            return None
        return math.exp(stats.mean)
