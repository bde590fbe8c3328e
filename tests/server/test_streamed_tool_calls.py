"""Tool calls over HTTP as OpenAI sends them: incremental argument deltas, a call cut by
``max_tokens`` reported alike streamed and not streamed, arguments that are always JSON, and a
conversation that echoes back every reply it got."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from server_helpers import MODEL, QUESTION, TOOLS, WEATHER, LiveServer, serve, server_config

from edmm.server import ServerState

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
    so far (when its name was), closed into valid JSON, streamed as not."""
    n = max(2, int(cut * _completion_tokens(client)))
    whole = _create(client, False, n)
    final, _ = _streamed(client, n)
    assert _summary(final) == _summary(whole)
    finish, content, calls = _summary(whole)
    assert finish == "length" and content is None
    assert all(name == "get_weather" for name, _ in calls)
    complete = _summary(_create(client, False, 200))[2]
    if cut == 0.6:  # past the name: the call, its arguments cut short (and closed)
        assert len(calls) == 1 and calls[0][1] != complete[0][1]
    if cut == 0.95:  # in the closing markup: the whole arguments, still "length"
        assert calls == complete
    assert all(isinstance(json.loads(arguments), dict) for _, arguments in calls)


ANYTHING = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "number"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["text"]}}}


def _reply(client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool,
           **options: Any) -> tuple[dict[str, Any], str]:
    """The assistant message as the SDK hands it to an agent (streamed: its accumulation of
    the chunks), and the finish reason."""
    create: Any = client.chat.completions.create
    if not stream:
        choice = create(model=MODEL, messages=messages, **options).choices[0]
        return choice.message.model_dump(exclude_none=True), choice.finish_reason
    state = ChatCompletionStreamState()
    for chunk in create(model=MODEL, messages=messages, stream=True, **options):
        state.handle_chunk(chunk)
    choice = state.current_completion_snapshot.choices[0]
    message = choice.message.model_dump(exclude_none=True, exclude={"parsed"})
    for call in message.get("tool_calls", []):
        call.pop("parsed_arguments", None)
        call["function"].pop("parsed_arguments", None)
    return message, choice.finish_reason


@pytest.mark.slow  # a server, subprocess or seconds of waiting: the thorough tier
def test_a_conversation_that_echoes_every_reply_never_gets_a_4xx(
        client: openai.OpenAI) -> None:
    """An agent that sends back every assistant message it got, exactly as its SDK gave it,
    and answers every tool call in it (even one cut short), over turns forced and auto, cut
    by max_tokens and by stop sequences, streamed and not: every request is a 200 and every
    call's arguments are JSON."""
    rng = random.Random(44)
    messages: list[dict[str, Any]] = list(QUESTION)
    cut = 0
    for turn in range(36):
        options: dict[str, Any] = {"tools": [WEATHER, ANYTHING], "temperature": 1.0,
                                   "seed": turn}
        choice = rng.choice(["required", "named", "auto"])
        options["tool_choice"] = {"type": "function", "function": {"name": "note"}} \
            if choice == "named" else choice
        limit = rng.choice([None, "max_tokens", "stop"])
        if limit == "max_tokens":
            options["max_tokens"] = rng.randint(4, 40)
        else:
            options["max_tokens"] = 120
            if limit == "stop":
                options["stop"] = [rng.choice([", ", '": ', "a", "e", "}"])]
        try:
            message, finish = _reply(client, messages, rng.random() < 0.5, **options)
        except openai.APIStatusError as e:
            pytest.fail(f"turn {turn} ({choice}, {limit}): {e.status_code} {e.message}")
        calls = message.get("tool_calls", [])
        for call in calls:
            assert isinstance(json.loads(call["function"]["arguments"]), dict), call
        cut += finish == "length" and bool(calls)
        messages.append(message)
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": "done"}
                     for c in calls]
        if len(messages) > 12:  # stays well inside the context
            messages = [*QUESTION, message, *messages[len(messages) - len(calls):]] \
                if calls else list(QUESTION)
        elif not calls:
            messages.append({"role": "user", "content": "Go on."})
    assert cut > 0  # some calls were cut short, and echoed back


FREE_TEXT = {"type": "function", "function": {"name": "say", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
STRING_BOUND = 24


@pytest.fixture(scope="module")
def bounded(tiny_dir: Path) -> Iterator[LiveServer]:
    config = dataclasses.replace(server_config(tiny_dir), max_forced_string_chars=STRING_BOUND)
    yield from serve(ServerState(config))


def test_a_forced_calls_strings_are_bounded(bounded: LiveServer) -> None:
    """A forced call whose schema leaves a string unbounded, with no max_tokens: the string
    ends at the server's bound and the call closes (a random model would otherwise write it
    on to the end of the context)."""
    client = bounded.client()
    for seed in range(6):
        out = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[FREE_TEXT], tool_choice="required",
            parallel_tool_calls=False, temperature=1.0, seed=seed)  # type: ignore[arg-type]
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        text = json.loads(choice.message.tool_calls[0].function.arguments)["text"]
        assert len(text) <= STRING_BOUND
