"""Hypothesis strategies of agent conversations in chat-template form (plain dicts).

A conversation: an optional system message, then turns of a user query, assistant replies with
optional reasoning (``reasoning_content`` or a ``<think>`` block in the content) and one or more
parallel tool calls, each answered by a tool message; user messages may carry a ``<memory>``
block (a result inserted mid-prompt). Tools are listed or not.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

_ALPHABET = st.sampled_from([*"abcdefghij XYZ.,:;!?'\"{}[]()-_/\\\n\t0123456789",
                             "é", "ü", "世界", "🙂", "  ", "\n\n", "'s", "'ll", "—"])
TEXT = st.lists(_ALPHABET, min_size=0, max_size=24).map("".join)
NAMES = st.sampled_from(["lookup", "get_weather", "read_file", "run"])

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"Call {name}.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                   "required": ["key"]}}} for name in ("lookup", "get_weather", "read_file", "run")]


@st.composite
def arguments(draw: st.DrawFn) -> str:
    """Tool-call arguments as JSON text, compact or spaced (clients re-serialise)."""
    obj = draw(st.dictionaries(st.sampled_from(["key", "city", "n", "path"]),
                               st.one_of(TEXT, st.integers(-5, 500), st.booleans()),
                               max_size=3))
    compact = draw(st.booleans())
    return json.dumps(obj, separators=(",", ":")) if compact else json.dumps(obj)


@st.composite
def assistant_turn(draw: st.DrawFn, call_ids: list[str]) -> list[dict[str, Any]]:
    """An assistant reply (maybe with reasoning and calls) and the tool messages answering it."""
    content = draw(TEXT)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    reasoning = draw(st.sampled_from(["none", "field", "inline"]))
    if reasoning == "field":
        msg["reasoning_content"] = draw(TEXT)
    elif reasoning == "inline":
        msg["content"] = f"<think>\n{draw(TEXT)}\n</think>\n\n{content}"
    n_calls = draw(st.integers(0, 3))
    calls = []
    for _ in range(n_calls):
        call_id = f"call_{len(call_ids)}"
        call_ids.append(call_id)
        calls.append({"id": call_id, "type": "function",
                      "function": {"name": draw(NAMES), "arguments": draw(arguments())}})
    if calls:
        msg["tool_calls"] = calls
    results = [{"role": "tool", "tool_call_id": c["id"], "content": draw(TEXT)} for c in calls]
    return [msg, *results]


@st.composite
def user_message(draw: st.DrawFn) -> dict[str, Any]:
    """A user query, sometimes with a ``<memory>`` block appended."""
    text = draw(TEXT)
    if draw(st.booleans()):
        text = f"{text}\n\n<memory>\n{draw(TEXT)}\n</memory>"
    return {"role": "user", "content": text}


@st.composite
def conversations(draw: st.DrawFn, max_turns: int = 4) -> list[dict[str, Any]]:
    """A whole conversation (see the module docstring); it may end on any message."""
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(TEXT)})
    call_ids: list[str] = []
    for _ in range(draw(st.integers(1, max_turns))):
        msgs.append(draw(user_message()))
        for _ in range(draw(st.integers(0, 2))):
            msgs += draw(assistant_turn(call_ids))
    return msgs


def tool_lists() -> st.SearchStrategy[list[dict[str, Any]] | None]:
    """No tools, or some of `TOOLS`."""
    return st.one_of(st.none(), st.lists(st.sampled_from(TOOLS), min_size=1, max_size=3,
                                         unique_by=_tool_name))


def _tool_name(tool: dict[str, Any]) -> str:
    return str(tool["function"]["name"])
