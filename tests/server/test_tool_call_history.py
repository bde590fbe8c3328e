"""A forced tool call's tokens stay reusable at the resume under a template that prints
arguments with ``| tojson`` only (Qwen2.5's): the server hands it the arguments as objects,
so the history renders the call as the model wrote it, with or without the agent layer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import MODEL, QUESTION, WEATHER, LiveServer, serve, server_config

from edmm.server.state import ServerState


@pytest.fixture(scope="module", params=[True, False], ids=["agent", "plain"])
def server(request: pytest.FixtureRequest, tiny_dir: Path,
           tojson_template: str) -> Iterator[LiveServer]:
    config = server_config(tiny_dir, execution_aware=request.param)
    config.chat_template = tojson_template
    yield from serve(ServerState(config))


def test_the_resume_reuses_the_calls_kv(server: LiveServer) -> None:
    client = server.client()
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=100)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and first.usage is not None
    messages = [*QUESTION, message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21 C"}]
    resumed = client.chat.completions.create(model=MODEL, messages=messages,
                                             tools=[WEATHER], temperature=0, max_tokens=4)
    assert resumed.usage is not None and resumed.usage.prompt_tokens_details is not None
    # The whole context before it, the call included: all but its last token (which has no
    # KV) with the agent layer, whole hashed blocks of it without.
    context = first.usage.prompt_tokens + first.usage.completion_tokens
    lost = 1 if server.state.execution_aware else server.state.engine.config.prefix_block_size
    assert resumed.usage.prompt_tokens_details.cached_tokens >= context - lost
    # The call's arguments start 12 tokens into it, where an escaped history diverges.
    assert resumed.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens + 12
