"""What the proxy sees and sends: tool calls in responses, and the next prompt's head.

A tool-call turn fixes the next prompt up to the first tool result: the conversation, the
assistant message carrying the calls, and the start of the first ``tool`` message.
`speculation_prompt` renders exactly that with the model's chat template, the way vLLM renders
the client's resume request (`upstream_message`, `upstream_tools`), so that the KV the
speculation leaves in EDMM's connector matches the real resume token for token.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from edmm.agent.render import TemplateRenderer
from edmm.agent.types import ToolCall

_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


def _arguments(value: Any) -> dict[str, Any]:
    """Tool-call arguments as vLLM hands them to the template: a dict (``{}`` if malformed)."""
    if isinstance(value, dict):
        return value
    parsed: Any = None
    if isinstance(value, str) and value:
        with contextlib.suppress(json.JSONDecodeError):
            parsed = json.loads(value)
    return parsed if isinstance(parsed, dict) else {}


def upstream_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message as vLLM 0.32 passes it to the chat template: text parts joined by
    newlines, ``None`` content as ``""``, tool-call arguments parsed into dicts (clients send
    them back as ``json.dumps`` text; the template re-serialises them with ``tojson``),
    ``reasoning`` also as ``reasoning_content``, other keys dropped."""
    out = {k: message[k] for k in _MESSAGE_KEYS if k in message}
    content = message.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        out["content"] = "\n".join(str(p.get("text", "")) for p in content)
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {**tc, "function": {**tc["function"],
                                "arguments": _arguments(tc["function"].get("arguments"))}}
            for tc in out["tool_calls"]
        ]
    elif "tool_calls" in out:
        del out["tool_calls"]  # an empty list: the template's plain assistant path
    if message.get("reasoning") is not None:
        out["reasoning"] = out["reasoning_content"] = message["reasoning"]
    return out


def upstream_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool definitions as vLLM 0.32 passes them to the template (``model_dump()`` of its
    request model: ``type``, then ``function`` with ``name``, ``description``, ``parameters``,
    absent ones as None)."""
    if tools is None:
        return None
    return [{"type": "function", "function": {
        "name": t["function"]["name"], "description": t["function"].get("description"),
        "parameters": t["function"].get("parameters")}} for t in tools]


def tool_calls_of(message: Mapping[str, Any] | None) -> list[ToolCall]:
    """The tool calls of an assistant message (OpenAI ``tool_calls``), in order."""
    calls = (message or {}).get("tool_calls") or []
    return [ToolCall(str(tc.get("id", "")), str(tc["function"].get("name", "")),
                     str(tc["function"].get("arguments") or ""))
            for tc in calls if isinstance(tc, dict) and isinstance(tc.get("function"), dict)]


class StreamAccumulator:
    """Rebuilds choice 0's assistant message from the SSE bytes of a streamed chat completion
    (``content``, ``reasoning`` and ``tool_calls`` deltas); bytes may split lines anywhere."""

    def __init__(self) -> None:
        self._buf = b""
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}

    def feed(self, chunk: bytes) -> None:
        """Consume raw stream bytes."""
        *lines, self._buf = (self._buf + chunk).split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            try:
                event = json.loads(line[5:])
            except ValueError:
                continue
            choices = event.get("choices") if isinstance(event, dict) else None
            for choice in choices if isinstance(choices, list) else []:
                if isinstance(choice, dict) and choice.get("index", 0) == 0:
                    # a malformed delta never breaks the passthrough: it is just not seen
                    with contextlib.suppress(AttributeError, TypeError, ValueError):
                        self._delta(choice.get("delta") or {})

    def _delta(self, delta: Mapping[str, Any]) -> None:
        if isinstance(delta.get("content"), str):
            self._content.append(delta["content"])
        reasoning = delta.get("reasoning", delta.get("reasoning_content"))
        if isinstance(reasoning, str):
            self._reasoning.append(reasoning)
        for tc in delta.get("tool_calls") or []:
            call = self._calls.setdefault(int(tc.get("index", 0)), {
                "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] = tc.get("id") or call["id"]
            fn = tc.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""

    def message(self) -> dict[str, Any]:
        """The assistant message as a client would send it back."""
        msg: dict[str, Any] = {"role": "assistant",
                               "content": "".join(self._content) if self._content else None}
        if self._reasoning:
            msg["reasoning"] = "".join(self._reasoning)
        if self._calls:
            msg["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        return msg


def speculation_prompt(tokenizer: Any, request: Mapping[str, Any],
                       message: Mapping[str, Any]) -> list[int]:
    """Token ids of the next prompt up to the first tool result's slot: ``request``'s messages
    and tools, then ``message`` (the assistant's tool-call message), then the head of the
    ``tool`` message, rendered with ``tokenizer``'s chat template.

    The last token is left out: text tokenized up to the slot may end in a token that the
    result's first characters merge with. Raises ``ValueError`` if there is no tool call."""
    calls = tool_calls_of(message)
    if not calls:
        raise ValueError("the message has no tool call")
    messages = [*request["messages"], message]
    tools = upstream_tools(request.get("tools"))
    renderer = TemplateRenderer(tokenizer, tuple(upstream_message(m) for m in messages),
                                tuple(calls), None if tools is None else tuple(tools))
    return renderer.render({})[:-1]
