"""The server driven by the real `openai` SDK: agent loops, streaming, tools, completions."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
from openai.lib.streaming.chat import ChatCompletionStreamState
from server_helpers import MODEL, QUESTION, TOOLS, LiveServer


def _check_call(call: Any, names: set[str]) -> dict[str, Any]:
    """A tool call of the SDK: a known function and JSON arguments valid for its schema."""
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    schema = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    params = schema["function"]["parameters"]
    assert set(args) == set(params["required"])
    for key, value in args.items():
        spec = params["properties"][key]
        assert value in spec["enum"] if "enum" in spec else isinstance(value, bool)
    return args


def _tool_messages(message: Any) -> list[Any]:
    return [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temp": 21, "sky": "sun"})}
        for c in message.tool_calls]


def test_models_and_health(server: LiveServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_agent_loop_tool_call_then_answer(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           temperature=0, max_tokens=200)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], {"get_weather", "calculator"})

    messages = [*QUESTION, *_tool_messages(choice.message)]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                            temperature=0, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1  # the whole first prompt was reused


def test_streamed_agent_loop(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, stream=True, tool_choice="required",
        temperature=0, max_tokens=200, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    state = ChatCompletionStreamState()  # the SDK's accumulation of the argument deltas
    for chunk in chunks:
        state.handle_chunk(chunk)
    calls = state.get_final_completion().choices[0].message.tool_calls or []
    firsts = [tc.index for d in deltas for tc in d.tool_calls or [] if tc.id is not None]
    assert calls and firsts == list(range(len(calls)))
    for tc in calls:
        _check_call(tc, {"get_weather", "calculator"})
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None and usage.completion_tokens > 0

    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": tc.id, "type": "function",
         "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
        for tc in calls]}
    results = [{"role": "tool", "tool_call_id": tc.id, "content": "21 C"} for tc in calls]
    resume = client.chat.completions.create(
        model=MODEL, messages=[*QUESTION, message, *results], tools=TOOLS, stream=True,
        temperature=0, max_tokens=6, stream_options={"include_usage": True})
    resumed = list(resume)
    final = resumed[-1].usage
    assert final is not None and 1 <= final.completion_tokens <= 6
    assert final.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1


def test_parallel_tool_calls(client: openai.OpenAI) -> None:
    found = 0
    for seed in range(6):
        out = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=True, temperature=1.0, seed=seed, max_tokens=400)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and calls
        assert len({c.id for c in calls}) == len(calls)
        for call in calls:
            _check_call(call, {"get_weather", "calculator"})
        found = max(found, len(calls))
    assert found >= 2  # some seed made the model call more than once


def test_forced_named_function(client: openai.OpenAI) -> None:
    for seed in range(3):
        out = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "calculator"}},
            max_tokens=200)
        calls = out.choices[0].message.tool_calls
        assert len(calls) == 1
        _check_call(calls[0], {"calculator"})


def test_tool_choice_none_returns_text(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                         tool_choice="none", temperature=0, max_tokens=5)
    assert out.choices[0].message.tool_calls in (None, [])
    assert out.choices[0].finish_reason in ("stop", "length")


def test_json_schema_response_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "city": {"enum": ["Paris", "Rome"]}},
              "required": ["ok", "city"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0.8, seed=1, max_tokens=100,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema}})
    data = json.loads(out.choices[0].message.content or "")
    assert isinstance(data["ok"], bool) and data["city"] in ("Paris", "Rome")
    assert out.choices[0].finish_reason == "stop"


def test_sampling_options(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=QUESTION, temperature=0.9, top_p=0.8,
                                  seed=7, max_completion_tokens=12)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content  # same seed
    assert a.usage.completion_tokens <= 12
    text = a.choices[0].message.content or ""
    if len(text) > 3:  # the text up to a stop string, and the stop string cut
        stop = text[2:4]
        c = client.chat.completions.create(**kwargs, stop=[stop])
        content = c.choices[0].message.content or ""
        assert stop not in content and c.choices[0].finish_reason == "stop"
        assert text.startswith(content)


def test_completions_text_and_token_ids(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=5, temperature=0)
    assert text.object == "text_completion" and text.usage.completion_tokens <= 5
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 4
    both = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == ids.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4,
                                         temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces) == ids.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"
