"""Helpers of the agent tests: configs, greedy params, run loops, fake clock."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from edmm.agent import AgentEngine
from edmm.engine import Engine, EngineConfig, RequestOutput, SamplingParams

# tiny model: 4 layers x {K, V} x 2 kv heads x 32 dims x 4 B = 2 KiB per token: 8 per page.
HOST_PAGE = 16384
TOKENS_PER_PAGE = 8
MAX_LEN = 256

MakeAgent = Callable[..., AgentEngine]


def engine_config(folder: Path | str, **overrides: Any) -> EngineConfig:
    """A small float32 engine on the tiny model (16 KiB host pages)."""
    kwargs: dict[str, Any] = dict(
        model=str(folder), dtype="float32", host_page_size=HOST_PAGE, max_model_len=MAX_LEN,
        num_slots=24, max_num_seqs=8, num_pages=400, max_num_batched_tokens=512)
    return EngineConfig(**{**kwargs, **overrides})


def greedy(max_tokens: int = 6) -> SamplingParams:
    """Greedy params that ignore EOS (a random model emits it at random)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(engine: Engine | AgentEngine) -> dict[str, RequestOutput]:
    """Step until every request finished; the final output of each."""
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def drain(agent: AgentEngine, max_steps: int = 10_000) -> None:
    """Step until no speculation is left to prefill."""
    for _ in range(max_steps):
        if not agent.has_speculation():
            return
        agent.step()
    raise AssertionError("speculation never finished")


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
