"""`ParallelHooks`: what a tensor-parallel rank changes in how an `Engine` is built.

`edmm.engine.tp` implements them (one object per rank); an engine without hooks is the plain
single-device engine. The engine calls each hook once, in the same order on every rank, so the
collectives some of them run pair up across ranks.
"""

from __future__ import annotations

from typing import Protocol

from edmm.engine.runner import ModelRunner
from edmm.memory import KVArena, KVSpec, PagePool
from edmm.model import CausalLM


class ParallelHooks(Protocol):
    """The rank-specific steps of building and closing an `Engine`."""

    def shard(self, model: CausalLM) -> CausalLM:
        """This rank's shard of the loaded full model (the full one is dropped after)."""
        ...

    def agree_num_pages(self, num_pages: int) -> int:
        """The pool size every rank uses, given this rank's own (e.g. the least of them)."""
        ...

    def make_arena(self, pool: PagePool, spec: KVSpec, num_slots: int,
                   max_tokens: int, read_align: int = 1) -> KVArena:
        """This rank's arena over ``pool`` (rank 0's records what it does for the others)."""
        ...

    def wrap_runner(self, runner: ModelRunner) -> ModelRunner:
        """The runner the engine steps through (rank 0's sends each step to the others)."""
        ...

    def check_integrity(self) -> None:
        """Raise if any other rank's memory breaks an invariant."""
        ...

    def close(self) -> None:
        """Stop the other ranks (rank 0) or nothing; called first by `Engine.close`."""
        ...
