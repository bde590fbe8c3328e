"""What the proxy reads from responses and renders for vLLM (no HTTP)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from proxy_helpers import ARGS, QUESTION, TOOLS

from edmm.model.loader import load_tokenizer
from edmm.proxy.speculation import (
    StreamAccumulator,
    speculation_prompt,
    upstream_message,
    upstream_tools,
)


def _sse(*deltas: dict[str, object]) -> bytes:
    events = [{"choices": [{"index": 0, "delta": d}]} for d in deltas]
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def test_stream_accumulator_survives_any_split() -> None:
    data = _sse({"role": "assistant", "content": ""}, {"reasoning": "think"},
                {"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f"}}]},
                {"tool_calls": [{"index": 1, "id": "b", "function": {"name": "g",
                                                                     "arguments": "{}"}}]},
                {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]},
                {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]})
    for step in (1, 7, len(data)):
        acc = StreamAccumulator()
        for i in range(0, len(data), step):
            acc.feed(data[i:i + step])
        msg = acc.message()
        assert msg["content"] == "" and msg["reasoning"] == "think"
        assert [(c["id"], c["function"]["name"], c["function"]["arguments"])
                for c in msg["tool_calls"]] == [("a", "f", '{"x": 1}'), ("b", "g", "{}")]


def test_stream_accumulator_ignores_noise() -> None:
    acc = StreamAccumulator()
    acc.feed(b": keep-alive\n\ndata: {broken\n\ndata: [1]\n\ndata: {\"choices\": null}\n\n")
    acc.feed(_sse({"tool_calls": [7]}, {"tool_calls": [{"index": "x"}]})[:-14])  # no [DONE]
    acc.feed(_sse({"content": "hi"}))
    assert acc.message() == {"role": "assistant", "content": "hi"}


def test_upstream_views_follow_vllm() -> None:
    msg = upstream_message({"role": "assistant", "content": None, "refusal": None,
                            "reasoning": "r", "tool_calls": [
                                {"id": "1", "type": "function",
                                 "function": {"name": "f", "arguments": ARGS}},
                                {"id": "2", "type": "function",
                                 "function": {"name": "g", "arguments": "{oops"}}]})
    assert msg["content"] == "" and "refusal" not in msg
    assert msg["reasoning_content"] == "r"
    assert [tc["function"]["arguments"] for tc in msg["tool_calls"]] == [
        {"city": "Paris", "unit": "celsius"}, {}]
    parts = {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}
    assert upstream_message(parts)["content"] == "a\nb"
    assert "tool_calls" not in upstream_message({"role": "assistant", "content": "x",
                                                 "tool_calls": []})
    bare = {"function": {"parameters": {}, "name": "f", "strict": True}, "type": "function"}
    assert upstream_tools([bare]) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {}}}]
    assert upstream_tools(None) is None


def test_speculation_prompt_needs_a_tool_call(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    with pytest.raises(ValueError, match="no tool call"):
        speculation_prompt(tok, {"messages": QUESTION}, {"role": "assistant", "content": "x"})
    ids = speculation_prompt(tok, {"messages": QUESTION, "tools": TOOLS}, {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": ARGS}}]})
    text = tok.decode(ids)
    assert text.endswith("<tool_response>") and '{"city": "Paris", "unit": "celsius"}' in text


def test_cli_parses_proxy_options() -> None:
    from edmm.proxy.cli import build_parser

    args = build_parser().parse_args(["--upstream", "http://127.0.0.1:8000", "--no-speculate"])
    assert (args.host, args.port, args.session_header) == ("127.0.0.1", 8001, "X-Session-Id")
    assert args.no_speculate and args.tokenizer is None
    with pytest.raises(SystemExit):
        build_parser().parse_args([])  # --upstream is required
