"""An agent framework pointed at the server: the OpenAI Agents SDK runs a tool loop.

Skipped unless ``openai-agents`` is installed (it is a dev extra, not a server dependency).
"""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest
from server_helpers import MODEL, LiveServer

agents = pytest.importorskip("agents")


def test_openai_agents_sdk_tool_loop(fresh_server: LiveServer) -> None:
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "London"]) -> str:
        """Current weather of a city."""
        cities.append(city)
        return f"Sunny in {city}, 24 C"

    client = AsyncOpenAI(base_url=fresh_server.base_url, api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="assistant", instructions="You are a helpful assistant.", tools=[get_weather],
        model=agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        # The random tiny model only calls tools when forced; the SDK resets tool_choice to
        # auto after a call, so the second turn answers in text.
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                            temperature=0, max_tokens=48))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?",
                                           max_turns=4))
    assert cities and set(cities) <= {"Paris", "London"}
    assert isinstance(result.final_output, str)
    assert fresh_server.metric("edmm_session_resumes_total") >= 1
    assert fresh_server.metric("edmm_prefix_hit_tokens_total") > 0
