"""An arena journal: record the memory operations made on one arena, replay them on replicas.

A tensor-parallel engine (`edmm.engine.tp`) keeps one arena per rank: the same slots on the same
page ids, each holding its rank's KV heads. Rank 0's scheduler and prefix cache operate on a
`JournaledArena`; the other ranks `replay` its operations, in order, on plain `KVArena`s. The
arena is deterministic (lowest free slot, FIFO free pages), so a replica that starts equal stays
equal, slot for slot and page for page (`KVArena.layout`), and the operations that move bytes
(the boundary page of a branch, copy-on-write in a truncate) move each replica's own bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from edmm.memory.arena import KVArena, KVSpec
from edmm.memory.errors import ArenaDesyncError
from edmm.memory.pool import PagePool

_T = TypeVar("_T")


@dataclass(frozen=True)
class ArenaOp:
    """One top-level arena call: ``getattr(arena, name)(*args)`` returned ``result``."""

    name: str
    args: tuple[int, ...]
    result: int | None


class JournaledArena(KVArena):
    """A `KVArena` that records its top-level memory operations while journaling.

    Calls made from inside another operation (``branch`` allocating, ``reclaim`` freeing) are
    not recorded: replaying the outer one repeats them. Failed operations leave the arena
    unchanged and are not recorded.
    """

    def __init__(self, pool: PagePool, spec: KVSpec, num_slots: int, max_tokens: int,
                 read_align: int = 1) -> None:
        super().__init__(pool, spec, num_slots, max_tokens, read_align)
        self._ops: list[ArenaOp] | None = None  # None: not journaling
        self._depth = 0

    def start_journal(self) -> None:
        """Record from now on (a replica must equal this arena now)."""
        self._ops = []

    def stop_journal(self) -> None:
        """Stop recording and drop what was not taken."""
        self._ops = None

    def take_ops(self) -> list[ArenaOp]:
        """The operations recorded since the last call."""
        ops, self._ops = (self._ops or []), ([] if self._ops is not None else None)
        return ops

    def _record(self, name: str, args: tuple[int, ...], call: Callable[[], _T]) -> _T:
        self._depth += 1
        try:
            result = call()
        finally:
            self._depth -= 1
        if self._ops is not None and self._depth == 0:
            self._ops.append(ArenaOp(name, args, result if isinstance(result, int) else None))
        return result

    def allocate(self) -> int:
        """See `KVArena.allocate` (recorded)."""
        return self._record("allocate", (), super().allocate)

    def grow(self, slot: int, num_tokens: int) -> None:
        """See `KVArena.grow` (recorded)."""
        self._record("grow", (slot, num_tokens), functools.partial(super().grow, slot, num_tokens))

    def branch(self, src: int, num_tokens: int) -> int:
        """See `KVArena.branch` (recorded)."""
        return self._record("branch", (src, num_tokens),
                            functools.partial(super().branch, src, num_tokens))

    def commit(self, session: int, branch: int) -> int:
        """See `KVArena.commit` (recorded)."""
        return self._record("commit", (session, branch),
                            functools.partial(super().commit, session, branch))

    def truncate(self, slot: int, num_tokens: int) -> None:
        """See `KVArena.truncate` (recorded)."""
        self._record("truncate", (slot, num_tokens),
                     functools.partial(super().truncate, slot, num_tokens))

    def free(self, slot: int) -> None:
        """See `KVArena.free` (recorded)."""
        self._record("free", (slot,), functools.partial(super().free, slot))

    def reclaim(self) -> int:
        """See `KVArena.reclaim` (recorded)."""
        return self._record("reclaim", (), super().reclaim)

    def close(self) -> None:
        """See `KVArena.close` (never recorded: every replica closes its own)."""
        self.stop_journal()
        super().close()


def replay(arena: KVArena, ops: list[ArenaOp]) -> None:
    """Apply the operations recorded by a `JournaledArena` to ``arena``; raise
    `ArenaDesyncError` when one returns another slot or count than it did there."""
    for op in ops:
        result = getattr(arena, op.name)(*op.args)
        if op.result is not None and result != op.result:
            raise ArenaDesyncError(
                f"arena desync: {op.name}{op.args} gave {result} here, {op.result} there")
