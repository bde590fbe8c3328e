"""The arena journal: operations recorded on one arena and replayed on a replica leave both
with the same slots on the same pages holding the same bytes (the tensor-parallel ranks'
invariant), including the operations that move bytes (branch, copy-on-write truncate)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant
from test_arena_model import MAX_TOKENS, NUM_PAGES, NUM_SLOTS, PAGE, SPEC, ArenaMachine
from tiers import examples

from edmm.memory import KVArena, PagePool
from edmm.memory.errors import ArenaDesyncError
from edmm.memory.host import HostVMM
from edmm.memory.journal import ArenaOp, JournaledArena, replay


class ReplayedArenaMachine(ArenaMachine):
    """`ArenaMachine`'s random operations on a journaled arena, replayed on a replica that
    receives the same token writes (as every rank writes its own heads' KV)."""

    def __init__(self) -> None:
        super().__init__()
        self.arena.close()
        self.journaled = JournaledArena(self.pool, SPEC, NUM_SLOTS, MAX_TOKENS)
        self.arena = self.journaled
        self.journaled.start_journal()
        self.replica_backend = HostVMM(PAGE)
        self.replica = KVArena(PagePool(self.replica_backend, NUM_PAGES), SPEC, NUM_SLOTS,
                               MAX_TOKENS)

    def write(self, slot: int, start: int, end: int) -> list[float]:
        vals = super().write(slot, start, end)
        replay(self.replica, self.journaled.take_ops())  # the grow before this write
        if vals:
            self.replica.kv[slot, start:end] = torch.tensor(vals).view(-1, 1, 1, 1, 1)
        return vals

    @invariant()
    def replica_matches(self) -> None:
        replay(self.replica, self.journaled.take_ops())
        self.replica.check_integrity()
        assert self.replica.layout() == self.arena.layout()
        for slot, _, n, _ in self.arena.layout():
            assert torch.equal(self.replica.kv[slot, :n], self.arena.kv[slot, :n])

    def teardown(self) -> None:
        super().teardown()
        self.replica.close()
        self.replica.pool.close()
        self.replica_backend.close()


TestArenaReplay = pytest.mark.hypothesis(ReplayedArenaMachine.TestCase)  # see test_arena_model
TestArenaReplay.settings = settings(max_examples=examples(40), stateful_step_count=40,
                                    deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture
def arenas() -> Iterator[tuple[JournaledArena, KVArena]]:
    """A journaled arena and a plain replica, 16 pages each."""
    made = []
    for kind in (JournaledArena, KVArena):
        backend = HostVMM(PAGE)
        made.append((backend, kind(PagePool(backend, 16), SPEC, 4, MAX_TOKENS)))
    leader, replica = (a for _, a in made)
    assert isinstance(leader, JournaledArena)
    yield leader, replica
    for backend, arena in made:
        arena.close()
        arena.pool.close()
        backend.close()


def test_journal_records_top_level_ops_only(arenas: tuple[JournaledArena, KVArena]) -> None:
    leader, replica = arenas
    leader.allocate()  # before the journal starts: the replica does it itself
    replica.allocate()
    leader.start_journal()
    s = leader.allocate()
    leader.grow(s, 20)
    b = leader.branch(s, 18)  # allocates inside: one op
    leader.commit(s, b)
    leader.truncate(b, 17)
    leader.reclaim()  # frees inside: one op
    ops = leader.take_ops()
    assert [op.name for op in ops] == ["allocate", "grow", "branch", "commit", "truncate",
                                       "reclaim"]
    replay(replica, ops)
    assert replica.layout() == leader.layout()
    with pytest.raises(ArenaDesyncError, match="desync"):
        replay(replica, [ArenaOp("allocate", (), 0)])  # slot 0 there, slot 2 here
    assert leader.take_ops() == []
    leader.stop_journal()
    leader.allocate()
    assert leader.take_ops() == []
