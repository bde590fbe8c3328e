"""The next prompt of a session whose turn ended in tool calls: its one home.

A tool window knows the next prompt except for the tool results. This module builds it, for
the agent layer and for the server alike:

- `assistant_message`: a reply as the client sends it back (the message before the results);
- `TokenRenderer` and `TemplateRenderer` (the agent's speculation, `PromptRenderer`): the next
  prompt's ids from the results known so far, in call order, up to right before the first
  call without one (a head: everything up to that result's position), or right after the
  content of ``stop_after`` (a streamed, still open result); with every result, the whole
  next prompt. `TokenRenderer` works on token ids (no tokenizer needed, e.g. for presets with
  random weights): results are inserted into the session's context at token positions,
  wrapped, and a suffix follows. `TemplateRenderer` renders chat messages with the model's
  chat template (tool results as ``tool`` messages, tool-call arguments re-serialised as
  clients do), the real results' contents included, then tokenizes the text;
- `template_view`: messages as a chat template reads them: tool-call arguments as the JSON
  objects their strings hold where the template needs objects (`arguments_as_objects`: it
  does not print an arguments string verbatim, as Qwen2.5's ``arguments | tojson`` escapes
  it), so the history a model sees holds its calls as it wrote them;
- `text_around_results`: the next prompt's text as pieces around its results, from renders
  with placeholder results (the server's awaited resume, `edmm.server.incremental`, which
  renders only the prompt's last window): the resume that carries the results is then the
  pieces joined with them, with no template run. Exact only for a template that renders a
  result's content verbatim, which the server probes before it trusts it.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from edmm.agent.errors import AgentError
from edmm.agent.types import TokenLayout, ToolCall, ToolContent
from edmm.model.prompt_encoder import PromptEncoder

_SENTINEL = "\u0000EDMM-RESULT\u0000"  # never produced by a template; cut the text at it


class PromptRenderer(abc.ABC):
    """Builds a session's next prompt (token ids) from tool results; see the module docstring."""

    calls: tuple[ToolCall, ...]

    @abc.abstractmethod
    def render(self, results: Mapping[str, ToolContent], stop_after: str | None = None,
               ) -> list[int]:
        """The next prompt with ``results`` (call id -> content) filled in call order, up to
        the first call without a result, or up to the end of ``stop_after``'s content."""

    def encode_content(self, text: str) -> list[int]:
        """Token ids of a piece of a result's text, as the renderer would encode it."""
        return content_ids(text, getattr(self, "tokenizer", None))

    def with_positions(self, positions: Mapping[str, int]) -> PromptRenderer:
        """A renderer that inserts the given calls' results at other token positions."""
        if positions:
            raise AgentError("insertion positions need a token layout, not a chat template")
        return self


def content_ids(content: ToolContent, tokenizer: Any) -> list[int]:
    """Token ids of a result: ids as given, text tokenized without special tokens."""
    if isinstance(content, str):
        if tokenizer is None:
            raise AgentError("a text tool result needs a tokenizer; pass token ids")
        return list(tokenizer.encode(content, add_special_tokens=False))
    return [int(t) for t in content]


def content_text(content: ToolContent, tokenizer: Any) -> str:
    """Text of a result: text as given, ids decoded."""
    if isinstance(content, str):
        return content
    if tokenizer is None:
        raise AgentError("token-id results in a chat template need a tokenizer")
    return str(tokenizer.decode(list(content)))


@dataclass(frozen=True)
class TokenRenderer(PromptRenderer):
    """``context`` with each result (``before + result + after``) inserted at its position
    (default: the end of the context), then ``suffix``; calls ordered by position."""

    context: tuple[int, ...]
    calls: tuple[ToolCall, ...]
    layout: TokenLayout
    tokenizer: Any = None

    def position(self, call_id: str) -> int:
        """Where a call's result goes, as a token index into the context."""
        return self.layout.positions.get(call_id, len(self.context))

    def with_positions(self, positions: Mapping[str, int]) -> TokenRenderer:
        """A copy whose layout puts the given calls' results at these positions."""
        merged = {**self.layout.positions, **positions}
        return replace(self, layout=replace(self.layout, positions=merged))

    def ordered_calls(self) -> list[ToolCall]:
        """Calls in the order their results appear in the prompt."""
        order = {c.id: i for i, c in enumerate(self.calls)}
        return sorted(self.calls, key=lambda c: (self.position(c.id), order[c.id]))

    def render(self, results: Mapping[str, ToolContent], stop_after: str | None = None,
               ) -> list[int]:
        out: list[int] = []
        cursor = 0
        for call in self.ordered_calls():
            pos = self.position(call.id)
            out += self.context[cursor:pos]
            cursor = pos
            out += self.layout.before
            if call.id not in results:
                return out
            out += content_ids(results[call.id], self.tokenizer)
            if call.id == stop_after:
                return out
            out += self.layout.after
        return out + list(self.context[cursor:]) + list(self.layout.suffix)


@dataclass(frozen=True)
class TemplateRenderer(PromptRenderer):
    """``messages`` plus one ``tool`` message per call, rendered with the tokenizer's chat
    template (generation prompt added) and tokenized, as an OpenAI-compatible server does."""

    tokenizer: Any
    messages: tuple[Mapping[str, Any], ...]
    calls: tuple[ToolCall, ...]
    tools: tuple[Mapping[str, Any], ...] | None = None
    reserialize_arguments: bool = True
    encoder: PromptEncoder | None = None  # reuses recent prompts' ids (the same result)

    def render(self, results: Mapping[str, ToolContent], stop_after: str | None = None,
               ) -> list[int]:
        tool_msgs: list[dict[str, Any]] = []
        cut = False
        for call in self.calls:
            if call.id not in results:
                content, cut = _SENTINEL, True
            else:
                content = content_text(results[call.id], self.tokenizer)
                if call.id == stop_after:
                    content, cut = content + _SENTINEL, True
            tool_msgs.append({"role": "tool", "tool_call_id": call.id, "name": call.name,
                              "content": content})
            if cut:
                break
        text = self._apply(tool_msgs)
        if cut:
            text = text[: text.index(_SENTINEL)]
        if self.encoder is not None:
            return self.encoder.encode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _apply(self, tool_msgs: list[dict[str, Any]]) -> str:
        messages = template_view(self.tokenizer,
                                 [self._client_view(m) for m in self.messages] + tool_msgs)
        tools = list(self.tools) if self.tools is not None else None
        return str(self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False))

    def _client_view(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """A message as a client sends it back: tool-call arguments re-serialised."""
        msg = dict(message)
        if self.reserialize_arguments and msg.get("tool_calls"):
            msg["tool_calls"] = [_reserialized(tc) for tc in msg["tool_calls"]]
        return msg


def _reserialized(tool_call: Mapping[str, Any]) -> dict[str, Any]:
    """``json.dumps(json.loads(arguments))``, as the OpenAI Python client's users do."""
    return _map_arguments(tool_call, lambda args: json.dumps(json.loads(args)))


def _map_arguments(tool_call: Mapping[str, Any], convert: Callable[[str], Any],
                   ) -> dict[str, Any]:
    """``tool_call`` (OpenAI's ``{"function": {...}}`` or a bare function) with its arguments
    string replaced by ``convert(arguments)``; kept where that raises `ValueError` (malformed
    JSON: sent back as is)."""
    tc = dict(tool_call)
    fn = dict(tc.get("function", tc))
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):
            fn["arguments"] = convert(args)
    if "function" in tc:
        tc["function"] = fn
        return tc
    return fn


_PROBE_ARGUMENTS = '{"edmm_probe": [1, "x"]}'


def template_view(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                  ) -> list[dict[str, Any]]:
    """``messages`` as ``tokenizer``'s chat template reads them: where the template needs
    objects (`arguments_as_objects`), each tool call's arguments string that holds a JSON
    object becomes that object (transformers' convention for chat templates; vLLM converts
    likewise); other strings stay as sent. Messages without tool calls are passed as they
    are."""
    if not any(m.get("tool_calls") for m in messages) or not arguments_as_objects(tokenizer):
        return [dict(m) for m in messages]
    return [_with_objects(m) if m.get("tool_calls") else dict(m) for m in messages]


def arguments_as_objects(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template does not print a tool call's arguments string
    verbatim (e.g. ``arguments | tojson`` alone, which escapes it into a JSON string): it needs
    the arguments as objects. Probed once per template (a render of one call)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return False
    return _needs_objects(tokenizer, template)


@functools.lru_cache(maxsize=8)
def _needs_objects(tokenizer: Any, template: str) -> bool:
    call = {"id": "call_0", "type": "function",
            "function": {"name": "edmm_probe", "arguments": _PROBE_ARGUMENTS}}
    messages = [{"role": "user", "content": "probe"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)
    except Exception:  # a template that cannot render a call: nothing to convert for
        return False
    return isinstance(text, str) and _PROBE_ARGUMENTS not in text


def _with_objects(message: Mapping[str, Any]) -> dict[str, Any]:
    msg = dict(message)
    msg["tool_calls"] = [_map_arguments(tc, _json_object) for tc in msg["tool_calls"]]
    return msg


def _json_object(args: str) -> dict[str, Any]:
    """The JSON object ``args`` holds; `ValueError` for anything else."""
    value = json.loads(args)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


class NamedCall(Protocol):
    """A tool call as a message carries it (`ToolCall`, the server's parsed calls)."""

    @property
    def id(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def arguments(self) -> str: ...


def assistant_message(content: str | None, calls: Sequence[NamedCall]) -> dict[str, Any]:
    """An OpenAI-style assistant message carrying ``calls``, as a client sends it back (no
    content: an empty one)."""
    return {"role": "assistant", "content": content or "", "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls]}


def text_around_results(render: Callable[[list[str]], str | None],
                        count: int) -> list[str] | None:
    """The text of a next prompt as ``count + 1`` pieces around its results, in call order:
    ``pieces[0] + result_0 + pieces[1] + ... + pieces[count]``.

    ``render(marks)``: the prompt's text with each result's content replaced by its mark
    (None: it cannot be rendered). It runs twice, with random marks of two lengths, each with
    whitespace at both ends; None unless every mark is found once, in order, and both runs
    give the same pieces (a template that reads a result's length, or trims it, fails)."""
    pieces: list[list[str]] = []
    for size in (8, 20):
        marks = [f" \n\t{secrets.token_hex(size)}\t\n " for _ in range(count)]
        text = render(marks)
        split = _split(text, marks) if text is not None else None
        if split is None:
            return None
        pieces.append(split)
    return pieces[0] if pieces[0] == pieces[1] else None


def _split(text: str, marks: Sequence[str]) -> list[str] | None:
    """``text`` cut around ``marks`` (each once in it, in order), else None."""
    pieces, pos = [], 0
    for mark in marks:
        k = text.find(mark, pos)
        if k < 0 or text.count(mark) != 1:
            return None
        pieces.append(text[pos:k])
        pos = k + len(mark)
    pieces.append(text[pos:])
    return pieces
