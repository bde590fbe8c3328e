"""Fixtures of the server tests: one live server on a free loopback port per test session."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

from edmm.model.tiny import ensure_tiny_model
from edmm.server import ServerConfig, ServerState, build_app

MODEL = "edmm-tiny"
MAX_MODEL_LEN = 2048
START_TIMEOUT_S = 30.0


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
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0,
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


@pytest.fixture(autouse=True, scope="session")
def _single_thread() -> Iterator[None]:
    """The tiny model runs fastest on one thread (tests share 2 cores with the server)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model, built once in a temp cache."""
    return ensure_tiny_model(tmp_path_factory.mktemp("edmm-cache"))


def _serve(state: ServerState) -> Iterator[LiveServer]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(build_app(state), log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", state)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        state.engine.check_integrity()
        state.close()


def _config(tiny_cache: Path, execution_aware: bool = True) -> ServerConfig:
    return ServerConfig(model=str(tiny_cache), served_model_name=MODEL,
                        execution_aware=execution_aware,
                        engine=dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=8, num_slots=32))


@pytest.fixture(scope="session")
def server(tiny_cache: Path) -> Iterator[LiveServer]:
    """The server on the tiny model (execution-aware when the agent layer is available)."""
    yield from _serve(ServerState(_config(tiny_cache)))


@pytest.fixture(scope="module", params=[True, False], ids=["agent", "plain"])
def fresh_server(request: pytest.FixtureRequest, tiny_cache: Path) -> Iterator[LiveServer]:
    """A server of its own for a test module (tests that count what the engine keeps), with
    the agent layer and without it (``--no-execution-aware``)."""
    yield from _serve(ServerState(_config(tiny_cache, execution_aware=request.param)))


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    """An OpenAI SDK client of the live server."""
    return server.client()
