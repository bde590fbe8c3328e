"""Helpers of the agent tests: configs, greedy params, run loops, fake clock."""

from __future__ import annotations

from collections.abc import Callable

from edmm.agent import AgentEngine
from edmm.engine import Engine, RequestOutput, SamplingParams

MakeAgent = Callable[..., AgentEngine]


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
