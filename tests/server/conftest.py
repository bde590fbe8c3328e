"""Fixtures of the server tests: one live server on a free loopback port per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from server_helpers import LiveServer, serve, server_config

from edmm.model.tiny import ensure_tiny_model
from edmm.server import ServerState


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


@pytest.fixture(scope="session")
def server(tiny_cache: Path) -> Iterator[LiveServer]:
    """The server on the tiny model (execution-aware when the agent layer is available)."""
    yield from serve(ServerState(server_config(tiny_cache)))


@pytest.fixture(scope="module", params=[True, False], ids=["agent", "plain"])
def fresh_server(request: pytest.FixtureRequest, tiny_cache: Path) -> Iterator[LiveServer]:
    """A server of its own for a test module (tests that count what the engine keeps), with
    the agent layer and without it (``--no-execution-aware``)."""
    yield from serve(ServerState(server_config(tiny_cache, execution_aware=request.param)))


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    """An OpenAI SDK client of the live server."""
    return server.client()
