"""Fixtures of the server tests: one live server on a free loopback port per test session; an
engine of the tiny model and its constrained decoding for the grammar tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_helpers import LiveServer, serve, server_config

from edmm.engine import Engine, EngineConfig
from edmm.server import ServerState
from edmm.server.guided import GuidedDecoding


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


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[Engine]:
    """An engine of the tiny model for grammar tests that step it directly (no server)."""
    with Engine(EngineConfig(model=str(tiny_dir), max_model_len=1024, num_slots=4,
                             max_num_seqs=4)) as e:
        yield e


@pytest.fixture(scope="module")
def guided(engine: Engine) -> GuidedDecoding:
    """The engine's constrained decoding, grammars checked in the calling thread."""
    tok = engine.tokenizer
    return GuidedDecoding(tok, engine.model_config.vocab_size, tok.eos_token_id)
