"""Plain data of the agent layer: tool calls and results, session states and metrics, config."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edmm.agent.gate import SpeculationGate
from edmm.agent.owners import KeyQuota
from edmm.engine.errors import EngineConfigError

ToolContent = str | Sequence[int]  # text (tokenized with the model's tokenizer) or token ids


class TagKind(enum.Enum):
    """Whose KV a `SessionTag` names."""

    SESSION = "session"  # the session's own context: its last turn's KV
    BRANCH = "branch"  # one speculation branch of its open tool window
    LOST = "lost"  # the branches that lost at its resumes (freed with the session)


@dataclass(frozen=True)
class SessionTag:
    """The tag of an agent session's prefix-cache entries (`edmm.engine.CacheTag`): a value,
    compared and hashed by its fields, never parsed. ``key`` names a branch (its speculation
    source's key) and is empty for the other kinds."""

    session_id: str
    kind: TagKind
    key: str = ""

    def __post_init__(self) -> None:
        if (self.kind is TagKind.BRANCH) != bool(self.key):
            raise ValueError(f"{self!r}: a branch tag has a key, other tags none")

    @classmethod
    def session(cls, session_id: str) -> SessionTag:
        """The tag of the session's own KV."""
        return cls(session_id, TagKind.SESSION)

    @classmethod
    def branch(cls, session_id: str, key: str) -> SessionTag:
        """The tag of the session's speculation branch ``key``."""
        return cls(session_id, TagKind.BRANCH, key)

    @classmethod
    def lost(cls, session_id: str) -> SessionTag:
        """The tag of the session's branches that lost at a resume."""
        return cls(session_id, TagKind.LOST)


class SessionState(enum.IntEnum):
    """Execution state of an agent session, in lifecycle order.

    ``GENERATING -> FINISHED`` (the turn ended) ``-> AWAITING_TOOL`` (the caller reports tool
    calls) ``-> RESUMING`` (results arrived) ``-> GENERATING`` (first token of the resume) ...;
    a FINISHED session also takes a new user turn (``-> GENERATING``). ``ABANDONED`` is
    terminal: no result before the deadline, or closed; the session's KV is reclaimed.
    """

    GENERATING = 0  # a turn is queued or running
    AWAITING_TOOL = 1  # the turn ended in tool calls; tools run, speculation fills the window
    RESUMING = 2  # results arrived; the resume turn waits for admission (commit, prefill)
    FINISHED = 3  # the last turn ended; no tool call pending
    ABANDONED = 4  # terminal: deadline passed or closed; KV reclaimed

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model emitted (OpenAI ``tool_calls[i]``)."""

    id: str
    name: str
    arguments: str = "{}"  # JSON text, as emitted by the model

    def arguments_dict(self) -> Any:
        """The arguments parsed (raises ``json.JSONDecodeError`` on malformed JSON)."""
        return json.loads(self.arguments)

    def memo_key(self) -> tuple[str, str] | None:
        """``(name, canonical arguments)`` identifying the call of an idempotent tool; None if
        the arguments are not valid JSON."""
        try:
            canonical = json.dumps(self.arguments_dict(), sort_keys=True, separators=(",", ":"))
        except (json.JSONDecodeError, TypeError):
            return None
        return self.name, canonical


@dataclass(frozen=True)
class ToolResult:
    """The real result of a pending tool call.

    ``position``: where the result is inserted, as a token index into the session's context
    (``0..len(context)``); None: where the session's layout puts it (after the context).
    """

    call_id: str
    content: ToolContent
    position: int | None = None


@dataclass(frozen=True)
class ToolSpec:
    """What is known of a tool before it runs.

    ``cacheable``: idempotent (same arguments, same result): real results are memoised and
    predicted for later calls. ``expected_duration_s``: a prior for the retention policy and
    the prefetch, until the tool's own durations are learned (`edmm.agent.learning`).
    """

    name: str
    cacheable: bool = False
    expected_duration_s: float | None = None


@dataclass(frozen=True)
class TokenLayout:
    """How results enter the next prompt when no chat template renders it (token-id sessions):

    ``next prompt = context`` with each result, wrapped as ``before + result + after``, inserted
    at its position (default: the end of the context), then ``suffix``.
    """

    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    positions: Mapping[str, int] = field(default_factory=dict)  # call id -> insertion position


@dataclass
class SessionMetrics:
    """Per-session counters (cumulative over the session's resumes).

    ``tokens_reused``: prompt tokens of resume turns whose KV was already there (retained or
    speculated); ``tokens_recomputed``: the rest, prefilled at resume;
    ``context_tokens_recomputed``: over every finished turn, tokens of the session's previous
    context (prompt + output of its last turn) that the turn's prompt repeated and that were
    computed again rather than reused (a lost context). A resume that commits a
    speculation branch (or the session's slot speculated in place) matching all its tokens is
    a hit, one matching part of them a partial, and one whose speculation lost to the
    retained KV (or had none to use) a miss.
    """

    session_id: str
    turns: int = 0
    resumes: int = 0
    tokens_reused: int = 0
    tokens_recomputed: int = 0
    tokens_speculated: int = 0  # tokens prefilled by speculation (branches and in place)
    context_tokens_recomputed: int = 0
    spec_hits: int = 0
    spec_partial: int = 0
    spec_misses: int = 0
    spec_gated: int = 0  # branches not started: the gate found them not paying
    spec_in_place: int = 0  # speculations started in the session's own slot, not a branch
    resume_ttft_s: list[float] = field(default_factory=list)  # resume() to first token
    commit_s: list[float] = field(default_factory=list)  # slot lookup + commit + truncate
    abandoned: bool = False

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy."""
        d = dict(self.__dict__)
        d["resume_ttft_s"] = list(self.resume_ttft_s)
        d["commit_s"] = list(self.commit_s)
        return d


@dataclass(frozen=True)
class AgentStats:
    """A snapshot of the agent layer's counters (`AgentEngine.stats`): the live sessions by
    state name, and the sums of `SessionMetrics` over every session since start (closed
    ones included)."""

    sessions: Mapping[str, int]  # live sessions by lower-case state name
    turns: int = 0
    resumes: int = 0
    spec_hits: int = 0
    spec_partial: int = 0
    spec_misses: int = 0
    tokens_speculated: int = 0
    context_tokens_recomputed: int = 0
    spec_gated: int = 0
    spec_in_place: int = 0


ADMISSION_ORDERS = ("arrival", "program", "resumes-first")


@dataclass(frozen=True)
class AgentConfig:
    """Agent-layer settings.

    Attributes:
        speculation: names of the speculation sources to run (registry of
            `edmm.agent.speculation`); empty: no speculation (EDMM off).
        retention: name of the retention policy for paused sessions' KV
            (`edmm.agent.retention`); ``"lru"`` treats it like any cache entry (engines today).
        tool_timeout_s: default deadline of a tool window; a session still awaiting a tool
            after it is abandoned and its KV reclaimed.
        reserialize_arguments: re-serialise tool-call arguments the way OpenAI clients do
            (``json.dumps(json.loads(arguments))``) when rendering the next prompt.
        prefetch_lead_s: with KV offload on (`EngineConfig.kv_offload_bytes`), a paused
            session whose KV went to host memory is copied back once its tool is expected
            back within this many seconds and the pool has room (a resume restores it anyway).
        max_sessions: sessions kept; past it the least recently used ones that are not
            generating are closed (their KV released).
        prefetch: copy offloaded sessions back ahead of their predicted return (False: only at
            resume, as an offloading cache without predictions does).
        speculation_gate: start a speculation branch only where its expected saving exceeds
            its cost (`edmm.agent.gate.SpeculationGate`); None: every branch a source offers.
        speculate_in_place: a speculation that continues the session's own KV is prefilled in
            the session's own slot (its driver cost: the new tokens' pages only), not in a
            branch mapping the session's whole prefix; a miss truncates the slot back to the
            match at resume. One key of a window at a time (`AgentEngine`). False: every
            speculation branches.
        admission: the order in which waiting turns are admitted (`ADMISSION_ORDERS`):
            ``"arrival"``: each turn in its own arrival order (first come, first served, as
            engines do today); ``"program"``: program-level first come, first served
            (Continuum's scheduling): a session's turns in the order the sessions started, so
            a resume goes ahead of the turns of sessions that started after it;
            ``"resumes-first"``: resumes (whose context has KV resident, on the host or in a
            branch: a short prefill) ahead of other turns (a cold prompt). Both within
            ``admission_jump``.
        report_window_s: a session whose turn just finished is held like one awaiting a tool
            of unknown duration for up to this many seconds, until its caller reports how the
            turn ended (`AgentEngine.await_tools`, or `AgentEngine.end_turn`: no tool call).
            A server knows only once it has parsed the reply, one or two engine steps later;
            without the hold the session's KV is an ordinary entry meanwhile, the first to be
            evicted (and not offloaded) when other sessions' KV is retained. 0: not held.
        quota: what one owner (a client) may hold (`edmm.agent.owners.KeyQuota`), checked
            by `AgentEngine.admit`; the default bounds nothing.
        learn_tool_durations: a tool window with no duration from the client is expected to
            last its tool's learned median (`edmm.agent.learning.ToolDurations`, once
            trusted), for retention and prefetch; False: only the declared duration
            (`ToolSpec`), if any.
        admission_jump: under the ``program`` and ``resumes-first`` orders, how far a turn
            may jump the queue: it goes ahead of at most the ``admission_jump`` turns that
            arrived just before it, so every turn, first turns included, is overtaken by at
            most ``admission_jump`` turns that arrived after it, however many resumes keep
            arriving and however short memory is (turns are counted, not seconds, so the bound
            holds at any load and time scale). 0: arrival order; None: no bound.

    ``AgentConfig.off()`` is EDMM off: no speculation, paused sessions' KV a plain LRU entry.
    """

    speculation: tuple[str, ...] = ("template", "streamed", "predicted", "prompt")
    retention: str = "cost"
    tool_timeout_s: float = 600.0
    reserialize_arguments: bool = True
    prefetch_lead_s: float = 0.5
    max_sessions: int = 4096
    prefetch: bool = True
    speculation_gate: SpeculationGate | None = None
    speculate_in_place: bool = True
    learn_tool_durations: bool = True
    admission: str = "program"
    admission_jump: int | None = 8
    report_window_s: float = 5.0
    quota: KeyQuota = field(default_factory=KeyQuota)

    @classmethod
    def off(cls) -> AgentConfig:
        """The same sessions with speculation, retention and program-level ordering off
        (what engines do today)."""
        return cls(speculation=(), retention="lru", admission="arrival")

    def __post_init__(self) -> None:
        if self.admission not in ADMISSION_ORDERS:
            raise EngineConfigError(f"admission must be one of {ADMISSION_ORDERS}, "
                                    f"got {self.admission!r}")
        if self.admission_jump is not None and self.admission_jump < 0:
            raise EngineConfigError(
                f"admission_jump must be >= 0 or None, got {self.admission_jump}")
        if self.report_window_s < 0:
            raise EngineConfigError(f"report_window_s must be >= 0, got {self.report_window_s}")
        if self.max_sessions < 1:
            raise EngineConfigError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if self.prefetch_lead_s < 0:
            raise EngineConfigError(f"prefetch_lead_s must be >= 0, got {self.prefetch_lead_s}")
        if not self.tool_timeout_s > 0:
            raise EngineConfigError(f"tool_timeout_s must be > 0, got {self.tool_timeout_s}")
