"""Per-request stage timestamps of chat and text-completion requests, for the live-resume and
load profiles (off by default).

Set ``EDMM_STAGE_LOG=/path/stages.jsonl`` in ``edmm serve``'s environment and each chat
request appends one JSON line ``{"id": <chatcmpl id>, "stream": bool, "prompt_tokens": n,
"marks": {stage: unix time in ns}}`` when it ends; a text completion (``cmpl`` id) the record
of its first prompt, with the stages it has: ``received``, ``arrive``, ``parsed``,
``request_made`` (the prompt checked, sampling params), the engine's and the event loop's
from ``step_start`` on. Stages, in order (`STAGES`):

- ``received``: the request's body was read (`RequestGuard`), before it is parsed;
- ``arrive``: the route's handler runs (through the framework's routing and middleware);
- ``parsed``: the body was parsed and validated (`edmm.server.body`);
- ``validated``: options checked, messages and tools converted for the template;
- ``render_start``: the tokenizing thread took the job; ``rendered``: the chat template ran;
  ``tokenized``: the ids are there; ``back``: the event loop has the engine request (made
  on the tokenizing thread: ids checked, sampling params);
- ``request_made``: the request has its grammars (if any) and cache salt (a chat with no
  grammar to wait for: on the tokenizing thread, which sends it to the engine thread itself,
  so it has no ``back``);
- ``engine_picked``: the engine thread took the submission; ``begun``: the session matched and
  the request queued;
- ``step_start``: the engine thread began its first step after that; ``output_put``: it
  handed the first output to the event loop (the steps until then: the engine's own time);
- ``first_output``: the first output reached the event loop (the hand-back);
- ``first_event``: the first content event is serialised (streamed), or the response object
  is built (not streamed).

``submitted`` (the event loop learnt that the request is queued) is recorded too but is no
stage of the chain: the engine steps meanwhile, so it lies beside ``step_start``, not before
it. Nor is ``scheduled``, the scheduler's first admission of the request (`RequestTiming`),
which lies inside ``step_start->output_put``: before it the request waited (for memory, the
token budget or a sequence place), after it the engine computed its first token. The
record's ``counts`` has ``memory_wait_steps``: the steps the request headed the queue and was
not admitted for lack of KV memory.

Each record also says how many garbage collections (per generation) ran anywhere in the
process between ``arrive`` and ``first_event`` (``"gc"``): a collection inside a request's
time to first token stalls every thread.

Wall-clock nanoseconds (``time.time_ns``) so that a client on the same host can put its own
send and receive times beside them (`edmm bench live --stages`).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from edmm.engine import RequestTiming

STAGES = ("received", "arrive", "parsed", "validated", "render_start", "rendered", "tokenized",
          "back", "request_made", "engine_picked", "begun", "step_start", "output_put",
          "first_output", "first_event")
ENV = "EDMM_STAGE_LOG"


LAST = STAGES[-1]


def _collections() -> list[int]:
    return [generation["collections"] for generation in gc.get_stats()]


class Tracer(Protocol):
    """The stage marks of one chat request: a `StageTimer` when the stage log is on, else
    `NO_TRACE`, whose methods do nothing (the server calls them either way, with no test of
    whether timing is on)."""

    def mark(self, stage: str) -> None:
        """Record ``stage`` now, unless it was recorded already (any thread)."""

    def first_output(self, engine_ns: tuple[int | None, int | None],
                     timing: RequestTiming | None) -> None:
        """Record the first output's arrival on the event loop (``first_output``), with the
        engine thread's times before it (``step_start``, ``output_put``: its output
        stream's `engine_ns`) and the scheduler's (``scheduled``, ``memory_wait_steps``)."""

    def finish(self, response_id: str, stream: bool, prompt_tokens: int) -> None:
        """Append the request's record to the log (its response's id, streamed or not)."""


class _NoTrace:
    """`Tracer` of a server whose stage log is off."""

    __slots__ = ()

    def mark(self, stage: str) -> None:
        """Nothing."""

    def first_output(self, engine_ns: tuple[int | None, int | None],
                     timing: RequestTiming | None) -> None:
        """Nothing."""

    def finish(self, response_id: str, stream: bool, prompt_tokens: int) -> None:
        """Nothing."""


NO_TRACE: Tracer = _NoTrace()


@dataclass
class StageTimer:
    """The marks of one request (first mark of a stage wins; any thread may mark) and the
    garbage collections from its creation to its last stage (`LAST`); ``path``: the log its
    record goes to (`finish`; None: nowhere)."""

    marks: dict[str, int] = field(default_factory=dict)
    gc_before: list[int] = field(default_factory=_collections)
    gc_during: list[int] | None = None  # set when `LAST` is marked
    counts: dict[str, int] = field(default_factory=dict)  # per-request counters (``counts``)
    path: str | None = None

    def mark(self, stage: str) -> None:
        """Record ``stage`` now, unless it was recorded already."""
        if stage not in self.marks:
            self.marks[stage] = time.time_ns()
            if stage == LAST:
                self.gc_during = [b - a for a, b in zip(self.gc_before, _collections(),
                                                        strict=True)]

    def first_output(self, engine_ns: tuple[int | None, int | None],
                     timing: RequestTiming | None) -> None:
        """`Tracer.first_output` (once: later calls change nothing)."""
        if "first_output" in self.marks:
            return
        for stage, ns in zip(("step_start", "output_put"), engine_ns, strict=True):
            if ns is not None:
                self.marks.setdefault(stage, ns)
        if timing is not None:
            if timing.first_scheduled_ns is not None:
                self.marks.setdefault("scheduled", timing.first_scheduled_ns)
            self.counts["memory_wait_steps"] = timing.memory_wait_steps
        self.mark("first_output")

    def finish(self, response_id: str, stream: bool, prompt_tokens: int) -> None:
        """`Tracer.finish`: one JSON line appended to ``path``."""
        if self.path is None:
            return
        record = {"id": response_id, "stream": stream, "prompt_tokens": prompt_tokens,
                  "marks": self.marks, "gc": self.gc_during, "counts": self.counts}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


class StageLog:
    """Where finished requests' marks go: a JSON-lines file, or nowhere (``path`` None)."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    @classmethod
    def from_env(cls) -> StageLog:
        """The log named by ``$EDMM_STAGE_LOG`` (off when unset or empty)."""
        return cls(os.environ.get(ENV) or None)

    @property
    def enabled(self) -> bool:
        """True when requests are timed."""
        return self.path is not None

    def tracer(self, received_ns: int | None = None) -> Tracer:
        """The tracer of a new request, its ``arrive`` marked (and ``received``, its body
        read, at ``received_ns`` when given); `NO_TRACE` when off."""
        if self.path is None:
            return NO_TRACE
        timer = StageTimer(path=self.path)
        if received_ns is not None:
            timer.marks["received"] = received_ns
        timer.mark("arrive")
        return timer


def spans_ms(marks: dict[str, int], client_sent_ns: int | None = None,
             client_first_ns: int | None = None,
             client_wire_ns: int | None = None) -> dict[str, float]:
    """Milliseconds between consecutive present stages (``from->to``), with the client's send
    (its call to the SDK; ``client_wire``: the SDK handing the request to HTTP) and
    first-receive times around them when given."""
    points: list[tuple[str, int]] = []
    if client_sent_ns is not None:
        points.append(("client_sent", client_sent_ns))
    if client_wire_ns is not None:
        points.append(("client_wire", client_wire_ns))
    points += [(s, marks[s]) for s in STAGES if s in marks]
    if client_first_ns is not None:
        points.append(("client_first", client_first_ns))
    return {f"{a}->{b}": (tb - ta) / 1e6 for (a, ta), (b, tb) in itertools.pairwise(points)}


ENGINE_SPLIT = (("step_start", "scheduled"), ("scheduled", "output_put"))


def engine_split_ms(marks: dict[str, int]) -> dict[str, float]:
    """``step_start->output_put`` split at the scheduler's first admission (``scheduled``):
    the wait before it (memory, the token budget, a sequence place) and the engine's compute
    after it, in milliseconds (``(a->b)``, not stages of the chain); empty without the marks."""
    if not all(s in marks for pair in ENGINE_SPLIT for s in pair):
        return {}
    return {f"({a}->{b})": (marks[b] - marks[a]) / 1e6 for a, b in ENGINE_SPLIT}


def read_log(path: str) -> dict[str, dict[str, Any]]:
    """The records of a stage log by request id."""
    out: dict[str, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out[rec["id"]] = rec
    return out
