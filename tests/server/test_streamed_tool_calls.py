"""Tool calls over HTTP as OpenAI sends them: incremental argument deltas, and a call cut by
``max_tokens`` reported alike streamed and not streamed."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from server_helpers import MODEL, QUESTION, TOOLS

FORCED = {"type": "function", "function": {"name": "get_weather"}}


def _create(client: openai.OpenAI, stream: bool, max_tokens: int) -> Any:
    create: Any = client.chat.completions.create  # messages are plain dicts
    return create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=FORCED,
                  temperature=0, max_tokens=max_tokens, stream=stream)


def _streamed(client: openai.OpenAI, max_tokens: int) -> tuple[Any, list[Any]]:
    """The SDK's own accumulation of the stream (a completion snapshot) and the chunks."""
    state = ChatCompletionStreamState()
    chunks = list(_create(client, True, max_tokens))
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.current_completion_snapshot, chunks  # final: raises on "length"


def _summary(completion: Any) -> tuple[Any, ...]:
    choice = completion.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.finish_reason, choice.message.content or None, calls  # the role chunk: ""


def test_streamed_arguments_are_incremental_and_reassemble(client: openai.OpenAI) -> None:
    whole = _create(client, False, 200)
    final, chunks = _streamed(client, 200)
    assert _summary(final) == _summary(whole)
    finish, _, calls = _summary(whole)
    assert finish == "tool_calls" and calls and json.loads(calls[0][1])
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    first, rest = deltas[0], deltas[1:]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert first.function.arguments == ""
    assert len(rest) > 1  # the arguments came in pieces, as the model wrote them
    assert all(d.id is None and d.function.name is None and d.index == 0 for d in rest)
    assert "".join(d.function.arguments for d in rest) == calls[0][1]


def _completion_tokens(client: openai.OpenAI) -> int:
    return int(_create(client, False, 200).usage.completion_tokens)


@pytest.mark.parametrize("cut", [0.2, 0.6, 0.95])
def test_a_call_cut_by_max_tokens_is_the_same_streamed_and_not(client: openai.OpenAI,
                                                              cut: float) -> None:
    """finish_reason "length", no markup in the content, the call with the arguments written
    so far (when its name was), streamed as not."""
    n = max(2, int(cut * _completion_tokens(client)))
    whole = _create(client, False, n)
    final, _ = _streamed(client, n)
    assert _summary(final) == _summary(whole)
    finish, content, calls = _summary(whole)
    assert finish == "length" and content is None
    assert all(name == "get_weather" for name, _ in calls)
    if cut == 0.6:  # past the name: the call, its arguments cut short
        assert len(calls) == 1 and calls[0][1] and not _is_json(calls[0][1])
    if cut == 0.95:  # in the closing markup: the whole arguments, still "length"
        assert len(calls) == 1 and _is_json(calls[0][1])


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
