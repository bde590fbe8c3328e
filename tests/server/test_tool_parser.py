"""Hermes / Qwen ``<tool_call>`` parsing, whole and streamed."""

from __future__ import annotations

import json

import pytest

from edmm.server.tool_parser import StreamingToolParser, parse_reply, parse_tool_call

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2]}}\n' \
       '</tool_call>'
OTHER = '<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>'


def test_plain_text_is_content() -> None:
    reply = parse_reply("Hello there.\n")
    assert reply.content == "Hello there.\n" and reply.tool_calls == []


def test_calls_keep_the_models_exact_argument_text() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"b":1,  "a": "x"}}\n' \
           '</tool_call>'
    reply = parse_reply(text)
    assert reply.content == "Let me check."  # the template's newline before the call dropped
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("f", '{"b":1,  "a": "x"}')]


def test_parallel_calls_get_unique_ids() -> None:
    reply = parse_reply(CALL + "\n" + OTHER + "\n")
    assert reply.content is None
    assert [c.name for c in reply.tool_calls] == ["get_weather", "calc"]
    assert json.loads(reply.tool_calls[0].arguments) == {"city": "Paris", "n": [1, 2]}
    assert len({c.id for c in reply.tool_calls}) == 2


def test_other_key_order_and_parameters_alias() -> None:
    call = parse_tool_call(' {"arguments": {"x": 1}, "name": "f"} ')
    assert call is not None and (call.name, json.loads(call.arguments)) == ("f", {"x": 1})
    alias = parse_tool_call('{"name": "g", "parameters": {"y": 2}}')
    assert alias is not None and json.loads(alias.arguments) == {"y": 2}


@pytest.mark.parametrize("text", [
    pytest.param('<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>', id="bad-json"),
    pytest.param('<tool_call>\n{"arguments": {}}\n</tool_call>', id="no-name"),
    pytest.param('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', id="args-list"),
    pytest.param(CALL + " and then some text", id="text-after"),
    pytest.param(CALL + "\n<tool_call>\n{\"name\": \"f\"", id="unclosed"),
    pytest.param('<tool_call>{"name": "f", "arguments": {}}', id="never-closed"),
])
def test_invalid_calls_leave_everything_as_content(text: str) -> None:
    reply = parse_reply(text)
    assert reply.content == text and reply.tool_calls == []


def _stream(text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    parser = StreamingToolParser()
    content, calls = "", []
    for end in range(step, len(text) + step, step):
        new, closed = parser.feed(text[:end])
        content += new
        calls += [(c.name, c.arguments) for c in closed]
    return content + parser.finish(text), calls


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
@pytest.mark.parametrize("text", [
    "Just text, no tools.\n\nTwo lines.",
    "Text ending in a newline\n",
    "Thinking <tool_ about it",
    "Checking.\n" + CALL,
    CALL + "\n" + OTHER,
    CALL + "\n" + OTHER + "\n",
    "a\n<tool_call>\n{broken json}\n</tool_call>",
])
def test_streaming_matches_whole_parse(text: str, step: int) -> None:
    whole = parse_reply(text)
    content, calls = _stream(text, step)
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]
    assert (content or None) == whole.content


def test_streaming_never_sends_a_partial_tag_as_content() -> None:
    parser = StreamingToolParser()
    sent = ""
    text = "Sure.\n" + CALL
    for end in range(1, len(text) + 1):
        new, _ = parser.feed(text[:end])
        sent += new
        assert "<" not in sent and "\n" not in sent
    assert sent == "Sure." and len(parser.calls) == 1
