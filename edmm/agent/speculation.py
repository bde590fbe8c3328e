"""Speculation sources: what to prefill, in a branch, while a session's tools run.

Each source turns the tool window's state into `Speculation`s: token ids of a probable next
prompt (or of its first part) under a key. The agent layer prefills each in an arena branch at
low priority; a later speculation under the same key replaces the earlier one and continues from
its KV. At resume the branch sharing the longest token prefix with the real prompt is committed.

Sources are looked up by name in a `Registry` (``SPECULATION_SOURCES``), so a deployment picks
them by configuration (`AgentConfig.speculation`) and new ones plug in without touching the
agent layer.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
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
    streamed: dict[str, ToolContent] = field(default_factory=dict)  # call id -> output so far
    predicted_prompt: list[int] | None = None  # the whole next prompt, as the client predicts
    branches: set[str] = field(default_factory=set)  # keys of the speculations started


@dataclass(frozen=True)
class Speculation:
    """A probable next prompt (or its first part) to prefill in the branch named ``key``."""

    key: str
    token_ids: list[int]


class SpeculationSource(abc.ABC):
    """Turns tool-window events into speculations (each hook returns a list, maybe empty)."""

    name: ClassVar[str]

    def on_await(self, window: ToolWindow) -> list[Speculation]:
        """The window opened (tool calls known; predictions and memoised results too)."""
        return []

    def on_output(self, window: ToolWindow, call_id: str) -> list[Speculation]:
        """More partial output of ``call_id`` arrived (in ``window.streamed``)."""
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

    def on_output(self, window: ToolWindow, call_id: str) -> list[Speculation]:
        results = _known_before(window, call_id, window.predictions)
        if results is None:
            return []
        results[call_id] = window.streamed[call_id]
        ids = window.renderer.render(results, stop_after=call_id)
        return [Speculation(f"{self.name}:{call_id}", ids)]


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
