"""Checks of a request's content before any of it reaches the tokenizer or a grammar.

Each check raises a `BadRequestError` (400) naming the offending parameter:

- `check_text`: no string (value or key, anywhere in the request) holds a lone UTF-16
  surrogate (``"\\ud800"`` is a valid JSON escape, but no UTF-8 text: the tokenizer would fail);
- `check_conversation`: every tool message answers a call of an earlier assistant message
  (a call's ``arguments`` may be any string, as OpenAI accepts: a client echoes back what it
  was sent, a call cut short included);
- `check_tool_names`: at most `MAX_TOOLS` tools, with unique names.

Tools' parameter schemas must compile too, whatever the tool choice (a schema that cannot
constrain a call is a client bug): `edmm.server.guided` checks them with the other grammars.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edmm.server.errors import BadRequestError
from edmm.server.protocol import AssistantMessage, ChatMessage, ChatTool, ToolMessage

MAX_TOOLS = 128  # OpenAI's documented limit of functions per request


_NO_TEXT = frozenset({int, float, bool, type(None)})  # items that hold no string


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string or key in ``value`` that holds a lone surrogate
    (``""`` for ``value`` itself), or None."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if _has_surrogate(item):
                return where
        elif isinstance(item, dict):
            for key, sub in item.items():
                here = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and _has_surrogate(key):
                    return where or here
                stack.append((sub, here))
        elif isinstance(item, list | tuple):
            if set(map(type, item)) <= _NO_TEXT:  # token ids: skipped at C speed
                continue
            stack.extend((sub, f"{where}.{i}" if where else str(i))
                         for i, sub in reversed(list(enumerate(item)))
                         if type(sub) not in _NO_TEXT)
    return None


def check_text(value: Any, path: str = "") -> None:
    """400 if a string (or key) in ``value`` holds a lone UTF-16 surrogate."""
    where = lone_surrogate(value, path)
    if where is not None:
        raise BadRequestError(f"{where or 'the request'} holds a lone UTF-16 surrogate, which "
                              "is not text (send the character itself, or a valid pair)",
                              param=where or None, code="invalid_text")


def check_conversation(messages: Sequence[ChatMessage]) -> None:
    """400 for a tool message answering no earlier call."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if isinstance(m, AssistantMessage):
            calls.update(call.id for call in m.tool_calls or [])
        elif isinstance(m, ToolMessage) and m.tool_call_id not in calls:
            raise BadRequestError(f"messages.{i}: the tool message answers "
                                  f"{m.tool_call_id!r}, which no earlier assistant message "
                                  "called", param=f"messages.{i}")


def check_tool_names(tools: Sequence[ChatTool] | None) -> None:
    """400 for too many tools or duplicate names."""
    if not tools:
        return
    if len(tools) > MAX_TOOLS:
        raise BadRequestError(f"at most {MAX_TOOLS} tools are supported, got {len(tools)}",
                              param="tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise BadRequestError(f"tools.{i}: the function name {name!r} is used twice",
                                  param=f"tools.{i}")
        seen.add(name)


def _has_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
