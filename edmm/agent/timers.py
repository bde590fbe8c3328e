"""`Timers`: what the agent layer must do at a given clock time, per session.

A session has at most one pending timer of each kind (`TimerKind`): setting one replaces the
earlier one, cancelling forgets it. `due` pops the timers whose time has come, in time order,
in O(log n) each, so the work of an engine step or of an idle tick is that of the timers due
then, never a pass over every session. Replaced and cancelled timers stay in the heap until
they come up (then they are skipped) or until the heap is rebuilt: it is rebuilt from the live
timers whenever it holds more than twice as many entries as there are live timers.
"""

from __future__ import annotations

import enum
import heapq
import itertools

_SLACK = 64  # heap entries beyond twice the live timers before a rebuild


class TimerKind(enum.Enum):
    """What a timer does when it comes up (`edmm.agent.AgentEngine` acts on it)."""

    DEADLINE = "deadline"  # the tool window's deadline: the session is abandoned
    HOLD_END = "hold_end"  # a finished turn's report window ends: its hold is released
    RANK = "rank"  # the retention rank of a paused session is due to be computed again
    PREFETCH = "prefetch"  # a paused session enters its prefetch window


class Timers:
    """Pending timers of sessions (see the module docstring). Not thread-safe."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, TimerKind]] = []
        self._live: dict[tuple[str, TimerKind], tuple[float, int]] = {}  # -> (due, serial)
        self._serial = itertools.count()

    def __len__(self) -> int:
        """Live timers."""
        return len(self._live)

    def set(self, session_id: str, kind: TimerKind, due: float) -> None:
        """Do ``kind`` for ``session_id`` at clock time ``due`` (replacing its earlier one)."""
        serial = next(self._serial)
        self._live[(session_id, kind)] = (due, serial)
        heapq.heappush(self._heap, (due, serial, session_id, kind))
        if len(self._heap) > 2 * len(self._live) + _SLACK:
            self._rebuild()

    def cancel(self, session_id: str, *kinds: TimerKind) -> None:
        """Forget the session's timers of ``kinds`` (none given: of every kind)."""
        for kind in kinds or TimerKind:
            self._live.pop((session_id, kind), None)

    def pending(self, session_id: str, kind: TimerKind) -> float | None:
        """When the session's timer of ``kind`` comes up (None: it has none)."""
        found = self._live.get((session_id, kind))
        return None if found is None else found[0]

    def next_due(self) -> float | None:
        """The clock time of the earliest live timer (None: there is none)."""
        heap = self._heap
        while heap and self._stale(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def due(self, now: float) -> list[tuple[str, TimerKind]]:
        """Pop the live timers due at or before ``now``, earliest first."""
        out = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if not self._stale(entry):
                del self._live[(entry[2], entry[3])]
                out.append((entry[2], entry[3]))
        return out

    def _stale(self, entry: tuple[float, int, str, TimerKind]) -> bool:
        live = self._live.get((entry[2], entry[3]))
        return live is None or live[1] != entry[1]

    def _rebuild(self) -> None:
        self._heap = [(due, serial, sid, kind)
                      for (sid, kind), (due, serial) in self._live.items()]
        heapq.heapify(self._heap)
