"""Fixtures of the agent tests: one torch thread, the tiny model, small agent engines."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from agent_helpers import MakeAgent, engine_config

from edmm.agent import AgentConfig, AgentEngine
from edmm.model.tiny import ensure_tiny_model


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread (OpenMP spinning on a busy 2-core box is slow)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model (with its tokenizer and chat template), built once."""
    return ensure_tiny_model(tmp_path_factory.mktemp("edmm-cache"))


@pytest.fixture
def make_agent(tiny_dir: Path) -> Iterator[MakeAgent]:
    """``make_agent(agent_config=None, clock=None, **engine_overrides)``: an agent engine on
    the tiny model; at teardown each is integrity-checked, closed, and its pool must be empty."""
    agents: list[AgentEngine] = []

    def make(agent_config: AgentConfig | None = None, clock: Callable[[], float] | None = None,
             **overrides: Any) -> AgentEngine:
        kwargs: dict[str, Any] = {"clock": clock} if clock is not None else {}
        agent = AgentEngine(engine_config(tiny_dir, **overrides), agent_config, **kwargs)
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        agent.check_integrity()
        pool = agent.engine.pool
        for session_id in agent.session_ids():
            agent.close_session(session_id)
        agent.engine.reset_prefix_cache()
        assert pool.num_used == 0
        agent.close()
