"""Parsing of the model's own tool-call format: Hermes / Qwen ``<tool_call>`` JSON blocks.

A reply with tool calls reads::

    optional text\\n<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>\\n<tool_call>...

Arguments are returned as the exact JSON text the model wrote (not re-serialised), so a client
that echoes them back makes the chat template render the very tokens the model produced: the
next turn's prompt extends this one token for token, and its prefix is reused.

Streamed, a call goes out as OpenAI sends it: a first fragment with its index, id and name
(arguments ``""``), then fragments of the argument text as the model writes it; their
concatenation is the non-streamed call's arguments.

A reply that ends inside a ``<tool_call>`` block (cut by ``max_tokens``, or stopped) is *cut*:
its complete calls, plus the open one when its name is known (arguments: what was written of
them), are its tool calls, its content is the text before the first block, the markup is
never content, and the response keeps the engine's finish reason (``length``). Streamed and
not streamed give the same result, because the whole parse of a cut reply is the streaming
parser's. A closed but invalid block makes the whole reply content (`parse_reply`); streamed,
the fragments already sent for it stay sent (the rest is content), the one case where the two
differ.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
_NAME_THEN_ARGS = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_CALL_TAIL = re.compile(r"\s*\}\s*" + re.escape(TOOL_CALL_END))
_DECODER = json.JSONDecoder()


def tool_marker_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The token ids of `TOOL_CALL_START` and `TOOL_CALL_END` when each is one token of
    ``tokenizer`` that its decoding keeps (Qwen's, Hermes'); else None."""
    if tokenizer is None:
        return None
    ids = []
    for marker in (TOOL_CALL_START, TOOL_CALL_END):
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        if len(encoded) != 1 or tokenizer.decode(encoded, skip_special_tokens=True) != marker:
            return None
        ids.append(int(encoded[0]))
    return ids[0], ids[1]


@dataclass(frozen=True)
class ParsedToolCall:
    """One tool call: its function name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ParsedReply:
    """A reply split into its text content and its tool calls (``cut``: it ended inside a
    tool-call block; see the module docstring)."""

    content: str | None
    tool_calls: list[ParsedToolCall]
    cut: bool = False


@dataclass(frozen=True)
class CallFragment:
    """A streamed piece of tool call ``index``: the first carries its ``id`` and ``name``
    (``arguments`` empty), the next ones consecutive pieces of the argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


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
    block makes the whole reply content, as in vLLM: nothing the model wrote is dropped. A
    reply that ends inside a block is cut (see the module docstring).
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
    if text[end:].strip():
        return _cut_reply(text) or ParsedReply(text, [])
    content = text[:start].removesuffix("\n")
    return ParsedReply(content or None, calls)


def _cut_reply(text: str) -> ParsedReply | None:
    """The reply as streamed when it ends inside a block; None if it does not."""
    parser = StreamingToolParser()
    content, _ = parser.feed(text)
    rest = parser.finish(text)
    if not parser.cut:
        return None
    return ParsedReply((content + rest) or None, parser.calls, cut=True)


@dataclass
class _OpenCall:
    """The block being streamed: where its body starts; once its head (``{"name": ...,
    "arguments": ``) is read, the call's id and name and how far its arguments are scanned."""

    body: int
    index: int
    call: ParsedToolCall | None = None
    args_start: int = 0
    scanned: int = 0  # arguments sent up to here
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    args_end: int | None = None  # the arguments' object closed here

    def scan(self, text: str) -> str:
        """Advance over ``text`` to its end or the arguments' end; the new argument text."""
        start = i = self.scanned
        while i < len(text) and self.args_end is None:
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.args_end = i + 1
            i += 1
        self.scanned = i
        return text[start:i]


class StreamingToolParser:
    """Incremental `parse_reply`: feed the cumulative text, get content and call fragments.

    Content is released as soon as it cannot be the start of a tool call (a trailing newline or
    a prefix of ``<tool_call>`` is held back). A call's first fragment goes out once its name
    and the start of its arguments are read, then its argument text as it comes; `calls` holds
    the calls whose block closed (and, once `finish` found the reply cut, the open one).
    Text that is not a clean tool-call tail is released as content at `finish`.
    """

    def __init__(self) -> None:
        self._emitted = 0  # characters of the text consumed (content sent, or calls parsed)
        self._in_calls = False
        self._broken = False  # the tail is not clean tool calls: the rest is content
        self._open: _OpenCall | None = None
        self.calls: list[ParsedToolCall] = []
        self.cut = False  # set by `finish`: the reply ended inside a block

    def feed(self, text: str) -> tuple[str, list[CallFragment]]:
        """``(new content, new call fragments)`` for the cumulative ``text``."""
        if self._in_calls:
            return "", self._advance(text)
        start = text.find(TOOL_CALL_START, self._emitted)
        if start < 0:
            return self._release(text, _held_back(text, self._emitted)), []
        if start > self._emitted and text[start - 1] == "\n":
            start -= 1  # the template's newline before the first call is not content
        content = self._release(text, start)
        self._in_calls = True
        return content, self._advance(text)

    def finish(self, text: str) -> str:
        """Text still held back at the end of the reply, released as content: a held-back
        tail, or a tail that is not clean tool calls; whitespace after the last call and the
        markup of a cut block are dropped. Sets `cut` (and adds the cut call to `calls`)."""
        if self._open is not None and not self._broken:
            self.cut = True
            if self._open.call is not None:
                args = text[self._open.args_start:self._open.scanned]
                self.calls.append(ParsedToolCall(self._open.call.name, args,
                                                 self._open.call.id))
            self._emitted = len(text)
            return ""
        rest = text[self._emitted:]
        self._emitted = len(text)
        if self._in_calls and not self._broken and TOOL_CALL_START.startswith(rest.strip()):
            self.cut = bool(rest.strip())  # cut inside the next block's tag
            return ""
        return "" if self.calls and not rest.strip() else rest

    def _release(self, text: str, upto: int) -> str:
        out = text[self._emitted:upto] if upto > self._emitted else ""
        self._emitted = max(self._emitted, upto)
        return out

    def _advance(self, text: str) -> list[CallFragment]:
        out: list[CallFragment] = []
        while not self._broken:
            if self._open is None and not self._open_block(text):
                return out
            assert self._open is not None
            if not self._step_open(text, out):
                return out
        return out

    def _open_block(self, text: str) -> bool:
        """Open the next block if it has started; False while waiting (or broken)."""
        rest = text[self._emitted:].lstrip()
        if TOOL_CALL_START.startswith(rest):
            return False  # nothing yet, or part of the tag
        if not rest.startswith(TOOL_CALL_START):
            self._broken = True
            return False
        body = len(text) - len(rest) + len(TOOL_CALL_START)
        self._open = _OpenCall(body=body, index=len(self.calls))
        return True

    def _step_open(self, text: str, out: list[CallFragment]) -> bool:
        """Advance the open block; True once it closed (look for the next one)."""
        op = self._open
        assert op is not None
        if op.call is None:
            m = _NAME_THEN_ARGS.match(text, op.body)
            if m is not None and m.end() < len(text) and text[m.end()] == "{":
                op.call = ParsedToolCall(json.loads(m.group(1)), "")
                op.args_start = op.scanned = m.end()
                out.append(CallFragment(op.index, "", op.call.id, op.call.name))
            else:
                return self._close_whole(text, out)
        fragment = op.scan(text)
        if fragment:
            out.append(CallFragment(op.index, fragment))
        if op.args_end is None:
            return False
        return self._close_incremental(text)

    def _close_whole(self, text: str, out: list[CallFragment]) -> bool:
        """A block whose head is not (yet) ``{"name": ..., "arguments": {``: once closed, one
        fragment with the whole call (or broken if it is not a valid call)."""
        op = self._open
        assert op is not None
        end = text.find(TOOL_CALL_END, op.body)
        if end < 0:
            return False
        call = parse_tool_call(text[op.body:end])
        if call is None:
            self._broken = True
            return False
        out.append(CallFragment(op.index, "", call.id, call.name))
        out.append(CallFragment(op.index, call.arguments))
        self._closed(call, end + len(TOOL_CALL_END))
        return True

    def _close_incremental(self, text: str) -> bool:
        """After the arguments' object: ``}`` and ``</tool_call>`` close the call."""
        op = self._open
        assert op is not None and op.call is not None and op.args_end is not None
        m = _CALL_TAIL.match(text, op.args_end)
        if m is None:
            tail = text[op.args_end:].lstrip()
            partial = tail[1:].lstrip() if tail.startswith("}") else None
            if not tail or (partial is not None and TOOL_CALL_END.startswith(partial)):
                return False  # still coming
            self._broken = True
            return False
        call = ParsedToolCall(op.call.name, text[op.args_start:op.args_end], op.call.id)
        if parse_tool_call(text[op.body:m.end() - len(TOOL_CALL_END)]) is None:
            self._broken = True  # not valid JSON after all
            return False
        self._closed(call, m.end())
        return True

    def _closed(self, call: ParsedToolCall, end: int) -> None:
        self.calls.append(call)
        self._emitted = end
        self._open = None


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
