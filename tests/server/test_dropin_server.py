"""What a vLLM user's tooling expects of the server: API-key 401s, the latency histograms and
vLLM's metric names, ``/v1/responses`` for the OpenAI Agents SDK's default model class, and a
streaming load generator's TTFT and inter-token figures."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_helpers import MODEL, QUESTION, TOOLS, LiveServer, serve, server_config, weather_agent

from edmm.server import ServerState

KEY = "sk-dropin-test"


@pytest.fixture(scope="module")
def keyed(tiny_dir: Path) -> Iterator[LiveServer]:
    """A server with an API key and vLLM's metric names."""
    config = server_config(tiny_dir)
    config.api_keys = (KEY,)
    config.vllm_metrics = True
    yield from serve(ServerState(config))


def _client(server: LiveServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60)


def test_api_key_401s_as_openai(keyed: LiveServer) -> None:
    url = f"{keyed.base_url}/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    none = httpx.post(url, json=body, timeout=30)
    assert none.status_code == 401
    error = none.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] is None
    assert "API key" in error["message"]
    wrong = httpx.post(url, json=body, timeout=30, headers={"Authorization": "Bearer sk-nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert "sk-nope" not in wrong.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, "sk-nope").models.list()
    assert _client(keyed).chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "hi"}]).choices
    # /health and /metrics stay open, as in vLLM
    assert httpx.get(f"{keyed.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{keyed.url}/metrics", timeout=10).status_code == 200


def _histogram_count(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name}_count{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_latency_histograms_and_vllm_names(keyed: LiveServer) -> None:
    client = _client(keyed)
    before = httpx.get(f"{keyed.url}/metrics", timeout=10).text
    for stream in (False, True):
        reply = client.chat.completions.create(model=MODEL, max_tokens=6, stream=stream,
                                               messages=[{"role": "user", "content": "hi"}])
        if stream:
            list(reply)  # type: ignore[arg-type]
    keyed.wait_idle()
    text = httpx.get(f"{keyed.url}/metrics", timeout=10).text
    for suffix in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                   "e2e_request_latency_seconds", "request_queue_time_seconds"):
        for name in (f"edmm_{suffix}", f"vllm:{suffix}"):
            assert f"{name}_bucket{{" in text, name
            grew = _histogram_count(text, name) - (
                _histogram_count(before, name) if f"{name}_count{{" in before else 0)
            assert grew >= (2 if suffix != "inter_token_latency_seconds" else 1), name
    assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="edmm-tiny"}' in text
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                  "vllm:generation_tokens_total", "vllm:request_success_total"):
        assert gauge in text, gauge


def test_vllm_names_are_optional(server: LiveServer) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "edmm_time_to_first_token_seconds_bucket" in text and "vllm:" not in text


# ---------------------------------------------------------------------------- /v1/responses

agents = pytest.importorskip("agents")


def test_responses_through_the_agents_sdk_default_model(fresh_server: LiveServer) -> None:
    """The Agents SDK's default model class (`OpenAIResponsesModel`) runs a tool loop."""
    cities: list[str] = []
    # The random tiny model rambles past any token limit once it may answer in text (and the SDK
    # takes an incomplete response for a failure): the run ends at the tool result.
    agent = weather_agent(fresh_server, cities, agents.OpenAIResponsesModel,
                          settings={"store": False}, tool_use_behavior="stop_on_first_tool")

    async def runs() -> tuple[Any, list[Any], Any]:
        result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        streamed = agents.Runner.run_streamed(agent, "Weather in London?", max_turns=4)
        events = [event async for event in streamed.stream_events()]
        return result.final_output, events, streamed.final_output

    final, events, streamed_final = asyncio.run(runs())
    assert final.startswith("Sunny in ") and streamed_final.startswith("Sunny in ")
    assert events
    assert len(cities) >= 2


def _responses(server: LiveServer, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/responses", timeout=60,
                      headers={"Authorization": "Bearer unused"},
                      json={"model": MODEL, **body})


def test_responses_objects_and_events(server: LiveServer) -> None:
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    reply = _responses(server, instructions=QUESTION[0]["content"],
                       input=QUESTION[1]["content"], tools=tools, tool_choice="required",
                       max_output_tokens=200, temperature=0).json()
    assert reply["object"] == "response" and reply["status"] == "completed"
    calls = [item for item in reply["output"] if item["type"] == "function_call"]
    assert calls and all(json.loads(c["arguments"]) is not None for c in calls)
    assert reply["usage"]["input_tokens"] > 0 and reply["usage"]["output_tokens"] > 0
    # the tool result goes back as input items; the answer is a message
    follow = _responses(server, input=[
        {"role": "user", "content": QUESTION[1]["content"]},
        *({"type": "function_call", "call_id": c["call_id"], "name": c["name"],
           "arguments": c["arguments"]} for c in calls),
        *({"type": "function_call_output", "call_id": c["call_id"], "output": "Sunny"}
          for c in calls)], tools=tools, max_output_tokens=8, temperature=0).json()
    assert follow["status"] in ("completed", "incomplete")
    stream = _responses(server, input="Say hello.", max_output_tokens=6, stream=True)
    kinds = [json.loads(line[6:])["type"] for line in stream.text.splitlines()
             if line.startswith("data: ")]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds
    for field, value in (("previous_response_id", "resp-1"),
                         ("tools", [{"type": "web_search"}])):
        bad = _responses(server, input="hi", **{field: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith(field)


# ---------------------------------------------------------------------------- load generator


async def _one_stream(client: openai.AsyncOpenAI, max_tokens: int) -> tuple[float, list[float]]:
    """TTFT and the inter-token gaps of one streamed request (as vLLM's bench client measures
    them: per content chunk)."""
    start = time.perf_counter()
    stamps: list[float] = []
    stream = await client.chat.completions.create(
        model=MODEL, max_tokens=max_tokens, stream=True, temperature=1.0,
        messages=[{"role": "user", "content": "Tell me a story."}],
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore
        extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in itertools.pairwise(stamps)]


def test_streaming_load_generator_gets_ttft_and_itl(server: LiveServer) -> None:
    """An openai-SDK load generator (vLLM's bench client's requests: streamed, with vLLM's
    ``continuous_usage_stats`` and ``ignore_eos``) completes every request."""
    async def run() -> list[tuple[float, list[float]]]:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        return await asyncio.gather(*(_one_stream(client, 16) for _ in range(8)))

    results = asyncio.run(run())
    assert len(results) == 8
    for ttft, gaps in results:
        assert ttft > 0 and len(gaps) >= 8 and all(g >= 0 for g in gaps)
