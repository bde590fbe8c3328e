"""Speculation sources: what to prefill, in a branch, while a session's tools run.

Each source turns the tool window's state into `Speculation`s: token ids of a probable next
prompt (or of its first part) under a key. The agent layer prefills each at low priority, in
the session's own slot when it continues the session's KV (in place: `ToolWindow.in_place`),
else in an arena branch; a later speculation under the same key replaces the earlier one and
continues from its KV. At resume the branch (or the session's own slot) sharing the longest
token prefix with the real prompt is committed, truncated after the match.

Sources are looked up by name in a `Registry` (``SPECULATION_SOURCES``), so a deployment picks
them by configuration (`AgentConfig.speculation`) and new ones plug in without touching the
agent layer.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from edmm.agent.registry import Registry
from edmm.agent.render import PromptRenderer
from edmm.agent.types import ToolCall, ToolContent


@dataclass
class ToolWindow:
    """What is known of a paused session's next prompt while its tools run."""

    calls: dict[str, ToolCall]  # call id -> call, in emission order
    renderer: PromptRenderer
    started: float  # clock time the window opened
    deadline: float  # clock time after which the session is abandoned
    expected_s: float | None = None  # predicted tool duration
    predictions: dict[str, ToolContent] = field(default_factory=dict)  # call id -> result
    predicted_positions: dict[str, int] = field(default_factory=dict)  # where they would go
    streamed: dict[str, StreamFold] = field(default_factory=dict)  # call id -> output so far
    closed: set[str] = field(default_factory=set)  # calls whose streamed output is complete
    max_tokens: int | None = None  # the longest prompt worth speculating (the context)
    predicted_prompt: list[int] | None = None  # the whole next prompt, as the client predicts
    branches: dict[str, Branch] = field(default_factory=dict)  # speculations started, by key
    # The key whose speculation extends the session's own slot (in place), the tokens it asked
    # for, and the tokens of the session's own KV it continues (its first ``own_tokens``).
    in_place: str | None = None
    in_place_ids: list[int] = field(default_factory=list)
    own_tokens: int = 0
    in_place_branch: Branch | None = None  # the in-place speculation's source and tool


@dataclass(frozen=True)
class Branch:
    """Where a speculation branch came from: the source that offered it and the tool key it
    speculates on (`edmm.agent.learning.window_tool`), what its outcome is counted under."""

    source: str
    tool: str


MAX_CHARS_PER_TOKEN = 32  # a bound on text one token covers: past budget * this, stop folding
MAX_TAIL_CHARS = 256  # the most text encoded again with each chunk (`StreamFold.tail`)


@dataclass
class StreamFold:
    """A running tool's output so far, folded into token ids chunk by chunk.

    Only new text is tokenized: the text up to the last whitespace of what arrived is encoded
    once and kept (``ids``); the rest (``tail``, a word that may go on) is encoded again with
    the next chunk. A tail past `MAX_TAIL_CHARS` (text without whitespace: minified JSON,
    base64) is cut where a letter or digit meets punctuation (a pre-token boundary of byte-level
    BPE tokenizers), else anywhere, so each chunk costs its own length plus at most
    `MAX_TAIL_CHARS` (the ids may then differ from the whole text's at such a cut: speculation
    reuses less). The work per call is bounded by the context: once the prompt would pass
    ``max_tokens`` (or the text past it is cut), the fold is ``full`` and speculates no more.
    Speculation only: the prompt of the resume is the client's, tokenized whole.
    """

    is_text: bool
    head: list[int] | None = None  # the prompt up to where the content starts (source's)
    ids: list[int] = field(default_factory=list)  # token ids of the content before ``tail``
    tail: str = ""
    full: bool = False

    def extend(self, chunk: ToolContent, encode: Callable[[str], list[int]],
               max_tokens: int | None) -> list[int] | None:
        """Fold ``chunk`` in; the prompt up to the end of the output so far, or None once
        ``full`` (``head`` must be set)."""
        assert self.head is not None
        if self.full:
            return None
        if isinstance(chunk, str):
            self._extend_text(chunk, encode, max_tokens)
        else:
            self.ids += [int(t) for t in chunk]
        ids = self.head + self.ids + (encode(self.tail) if self.tail else [])
        if max_tokens is not None and len(ids) > max_tokens:
            self.full = True
            return None
        return ids

    def _extend_text(self, chunk: str, encode: Callable[[str], list[int]],
                     max_tokens: int | None) -> None:
        assert self.head is not None
        text = self.tail + chunk
        if max_tokens is not None:
            limit = max(0, max_tokens - len(self.head) - len(self.ids)) * MAX_CHARS_PER_TOKEN
            if len(text) > limit:
                text, self.full = text[:limit], True
        cut = _last_boundary(text)
        if len(text) - cut > MAX_TAIL_CHARS:
            cut = _forced_boundary(text, len(text) - MAX_TAIL_CHARS // 2)
        if cut > 0:
            self.ids += encode(text[:cut])
        self.tail = text[cut:]


def _forced_boundary(text: str, end: int) -> int:
    """Index of the last place before ``end`` (and past ``end - MAX_TAIL_CHARS // 2``) where
    punctuation follows a letter or digit; ``end`` if there is none."""
    for i in range(end, max(0, end - MAX_TAIL_CHARS // 2), -1):
        if text[i - 1].isalnum() and not text[i].isalnum() and not text[i].isspace():
            return i
    return end


def _last_boundary(text: str) -> int:
    """Index of the last whitespace of ``text`` that a word follows (a token boundary for
    word-level pre-tokenizers: that space starts the word; a trailing run of whitespace may
    still join what comes next); 0 if there is none."""
    for i in range(len(text) - 2, 0, -1):
        if text[i].isspace() and not text[i + 1].isspace():
            return i
    return 0


@dataclass(frozen=True)
class Speculation:
    """A probable next prompt (or its first part) to prefill in the branch named ``key``;
    ``call_id``: the one call whose result it speculates on (None: the window's calls)."""

    key: str
    token_ids: list[int]
    call_id: str | None = None


class SpeculationSource(abc.ABC):
    """Turns tool-window events into speculations (each hook returns a list, maybe empty)."""

    name: ClassVar[str]

    def on_await(self, window: ToolWindow) -> list[Speculation]:
        """The window opened (tool calls known; predictions and memoised results too)."""
        return []

    def on_output(self, window: ToolWindow, call_id: str,
                  chunk: ToolContent) -> list[Speculation]:
        """More partial output of ``call_id`` arrived: ``chunk`` (what came before is folded
        in ``window.streamed[call_id]``)."""
        return []

    def on_predict(self, window: ToolWindow, call_id: str) -> list[Speculation]:
        """A result of ``call_id`` was predicted (in ``window.predictions``)."""
        return []

    def on_prompt(self, window: ToolWindow) -> list[Speculation]:
        """The whole next prompt was predicted (in ``window.predicted_prompt``)."""
        return []


SPECULATION_SOURCES: Registry[SpeculationSource] = Registry("speculation source")


@SPECULATION_SOURCES.register("template")
class TemplateSource(SpeculationSource):
    """Everything up to the first tool result's position, rendered as the client will send it
    (chat template: earlier reasoning stripped where it does so, arguments re-serialised)."""

    name = "template"

    def on_await(self, window: ToolWindow) -> list[Speculation]:
        return [Speculation(self.name, window.renderer.render({}))]


@SPECULATION_SOURCES.register("streamed")
class StreamedSource(SpeculationSource):
    """The prompt up to the end of a running tool's partial output, extended chunk by chunk
    (the calls before it must be predicted)."""

    name = "streamed"

    def on_output(self, window: ToolWindow, call_id: str,
                  chunk: ToolContent) -> list[Speculation]:
        fold = window.streamed[call_id]
        if fold.head is None:  # the first chunk: render the prompt up to the content once
            results = _known_before(window, call_id, window.predictions)
            if results is None:
                fold.full = True  # an earlier result is unknown: nothing to extend
                return []
            results[call_id] = []
            fold.head = window.renderer.render(results, stop_after=call_id)
        ids = fold.extend(chunk, window.renderer.encode_content, window.max_tokens)
        return [] if ids is None else [Speculation(f"{self.name}:{call_id}", ids, call_id)]


@SPECULATION_SOURCES.register("predicted")
class PredictedSource(SpeculationSource):
    """The next prompt with every predicted (or memoised) result, up to the first call whose
    result is unknown: the whole prompt, known suffix included, when all are predicted."""

    name = "predicted"

    def on_await(self, window: ToolWindow) -> list[Speculation]:
        return self._speculate(window)

    def on_predict(self, window: ToolWindow, call_id: str) -> list[Speculation]:
        return self._speculate(window)

    def _speculate(self, window: ToolWindow) -> list[Speculation]:
        if not window.predictions:
            return []
        renderer = window.renderer.with_positions(window.predicted_positions)
        return [Speculation(self.name, renderer.render(window.predictions))]


@SPECULATION_SOURCES.register("prompt")
class PromptSource(SpeculationSource):
    """The whole next prompt exactly as the client predicts it (`AgentEngine.predict_prompt`):
    results anywhere in it (an earlier message edited, a memory block), which no renderer can
    place; prefilled from the longest common token prefix with the session's KV."""

    name = "prompt"

    def on_prompt(self, window: ToolWindow) -> list[Speculation]:
        ids = window.predicted_prompt
        return [Speculation(self.name, list(ids))] if ids is not None else []


def _known_before(window: ToolWindow, call_id: str,
                  known: Mapping[str, ToolContent]) -> dict[str, ToolContent] | None:
    """Results of the calls rendered before ``call_id``, or None if one is unknown."""
    out: dict[str, ToolContent] = {}
    for call in _render_order(window):
        if call.id == call_id:
            return out
        if call.id not in known:
            return None
        out[call.id] = known[call.id]
    return None


def _render_order(window: ToolWindow) -> list[ToolCall]:
    ordered = getattr(window.renderer, "ordered_calls", None)
    return list(ordered()) if ordered is not None else list(window.calls.values())
