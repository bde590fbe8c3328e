"""Parsing of the model's own tool-call format: Hermes / Qwen ``<tool_call>`` JSON blocks.

A reply with tool calls reads::

    optional text\\n<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>\\n<tool_call>...

Arguments are returned as the exact JSON text the model wrote (not re-serialised), so a client
that echoes them back makes the chat template render the very tokens the model produced: the
next turn's prompt extends this one token for token, and its prefix is reused.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
_NAME_THEN_ARGS = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedToolCall:
    """One tool call: its function name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ParsedReply:
    """A reply split into its text content and its tool calls."""

    content: str | None
    tool_calls: list[ParsedToolCall]


def parse_tool_call(body: str) -> ParsedToolCall | None:
    """The call in one ``<tool_call>`` block's body, or None if it is not a valid call."""
    raw = _raw_arguments(body)
    if raw is not None:
        return raw
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _raw_arguments(body: str) -> ParsedToolCall | None:
    """Fast path keeping the model's exact text: ``{"name": "...", "arguments": {...}}``."""
    m = _NAME_THEN_ARGS.match(body)
    if m is None:
        return None
    try:
        name = json.loads(m.group(1))
        args, end = _DECODER.raw_decode(body, m.end())
    except json.JSONDecodeError:
        return None
    if not isinstance(args, dict) or body[end:].strip() != "}":
        return None
    return ParsedToolCall(name, body[m.end():end])


def parse_reply(text: str) -> ParsedReply:
    """Split a finished reply into content and tool calls.

    The content is the text before the first ``<tool_call>`` (without the one newline the chat
    template puts between them), or the whole text when there is no valid call. An invalid
    block makes the whole reply content, as in vLLM: nothing the model wrote is dropped.
    """
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return ParsedReply(text, [])
    calls: list[ParsedToolCall] = []
    end = start
    for m in _BLOCK.finditer(text, start):
        if text[end:m.start()].strip():
            return ParsedReply(text, [])  # text between calls: not a clean tool-call tail
        call = parse_tool_call(m.group(1))
        if call is None:
            return ParsedReply(text, [])
        calls.append(call)
        end = m.end()
    if not calls or text[end:].strip():
        return ParsedReply(text, [])
    content = text[:start].removesuffix("\n")
    return ParsedReply(content or None, calls)


class StreamingToolParser:
    """Incremental `parse_reply`: feed the cumulative text, get content and whole calls.

    Content is released as soon as it cannot be the start of a tool call (a trailing newline or
    a prefix of ``<tool_call>`` is held back); each call is released once its block closes.
    Text that turns out not to be a valid call is released as content at `finish`.
    """

    def __init__(self) -> None:
        self._emitted = 0  # characters of the text consumed (content sent, or calls parsed)
        self._in_calls = False
        self.calls: list[ParsedToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """``(new content, newly closed calls)`` for the cumulative ``text``."""
        if self._in_calls:
            return "", self._close_calls(text)
        start = text.find(TOOL_CALL_START, self._emitted)
        if start < 0:
            return self._release(text, _held_back(text, self._emitted)), []
        if start > self._emitted and text[start - 1] == "\n":
            start -= 1  # the template's newline before the first call is not content
        content = self._release(text, start)
        self._in_calls = True
        return content, self._close_calls(text)

    def finish(self, text: str) -> str:
        """Text still held back at the end of the reply (a held-back tail, an unclosed or
        invalid block), released as content; whitespace after the last call is dropped."""
        rest = text[self._emitted:]
        self._emitted = len(text)
        return "" if self.calls and not rest.strip() else rest

    def _release(self, text: str, upto: int) -> str:
        out = text[self._emitted:upto] if upto > self._emitted else ""
        self._emitted = max(self._emitted, upto)
        return out

    def _close_calls(self, text: str) -> list[ParsedToolCall]:
        out: list[ParsedToolCall] = []
        while True:
            m = _BLOCK.search(text, self._emitted)
            if m is None or text[self._emitted:m.start()].strip():
                return out
            call = parse_tool_call(m.group(1))
            if call is None:
                return out
            out.append(call)
            self.calls.append(call)
            self._emitted = m.end()


def _held_back(text: str, start: int) -> int:
    """Where releasable content ends: before a trailing newline or ``<tool_call>`` prefix."""
    end = len(text)
    for k in range(min(len(TOOL_CALL_START), end - start), 0, -1):
        if TOOL_CALL_START.startswith(text[end - k:]):
            end -= k
            break
    if end > start and text[end - 1] == "\n":
        end -= 1
    return end
