"""The default model (the shipped tool model) behind ``edmm serve``, driven by real clients with
``tool_choice="auto"``: the openai SDK, the OpenAI Agents SDK and LangChain."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from server_helpers import MODEL, LiveServer, serve

from edmm.server import ServerConfig, ServerState

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def default_server() -> Iterator[LiveServer]:
    """``edmm serve`` with no --model: the embedded tool model."""
    config = ServerConfig(served_model_name=MODEL, engine=dict(max_model_len=2048))
    yield from serve(ServerState(config))


def test_openai_sdk_auto_tool_call_then_answer(default_server: LiveServer) -> None:
    """The README's snippet: a weather question gets a parseable call, the result an answer."""
    client = default_server.client()
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER,
                                           temperature=0)
    msg = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", msg
    assert msg.tool_calls and msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    messages.append(msg.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "sunny, 24 C"}
                 for c in msg.tool_calls]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER,
                                            temperature=0)
    assert answer.choices[0].finish_reason == "stop"
    assert not answer.choices[0].message.tool_calls
    assert (answer.choices[0].message.content or "").strip()
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    assert (answer.usage.prompt_tokens_details.cached_tokens or 0) > 0


def test_agents_sdk_calls_the_tool(default_server: LiveServer) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        cities.append(city)
        return f"Sunny in {city}, 24 C"

    client = AsyncOpenAI(base_url=default_server.base_url, api_key="unused", max_retries=0)
    agent = agents.Agent(name="assistant", instructions="You are a helpful assistant.",
                         tools=[get_weather],
                         model=agents.OpenAIChatCompletionsModel(model=MODEL,
                                                                 openai_client=client),
                         model_settings=agents.ModelSettings(temperature=0))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?",
                                           max_turns=4))
    assert cities == ["Paris"]
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_langchain_bind_tools_loop(default_server: LiveServer) -> None:
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_time(city: str) -> str:
        """Local time of a city."""
        return "14:30"

    llm = lc.ChatOpenAI(model=MODEL, base_url=default_server.base_url, api_key="unused",
                        temperature=0, max_retries=0)
    bound = llm.bind_tools([get_time])
    messages: list[Any] = [HumanMessage("What time is it in Tokyo?")]
    first = bound.invoke(messages)
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [("get_time", {"city": "Tokyo"})]
    messages += [first, ToolMessage(get_time.invoke(first.tool_calls[0]["args"]),
                                    tool_call_id=first.tool_calls[0]["id"])]
    final = bound.invoke(messages)
    assert not final.tool_calls and isinstance(final.content, str) and final.content.strip()


def test_langchain_structured_output_json_schema(default_server: LiveServer) -> None:
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    class Place(BaseModel):
        city: str
        country: str

    llm = lc.ChatOpenAI(model=MODEL, base_url=default_server.base_url, api_key="unused",
                        temperature=0, max_retries=0, max_tokens=64)
    out = llm.with_structured_output(Place, method="json_schema").invoke(
        "Lisbon is a city in Portugal. Return the city and country as JSON.")
    assert isinstance(out, Place)
    assert (out.city, out.country) == ("Lisbon", "Portugal")
