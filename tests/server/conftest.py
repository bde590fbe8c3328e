"""Fixtures of the server tests: one live server on a free loopback port per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_helpers import LiveServer, serve, server_config

from edmm.server import ServerState


@pytest.fixture(scope="session")
def server(tiny_dir: Path) -> Iterator[LiveServer]:
    """The server on the tiny model (execution-aware when the agent layer is available)."""
    yield from serve(ServerState(server_config(tiny_dir)))


@pytest.fixture(scope="module", params=[True, False], ids=["agent", "plain"])
def fresh_server(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[LiveServer]:
    """A server of its own for a test module (tests that count what the engine keeps), with
    the agent layer and without it (``--no-execution-aware``)."""
    yield from serve(ServerState(server_config(tiny_dir, execution_aware=request.param)))


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    """An OpenAI SDK client of the live server."""
    return server.client()
