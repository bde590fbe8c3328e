"""`ServerConfig` and `ServerState`: the engine, its thread, and what the routes use."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edmm.agent import AgentEngine
from edmm.engine import Engine, EngineConfig
from edmm.server.engine_loop import EngineLoop
from edmm.server.guided import GuidedDecoding
from edmm.server.metrics import ServerMetrics
from edmm.server.serving import OpenAIServing
from edmm.server.sessions import AgentSessions, PlainSessions, SessionBackend

TINY_MODEL_NAME = "edmm-tiny"


@dataclass
class ServerConfig:
    """How to serve.

    Attributes:
        model: a local HF folder or a preset name; None: the embedded tool model.
        device: ``"cpu"`` or ``"cuda"``.
        host, port: where to listen (loopback by default).
        served_model_name: the ``model`` clients must send; default: ``edmm-tiny``, the
            folder's name, or the preset's.
        execution_aware: drive the engine through the agent layer (`edmm.agent.AgentEngine`:
            speculation in tool windows, zero-copy commit); False: a plain engine with prefix
            caching only.
        engine: further `EngineConfig` fields (``max_model_len``, ``num_pages``, ``dtype``...).
    """

    model: str | None = None
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    execution_aware: bool = True
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        """The name clients address the model by."""
        if self.served_model_name:
            return self.served_model_name
        return TINY_MODEL_NAME if self.model is None else Path(self.model).name or self.model


class ServerState:
    """The engine, the session backend on its thread, and the request logic."""

    def __init__(self, config: ServerConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.engine = engine if engine is not None else Engine(
            EngineConfig(model=config.model, device=config.device, **config.engine))
        tokenizer = copy.deepcopy(self.engine.tokenizer)  # the event loop's own instance
        self.backend = _backend(self.engine, config.execution_aware)
        self.loop: EngineLoop[SessionBackend] = EngineLoop(self.backend)
        self.metrics = ServerMetrics(config.model_name)
        self.serving = OpenAIServing(self.loop, self.engine, tokenizer, config.model_name,
                                     self.metrics, _guided(self.engine, tokenizer))

    @property
    def execution_aware(self) -> bool:
        """True when the agent layer drives the engine."""
        return isinstance(self.backend, AgentSessions)

    def start(self) -> None:
        """Start the engine thread."""
        self.loop.start()

    def stop(self) -> None:
        """Stop the engine thread (pending requests fail with 503)."""
        self.loop.stop()

    def close(self) -> None:
        """Stop, then release the tokenizing thread and the engine's memory."""
        self.stop()
        self.serving.close()
        self.engine.close()


def _backend(engine: Engine, execution_aware: bool) -> SessionBackend:
    if not execution_aware:
        return PlainSessions(engine)
    return AgentSessions(AgentEngine(engine), engine)


def _guided(engine: Engine, tokenizer: Any) -> GuidedDecoding | None:
    """Constrained decoding for models with a tokenizer (presets have none)."""
    if tokenizer is None:
        return None
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = min(engine.eos_token_ids, default=0)
    return GuidedDecoding(tokenizer, engine.model_config.vocab_size, int(eos))
