"""Summaries of a server's stage log (`edmm.server.stages`) for the benches' results."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from edmm.bench.stats import percentile
from edmm.server.stages import engine_split_ms, spans_ms


def stage_summary(records: Sequence[Mapping[str, Any]],
                  label: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per stage span of ``records`` (stage-log records of one condition, named by
    ``label``'s columns): its count, median, p90 and largest milliseconds; then the engine
    span split at the scheduler's admission (`engine_split_ms`) and the requests' steps
    waiting for memory."""
    spans: dict[str, list[float]] = {}
    for rec in records:
        marks = rec["marks"]
        for name, ms in {**spans_ms(marks), **engine_split_ms(marks)}.items():
            spans.setdefault(name, []).append(ms)
        waits = (rec.get("counts") or {}).get("memory_wait_steps")
        if waits is not None:
            spans.setdefault("memory_wait_steps (count)", []).append(float(waits))
    return [{**label, "span": name, "n": len(xs), "p50": percentile(xs, 50),
             "p90": percentile(xs, 90), "max": max(xs)} for name, xs in spans.items()]


class StageLogReader:
    """The records a stage log gained since the last `take` (the server appends one JSON
    line per finished request; a log not written yet has none)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0  # bytes read so far (whole lines: a record is written at once)

    def take(self) -> list[dict[str, Any]]:
        """The records appended since the last call (or since this reader was made)."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            new = f.read()
        new = new[: new.rfind(b"\n") + 1]  # a line still being written waits for next time
        self._offset += len(new)
        return [json.loads(line) for line in new.splitlines() if line.strip()]
