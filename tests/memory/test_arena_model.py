"""Property test: random grow / branch / commit / truncate / free against a plain-Python model.

The model knows nothing of the arena's code: each live slot is a list of token values and a list
of abstract page identities (a branch shares the source's full pages below its cut and gets fresh
ones after; truncation drops pages and privatises a shared frontier page and any shared page
after it). A second machine maps slots up to a read alignment of 8 tokens (`KVArena`'s
``read_align``: pages past the frontier that a tile-loading kernel reads). After every step the
arena's integrity check must hold, every slot's bytes must equal the model's tokens, and the
sharing structure of physical pages must equal the model's.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from page_model import assert_sharing_matches, page_refcounts
from tiers import examples

from edmm.memory import KVArena, KVSpec, PagePool, PoolExhaustedError
from edmm.memory.errors import NoFreeSlotError
from edmm.memory.host import HostVMM

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=40, dtype=torch.float32)  # 640 B/token
PAGE = 4096
MAX_TOKENS = 48
NUM_SLOTS = 6
NUM_PAGES = 30


class ModelSlot:
    """The model of one slot: token values and abstract page ids."""

    def __init__(self, tokens: list[float], pages: list[int]) -> None:
        self.tokens = tokens
        self.pages = pages


class ArenaMachine(RuleBasedStateMachine):
    read_align = 1

    def __init__(self) -> None:
        super().__init__()
        self.backend = HostVMM(PAGE)
        self.pool = PagePool(self.backend, NUM_PAGES)
        self.arena = KVArena(self.pool, SPEC, NUM_SLOTS, MAX_TOKENS, read_align=self.read_align)
        self.model: dict[int, ModelSlot] = {}
        self.retired: dict[int, ModelSlot] = {}
        self.fresh = itertools.count()
        self.values = itertools.count(1)

    # ---------------------------------------------------------------- model helpers
    def pages_for(self, n: int) -> int:
        backed = min(-(-n // self.read_align) * self.read_align, MAX_TOKENS)
        return -(-backed * SPEC.token_bytes // PAGE)

    def slots(self) -> list[tuple[int, ModelSlot]]:
        """Every slot the arena holds: the live ones and the retired (committed) ones."""
        return [*self.model.items(), *self.retired.items()]

    def refcounts(self) -> dict[int, int]:
        return page_refcounts(m.pages for _, m in self.slots())

    def write(self, slot: int, start: int, end: int) -> list[float]:
        vals = [float(next(self.values)) for _ in range(start, end)]
        if vals:
            t = torch.tensor(vals).view(-1, 1, 1, 1, 1)
            self.arena.kv[slot, start:end] = t
        return vals

    def pick(self, data: st.DataObject, pool: dict[int, ModelSlot]) -> int:
        return data.draw(st.sampled_from(sorted(pool)))

    # ---------------------------------------------------------------- rules
    @rule(n=st.integers(0, MAX_TOKENS))
    def allocate_and_grow(self, n: int) -> None:
        try:
            slot = self.arena.allocate()
        except NoFreeSlotError:
            assert len(self.model) + len(self.retired) == NUM_SLOTS
            return
        self.model[slot] = ModelSlot([], [])
        self._grow(slot, n)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), extra=st.integers(0, 20))
    def grow(self, data: st.DataObject, extra: int) -> None:
        slot = self.pick(data, self.model)
        self._grow(slot, min(MAX_TOKENS, len(self.model[slot].tokens) + extra))

    def _grow(self, slot: int, n: int) -> None:
        m = self.model[slot]
        need = self.pages_for(n) - len(m.pages)
        if need > self.pool.num_free:
            try:
                self.arena.grow(slot, n)
                raise AssertionError("grow should have raised PoolExhaustedError")
            except PoolExhaustedError:
                return
        self.arena.grow(slot, n)
        m.pages += [next(self.fresh) for _ in range(need)]
        m.tokens += self.write(slot, len(m.tokens), n)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def branch(self, data: st.DataObject) -> None:
        src = self.pick(data, self.model)
        m = self.model[src]
        cut = data.draw(st.integers(0, len(m.tokens)))
        full = cut * SPEC.token_bytes // PAGE
        boundary = self.pages_for(cut) - full
        free_slot = len(self.model) + len(self.retired) < NUM_SLOTS
        if not free_slot or boundary > self.pool.num_free:
            before = self.pool.num_used
            try:
                self.arena.branch(src, cut)
                raise AssertionError("branch should have failed")
            except (PoolExhaustedError, NoFreeSlotError):
                assert self.pool.num_used == before
                return
        dst = self.arena.branch(src, cut)
        self.model[dst] = ModelSlot(m.tokens[:cut],
                                    m.pages[:full] + [next(self.fresh) for _ in range(boundary)])

    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        session = self.pick(data, self.model)
        branch = data.draw(st.sampled_from(sorted(set(self.model) - {session})))
        used = self.pool.num_used
        assert self.arena.commit(session, branch) == branch
        assert self.pool.num_used == used
        self.retired[session] = self.model.pop(session)

    @precondition(lambda self: self.retired)
    @rule()
    def reclaim(self) -> None:
        assert self.arena.reclaim() == len(self.retired)
        self.retired.clear()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        slot = self.pick(data, self.model)
        self.truncate_at(slot, data.draw(st.integers(0, len(self.model[slot].tokens))))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), extra=st.integers(1, 20))
    def speculate_in_place(self, data: st.DataObject, extra: int) -> None:
        """A paused session's slot extended by ``extra`` speculated tokens (append), then cut
        back at resume to a point at or after its own tokens (a miss: truncate)."""
        slot = self.pick(data, self.model)
        own = len(self.model[slot].tokens)
        self._grow(slot, min(MAX_TOKENS, own + extra))
        self.truncate_at(slot, data.draw(st.integers(own, len(self.model[slot].tokens))))

    def truncate_at(self, slot: int, n: int) -> None:
        """Truncate ``slot`` to ``n`` tokens in the arena and the model: copy-on-write of the
        shared pages from the new frontier on; all or nothing when the pool lacks the copies."""
        m = self.model[slot]
        keep = self.pages_for(n)
        pages = m.pages[:keep]
        counts = self.refcounts()
        cow = [i for i in range(n * SPEC.token_bytes // PAGE, keep) if counts[pages[i]] > 1]
        if len(cow) > self.pool.num_free + sum(counts[p] == 1 for p in m.pages[keep:]):
            with pytest.raises(PoolExhaustedError):
                self.arena.truncate(slot, n)
            return
        self.arena.truncate(slot, n)
        for i in cow:
            pages[i] = next(self.fresh)
        m.tokens, m.pages = m.tokens[:n], pages

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        slot = self.pick(data, self.model)
        self.arena.free(slot)
        del self.model[slot]

    # ---------------------------------------------------------------- invariants
    @invariant()
    def integrity(self) -> None:
        self.arena.check_integrity()

    @invariant()
    def contents_match(self) -> None:
        for slot, m in self.slots():
            n = len(m.tokens)
            assert self.arena.num_tokens(slot) == n
            got = self.arena.kv[slot, :n].reshape(n, SPEC.token_elems)
            assert got[:, 0].tolist() == m.tokens
            assert bool((got == got[:, :1]).all())

    @invariant()
    def sharing_matches(self) -> None:
        assert_sharing_matches(self.arena, ((slot, m.pages) for slot, m in self.slots()))

    def teardown(self) -> None:
        self.arena.close()
        self.pool.close()
        self.backend.close()


class AlignedArenaMachine(ArenaMachine):
    read_align = 8  # 6.4 tokens per page: the margin spans up to two pages


SETTINGS = settings(max_examples=examples(60), stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
# Marked as @given tests are (hypothesis's plugin marks those): .ci/run's thorough stage
# selects `-m hypothesis` to run every property at its thorough count.
TestArenaModel = pytest.mark.hypothesis(ArenaMachine.TestCase)
TestArenaModel.settings = SETTINGS
TestAlignedArenaModel = pytest.mark.hypothesis(AlignedArenaMachine.TestCase)
TestAlignedArenaModel.settings = SETTINGS
