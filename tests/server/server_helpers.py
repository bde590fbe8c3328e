"""Helpers of the server tests: a live server on a free loopback port, shared constants."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
from loopback import serve_app

from edmm.server import ServerConfig, ServerState, build_app
from edmm.server.read_timeouts import read_timeout_protocol
from edmm.server.sessions import owner_of, session_key

MODEL = "edmm-tiny"
API_KEY = "unused"  # what `LiveServer.client` sends: its sessions belong to this key
AUTH = {"Authorization": f"Bearer {API_KEY}"}  # the same owner, for plain HTTP calls
OWNER = owner_of({"authorization": AUTH["Authorization"]})  # that owner's name


def agent_id(name: str, owner: str = OWNER) -> str:
    """The agent layer's id of ``owner``'s session ``name`` (by default `API_KEY`'s)."""
    return session_key(owner, name)
MAX_MODEL_LEN = 2048


@dataclass
class LiveServer:
    """A running server: its base URL and its state (engine, metrics)."""

    url: str
    state: ServerState

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``)."""
        return f"{self.url}/v1"

    def client(self, **kwargs: object) -> openai.OpenAI:
        """An `openai.OpenAI` client of this server (no retries: errors must surface)."""
        return openai.OpenAI(base_url=self.base_url, api_key=API_KEY, max_retries=0,
                             timeout=60.0, **kwargs)  # type: ignore[arg-type]

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of ``/metrics``."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in
                                                  labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name} {labels} not in /metrics")

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no request is queued or running."""
        deadline = time.monotonic() + timeout
        while self.metric("edmm_requests_running") > 0:
            assert time.monotonic() < deadline, "requests still running"
            time.sleep(0.05)


def serve(state: ServerState, read_timeouts: bool = False) -> Iterator[LiveServer]:
    """Run ``state``'s app under uvicorn on a free loopback port until the generator closes;
    then check the engine's memory integrity and close the state. ``read_timeouts``: with the
    config's header and body read timeouts, as ``edmm serve`` runs it (else none)."""
    config = state.config
    http = ({"http": read_timeout_protocol(config.header_timeout_s, config.body_timeout_s)}
            if read_timeouts else {})
    try:
        with serve_app(build_app(state), **http) as url:
            yield LiveServer(url, state)
    finally:
        state.engine.check_integrity()
        state.close()


def nested_json(depth: int, inner: str = "1") -> str:
    """JSON text of ``depth`` nested arrays and objects around ``inner``."""
    return '[{"a": ' * (depth // 2) + inner + "}]" * (depth // 2)


def server_config(tiny_dir: Path, execution_aware: bool = True) -> ServerConfig:
    """The test servers' config: the tiny model, small limits."""
    return ServerConfig(model=str(tiny_dir), served_model_name=MODEL,
                        execution_aware=execution_aware,
                        engine=dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=8, num_slots=32))


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {
            "type": "object",
            "properties": {"op": {"type": "string", "enum": ["add", "mul"]},
                           "x": {"type": "boolean"}},
            "required": ["op", "x"],
            "additionalProperties": False,
        },
    },
}
TOOLS: list[Any] = [WEATHER, CALCULATOR]
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris today?"}]


def weather_agent(server: LiveServer, cities: list[str], model_class: Any,
                  settings: dict[str, Any] | None = None, **agent: Any) -> Any:
    """An OpenAI Agents SDK ``Agent`` (the SDK installed: callers skip without it, tracing off)
    of ``server`` through ``model_class`` (``agents.OpenAIChatCompletionsModel`` or
    ``agents.OpenAIResponsesModel``), with one tool ``get_weather(city)`` (Paris or London) that
    appends ``city`` to ``cities``. Its model settings force one tool call at a time (the random
    tiny model calls tools only when forced), greedy, at most 48 tokens, plus ``settings``;
    ``agent`` goes to the ``Agent`` (e.g. ``tool_use_behavior``)."""
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: Literal["Paris", "London"]) -> str:
        """Current weather of a city."""
        cities.append(city)
        return f"Sunny in {city}, 24 C"

    client = AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    return agents.Agent(
        name="assistant", instructions="You are a helpful assistant.", tools=[get_weather],
        model=model_class(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                            temperature=0, max_tokens=48, **(settings or {})),
        **agent)
