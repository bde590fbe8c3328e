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
its complete calls, plus the open one when its name is known, are its tool calls, its content
is the text before the first block, the markup is never content, and the response keeps the
engine's finish reason (``length``, or ``stop`` for a stop sequence). The open call's
arguments are what was written of them up to the last point where JSON can be closed by
appending (inside a string, after a value, ``{`` or ``[``), closed: every call a response
carries has arguments that are valid JSON, cut or not. Streamed, argument text goes out only
up to such a point (a key or a partial number waits for its value), and the closing text is
the call's last fragment. Streamed and not streamed give the same result, because the whole
parse of a cut reply is the streaming parser's. A closed but invalid block makes the whole
reply content (`parse_reply`); streamed, the fragments already sent for it stay sent, closed
the same way (the rest is content), the one case where the two differ.
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
    rest, _ = parser.finish(text)
    if not parser.cut:
        return None
    return ParsedReply((content + rest) or None, parser.calls, cut=True)


# States of `_OpenCall`'s scan of the arguments' JSON.
_VALUE, _FIRST_VALUE, _KEY, _FIRST_KEY, _IN_KEY, _COLON, _IN_STRING, _NUMBER, _LITERAL, \
    _AFTER, _DONE = range(11)
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_WHITESPACE = frozenset(" \t\n\r")
_NUMBER_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


@dataclass
class _OpenCall:
    """The block being streamed: where its body starts; once its head (``{"name": ...,
    "arguments": ``) is read, the call's id and name and how far its arguments are scanned.

    The arguments are scanned as JSON, character by character. ``safe`` is the end of the
    longest prefix that `closer` turns into valid JSON by appending only (closing an open
    string and the open arrays and objects): after ``{``, ``[``, a complete value, or inside
    a string but not inside an escape. Text after it (a key, a ``,``, a partial number or
    literal) is not released until the JSON reaches the next such point, so what was sent
    of a call cut anywhere, plus its closer, is always valid JSON."""

    body: int
    index: int
    call: ParsedToolCall | None = None
    args_start: int = 0
    scanned: int = 0  # arguments scanned up to here
    safe: int = 0  # arguments releasable up to here (see the class docstring)
    sent: int = 0  # arguments sent up to here (streaming)
    stack: list[str] = field(default_factory=list)  # the open arrays and objects
    state: int = _VALUE
    escape: int = 0  # in a string: 1 after a backslash, 2..5 inside a \\uXXXX escape
    literal: str = ""  # the rest of a literal being written
    number: str = ""  # the number being written
    safe_in_string: bool = False
    error: bool = False  # the arguments are not JSON
    args_end: int | None = None  # the arguments' object closed here

    def scan(self, text: str) -> None:
        """Advance over ``text`` to its end, the arguments' end or an error."""
        while self.scanned < len(text) and self.args_end is None and not self.error:
            ch = text[self.scanned]
            self.scanned += 1
            if self._char(ch):
                self.safe, self.safe_in_string = self.scanned, self.state == _IN_STRING

    def closer(self) -> str:
        """What turns the arguments up to ``safe`` into valid JSON."""
        if self.args_end is not None:
            return ""
        closing = "".join("}" if c == "{" else "]" for c in reversed(self.stack))
        return ('"' if self.safe_in_string else "") + closing

    def _char(self, ch: str) -> bool:
        """Take one character; whether the prefix up to it is safe."""
        state = self.state
        if state in (_IN_STRING, _IN_KEY):
            return self._string_char(ch)
        if state == _NUMBER:
            if ch in _NUMBER_CHARS:
                self.number += ch
                return _NUMBER_RE.fullmatch(self.number) is not None
            if _NUMBER_RE.fullmatch(self.number) is None:
                self.error = True
                return False
            self.state = _AFTER
        elif state == _LITERAL:
            if not self.literal.startswith(ch):
                self.error = True
                return False
            self.literal = self.literal[1:]
            if self.literal:
                return False
            self.state = _AFTER
            return True
        if ch in _WHITESPACE:
            return self.state in (_AFTER, _FIRST_KEY, _FIRST_VALUE) and bool(self.stack)
        return self._token(ch)

    def _string_char(self, ch: str) -> bool:
        if self.escape == 1:
            self.escape = 2 if ch == "u" else 0
            if ch not in '"\\/bfnrtu':
                self.error = True
        elif self.escape >= 2:
            if ch not in "0123456789abcdefABCDEF":
                self.error = True
            self.escape = 0 if self.escape == 5 else self.escape + 1
        elif ch == "\\":
            self.escape = 1
        elif ch == '"':
            if self.state == _IN_KEY:
                self.state = _COLON
                return False
            self.state = _AFTER
            return True
        elif ch < " ":
            self.error = True
        return self.state == _IN_STRING and self.escape == 0 and not self.error

    def _token(self, ch: str) -> bool:
        """A structural character or the start of a value, outside strings."""
        state, stack = self.state, self.stack
        if state in (_KEY, _FIRST_KEY):
            if ch == '"':
                self.state = _IN_KEY
                return False
            if ch == "}" and state == _FIRST_KEY:
                return self._close("{")
        elif state == _COLON:
            if ch == ":":
                self.state = _VALUE
                return False
        elif state == _AFTER:
            if ch == "," and stack:
                self.state = _KEY if stack[-1] == "{" else _VALUE
                return False
            if ch in "}]" and stack:
                return self._close("{" if ch == "}" else "[")
        elif state in (_VALUE, _FIRST_VALUE):
            if ch == "]" and state == _FIRST_VALUE:
                return self._close("[")
            return self._value(ch)
        self.error = True
        return False

    def _value(self, ch: str) -> bool:
        if not self.stack and ch != "{":
            self.error = True  # the arguments are one object
            return False
        if ch in "{[":
            self.stack.append(ch)
            self.state = _FIRST_KEY if ch == "{" else _FIRST_VALUE
            return True
        if ch == '"':
            self.state = _IN_STRING
            return True
        if ch in _LITERALS:
            self.state, self.literal = _LITERAL, _LITERALS[ch][1:]
            return False
        if ch == "-" or ch.isdigit():
            self.state, self.number = _NUMBER, ch
            return ch.isdigit()  # one digit is a number
        self.error = True
        return False

    def _close(self, opener: str) -> bool:
        if not self.stack or self.stack[-1] != opener:
            self.error = True
            return False
        self.stack.pop()
        self.state = _AFTER
        if not self.stack:
            self.state = _DONE
            self.args_end = self.scanned
        return True


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

    def finish(self, text: str) -> tuple[str, list[CallFragment]]:
        """The end of the reply: text still held back, released as content (a held-back
        tail, or a tail that is not clean tool calls; whitespace after the last call and the
        markup of a cut block are dropped), and the last fragments of a call whose
        arguments were being sent: the rest of them up to where they are valid JSON, closed
        (`_OpenCall.closer`). Sets `cut` (and adds the cut call, its arguments so closed, to
        `calls`)."""
        op, closing = self._open, []
        if op is not None and op.call is not None and (
                not self._broken or op.sent > op.args_start):
            arguments = text[op.args_start:op.safe] + op.closer()
            if text[op.sent:op.safe] + op.closer():
                closing.append(CallFragment(op.index, text[op.sent:op.safe] + op.closer()))
            op.sent = op.safe
            if not self._broken:
                self.calls.append(ParsedToolCall(op.call.name, arguments, op.call.id))
        if op is not None and not self._broken:
            self.cut = True
            self._emitted = len(text)
            return "", closing
        rest = text[self._emitted:]
        self._emitted = len(text)
        if self._in_calls and not self._broken and TOOL_CALL_START.startswith(rest.strip()):
            self.cut = bool(rest.strip())  # cut inside the next block's tag
            return "", closing
        return ("" if self.calls and not rest.strip() else rest), closing

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
                op.args_start = op.scanned = op.safe = op.sent = m.end()
                out.append(CallFragment(op.index, "", op.call.id, op.call.name))
            else:
                return self._close_whole(text, out)
        op.scan(text)
        if op.safe > op.sent:
            out.append(CallFragment(op.index, text[op.sent:op.safe]))
            op.sent = op.safe
        if op.error:
            self._broken = True  # not JSON: the rest is content (`finish` closes what was sent)
            return False
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
