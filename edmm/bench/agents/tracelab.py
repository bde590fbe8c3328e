"""TraceLab's replay CSV: one row per model call, read into jobs and written from them.

The columns (TraceLab's ``csv_export``; ``session_id`` is accepted for ``id``)::

    id,input_len,output_len,arrival_time,round_idx,tool_wait_after_ms,prefix_len

per call: ``prefix_len`` tokens of the prompt served from the prefix cache, ``input_len``
tokens appended after them (the prompt is their sum), ``output_len`` generated,
``tool_wait_after_ms`` the tool time before the session's next call (0 on its last), and the
session's ``arrival_time`` in milliseconds (every row of a session the same).

Read as jobs (`read_tracelab`): a session is a job of its calls in ``round_idx`` order
(contiguous from 0); every call but the last ends in one tool call (named ``tool``) of
``tool_wait_after_ms`` whose result is what the next call appends. Where the next call's
``prefix_len`` is shorter than the context (prompt + output) before it, the context was
rewritten (a compaction, reasoning dropped): the turn keeps ``prefix_len`` tokens
(``Turn.keep_tokens``) and the result is the ``input_len`` tokens after them. The first call's
``prefix_len`` is a prefix shared with other sessions (a system prompt and tool schemas):
sessions whose first ``prefix_len`` is the same share it, token for token (agent type
``prefix-<len>``).

Written from jobs (`write_tracelab`) with the same reading, so a trace of such jobs writes
and reads back to the same jobs. What the CSV has no column for is folded in: a user message
is a call's appended tokens and its thinking time the wait, a subagent a session of its own
(its parent's call keeps the subagent's expected time), tool names and flags are dropped.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path

from edmm.bench.agents.trace import Job, TraceError, Turn, check_jobs, turn_shapes

FIELDS = ("id", "input_len", "output_len", "arrival_time", "round_idx", "tool_wait_after_ms",
          "prefix_len")
TOOL = "tool"


def read_tracelab(path: Path | str) -> list[Job]:
    """The jobs of a TraceLab replay CSV, in order of arrival (then of first appearance);
    `TraceError` names the file, the line and the column of anything malformed."""
    text = Path(path).read_text(encoding="utf-8")
    return parse_tracelab(text, str(path))


def parse_tracelab(text: str, where: str = "csv") -> list[Job]:
    """`read_tracelab` of CSV text."""
    reader = csv.DictReader(io.StringIO(text))
    header = set(reader.fieldnames or ())
    if "session_id" in header and "id" not in header:
        header = (header - {"session_id"}) | {"id"}
    missing = [f for f in FIELDS if f not in header]
    if missing:
        raise TraceError(f"{where}: missing columns {missing} (a TraceLab replay CSV has "
                         f"{', '.join(FIELDS)})")
    sessions: dict[str, list[tuple[int, dict[str, float]]]] = {}
    for line, row in enumerate(reader, 2):
        sid = row.get("id", row.get("session_id"))
        if not sid:
            raise TraceError(f"{where}:{line}: empty id")
        sessions.setdefault(sid, []).append((line, _numbers(row, where, line)))
    if not sessions:
        raise TraceError(f"{where}: no rows")
    jobs = [_job(sid, rows, where) for sid, rows in sessions.items()]
    order = {j.job_id: i for i, j in enumerate(jobs)}
    jobs.sort(key=lambda j: (j.arrival_s, order[j.job_id]))
    check_jobs(jobs, where)
    return jobs


def _numbers(row: dict[str, str], where: str, line: int) -> dict[str, float]:
    out = {}
    for name in FIELDS[1:]:
        text = row.get(name)
        try:
            value = float(text) if text is not None else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise TraceError(f"{where}:{line}: {name} must be a number >= 0, got {text!r}")
        if name not in ("arrival_time", "tool_wait_after_ms") and value != int(value):
            raise TraceError(f"{where}:{line}: {name} must be an integer, got {text!r}")
        out[name] = value
    return out


def _job(sid: str, rows: list[tuple[int, dict[str, float]]], where: str) -> Job:
    rows = sorted(rows, key=lambda r: r[1]["round_idx"])
    for want, (line, row) in enumerate(rows):
        if row["round_idx"] != want:
            raise TraceError(f"{where}:{line}: session {sid}: round_idx {row['round_idx']:g}, "
                             f"expected {want} (rounds contiguous from 0)")
        if row["output_len"] < 1:
            raise TraceError(f"{where}:{line}: output_len must be >= 1")
    arrivals = {row["arrival_time"] for _, row in rows}
    if len(arrivals) > 1:
        raise TraceError(f"{where}:{rows[0][0]}: session {sid} has arrival_time "
                         f"{sorted(arrivals)} (one per session)")
    first = rows[0][1]
    prefix = int(first["prefix_len"])
    system = prompt = prefix + int(first["input_len"])
    turns = []
    for i, (_, row) in enumerate(rows):
        out = int(row["output_len"])
        if i == len(rows) - 1:
            turns.append(Turn(out))
            break
        nxt = rows[i + 1][1]
        context = prompt + out
        kept, added = int(nxt["prefix_len"]), int(nxt["input_len"])
        keep = kept if kept < context else None
        appended = added if keep is not None else kept + added - context
        if appended < 1:
            raise TraceError(f"{where}:{rows[i + 1][0]}: session {sid}: the call appends no "
                             f"token to the context before it ({context} tokens)")
        turns.append(Turn(out, TOOL, round(row["tool_wait_after_ms"] / 1000, 9), appended,
                          keep_tokens=keep))
        prompt = kept + added
    try:
        return Job(sid, system, tuple(turns), round(first["arrival_time"] / 1000, 9),
                   f"prefix-{prefix}" if prefix else "", prefix)
    except TraceError as e:
        raise TraceError(f"{where}:{rows[0][0]}: session {sid}: {e}") from None


def tracelab_rows(jobs: Sequence[Job]) -> list[dict[str, str]]:
    """The CSV rows of ``jobs`` (module docstring: what is folded in)."""
    rows = []
    for job in jobs:
        for i, (t, s) in enumerate(zip(job.turns, turn_shapes(job), strict=True)):
            kept = s.kept if i else job.prefix_tokens
            rows.append({"id": job.job_id, "input_len": str(s.prompt - kept),
                         "output_len": str(s.output),
                         "arrival_time": f"{job.arrival_s * 1000:.6f}", "round_idx": str(i),
                         "tool_wait_after_ms": f"{t.wait_s * 1000:.6f}" if t.continues
                         else "0.000000", "prefix_len": str(kept)})
    return rows


def write_tracelab(jobs: Sequence[Job], path: Path | str) -> Path:
    """Write ``jobs`` as a TraceLab replay CSV."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(FIELDS))
        writer.writeheader()
        writer.writerows(tracelab_rows(jobs))
    return out


__all__ = ["FIELDS", "parse_tracelab", "read_tracelab", "tracelab_rows", "write_tracelab"]
