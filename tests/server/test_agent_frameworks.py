"""An agent framework pointed at the server: the OpenAI Agents SDK runs a tool loop.

Skipped unless ``openai-agents`` is installed (it is a dev extra, not a server dependency).
"""

from __future__ import annotations

import asyncio

import pytest
from server_helpers import LiveServer, weather_agent

agents = pytest.importorskip("agents")


def test_openai_agents_sdk_tool_loop(fresh_server: LiveServer) -> None:
    cities: list[str] = []
    # The SDK resets tool_choice to auto after the forced call: the second turn answers in text.
    agent = weather_agent(fresh_server, cities, agents.OpenAIChatCompletionsModel)
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?",
                                           max_turns=4))
    assert cities and set(cities) <= {"Paris", "London"}
    assert isinstance(result.final_output, str)
    assert fresh_server.metric("edmm_session_resumes_total") >= 1
    assert fresh_server.metric("edmm_prefix_hit_tokens_total") > 0
