"""Fixtures of the agent tests: one torch thread, the tiny model, small agent engines."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import MakeAgent
from kv_helpers import tiny_engine_config as engine_config

from edmm.agent import AgentConfig, AgentEngine


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
        for session_id in agent.session_ids():
            agent.close_session(session_id)
        agent.engine.reset_prefix_cache()
        assert agent.engine.stats().kv.pages_in_use == 0
        agent.close()
