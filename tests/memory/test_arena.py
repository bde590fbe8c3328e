"""The page pool and the KV arena: exact pages, shared prefixes, commit/abort, typed errors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from edmm.memory import (
    InvalidBranchError,
    KVArena,
    KVSpec,
    NoFreeSlotError,
    PagePool,
    PoolExhaustedError,
    SlotOverflowError,
    SlotStateError,
)
from edmm.memory.vmm import VMMBackend

# 2 layers x {K,V} x 1 head x 40 dims x 4 B = 640 B per token: 6.4 tokens per 4 KiB page, so
# page boundaries fall inside tokens. On a 2 MiB page the same code runs with 3276.8 tokens.
SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=40, dtype=torch.float32)


def tokens_per_page(arena: KVArena) -> float:
    return arena.page_size / SPEC.token_bytes


@pytest.fixture
def arena(backend: VMMBackend) -> Iterator[KVArena]:
    pool = PagePool(backend, 24)
    max_tokens = int(8 * tokens_per_page_for(backend))
    a = KVArena(pool, SPEC, num_slots=4, max_tokens=max_tokens)
    yield a
    a.check_integrity()
    a.close()
    pool.close()


def tokens_per_page_for(backend: VMMBackend) -> float:
    return backend.page_size / SPEC.token_bytes


def write_tokens(arena: KVArena, slot: int, start: int, end: int, base: float) -> None:
    """Token t of the slot holds the value base + t in every element."""
    vals = base + torch.arange(start, end, dtype=torch.float32, device=arena.kv.device)
    arena.kv[slot, start:end] = vals.view(-1, 1, 1, 1, 1)


def read_tokens(arena: KVArena, slot: int) -> list[float]:
    n = arena.num_tokens(slot)
    kv = arena.kv[slot, :n].cpu()  # [n, layers, 2, heads, dim]
    first = kv.reshape(n, -1)
    assert bool((first == first[:, :1]).all()), "a token's elements disagree"
    return first[:, 0].tolist()


def test_grow_maps_exactly_the_pages_needed(arena: KVArena) -> None:
    slot = arena.allocate()
    assert slot == 0 and arena.slot_pages(slot) == []
    tpp = tokens_per_page(arena)
    n = int(tpp * 2.5)
    arena.grow(slot, n)
    assert arena.slot_pages(slot) == [0, 1, 2]
    assert arena.pool.num_used == 3
    write_tokens(arena, slot, 0, n, 0.0)
    assert read_tokens(arena, slot) == [float(t) for t in range(n)]
    k, v = arena.layer_kv(slot, 1)
    assert k.shape == (n, 1, 40) and v.shape == (n, 1, 40)
    # Zero-copy: the view's address is the slot's mapped address (layer 1, K of token 0).
    assert k.data_ptr() == arena.slot_address(slot) + 2 * 40 * 4
    arena.check_integrity()


def test_branch_shares_full_pages_and_copies_the_boundary(arena: KVArena) -> None:
    tpp = tokens_per_page(arena)
    src = arena.allocate()
    n = int(tpp * 3)  # 3 pages, the last one partly filled
    arena.grow(src, n)
    write_tokens(arena, src, 0, n, 100.0)
    cut = int(tpp * 2.5)
    br = arena.branch(src, cut)
    src_pages, br_pages = arena.slot_pages(src), arena.slot_pages(br)
    assert br_pages[:2] == src_pages[:2]  # the same physical pages
    assert br_pages[2] not in src_pages  # the boundary page is a private copy
    assert [arena.pool.refcount(p) for p in src_pages] == [2, 2, 1]
    assert read_tokens(arena, br) == [100.0 + t for t in range(cut)]
    # A shared prefix page written through one slot is seen in the other.
    arena.kv[src, 0] = -1.0
    assert read_tokens(arena, br)[0] == -1.0
    # The branch appends into its own pages; the source is untouched.
    arena.grow(br, cut + 20)
    write_tokens(arena, br, cut, cut + 20, 5000.0)
    assert read_tokens(arena, src)[1:] == [100.0 + t for t in range(1, n)]
    arena.check_integrity()


def test_commit_swaps_slots_and_reclaim_frees_the_old_one(arena: KVArena) -> None:
    tpp = tokens_per_page(arena)
    session = arena.allocate()
    n = int(tpp * 2.2)
    arena.grow(session, n)
    write_tokens(arena, session, 0, n, 0.0)
    br = arena.branch(session, n)
    arena.grow(br, n + 30)
    write_tokens(arena, br, n, n + 30, 1000.0)
    used_before = arena.pool.num_used
    new = arena.commit(session, br)
    assert new == br
    assert arena.pool.num_used == used_before  # commit itself frees and maps nothing
    with pytest.raises(SlotStateError):
        arena.grow(session, n + 1)  # the old slot is retired
    assert arena.reclaim() == 1
    assert [arena.pool.refcount(p) for p in arena.slot_pages(br)] == [1] * len(
        arena.slot_pages(br))
    assert read_tokens(arena, br) == [float(t) for t in range(n)] + [
        1000.0 + t for t in range(n, n + 30)]
    arena.free(br)
    assert arena.pool.num_used == 0
    arena.check_integrity()


def test_abort_frees_only_the_branch_pages(arena: KVArena) -> None:
    tpp = tokens_per_page(arena)
    session = arena.allocate()
    n = int(tpp * 2.5)
    arena.grow(session, n)
    br = arena.branch(session, n)
    arena.grow(br, int(tpp * 3.5))
    arena.free(br)  # abort
    assert [arena.pool.refcount(p) for p in arena.slot_pages(session)] == [1, 1, 1]
    assert arena.pool.num_used == 3
    arena.check_integrity()


def test_truncate_makes_a_shared_frontier_page_private(arena: KVArena) -> None:
    tpp = tokens_per_page(arena)
    src = arena.allocate()
    n = int(tpp * 3)
    arena.grow(src, n)
    write_tokens(arena, src, 0, n, 0.0)
    br = arena.branch(src, n)
    shared = arena.slot_pages(src)[1]
    cut = int(tpp * 1.5)  # inside the shared second page
    arena.truncate(src, cut)
    assert arena.slot_pages(src)[1] != shared
    assert arena.pool.refcount(shared) == 1  # now only the branch maps it
    arena.grow(src, n)
    write_tokens(arena, src, cut, n, 7000.0)  # must not write into the branch's page
    assert read_tokens(arena, br) == [float(t) for t in range(n)]
    assert read_tokens(arena, src) == [float(t) for t in range(cut)] + [
        7000.0 + t for t in range(cut, n)]
    arena.check_integrity()


def test_truncate_short_of_a_page_for_its_copy_changes_nothing(arena: KVArena) -> None:
    """A shared frontier page needs a private copy: with no page free (none freed by the cut
    itself either) the truncate raises `PoolExhaustedError` and leaves the slot as it was (an
    agent resume once truncated such a slot, lost the copy, and two slots went on writing one
    page)."""
    tpp = tokens_per_page(arena)
    src = arena.allocate()
    n = int(tpp * 3)
    arena.grow(src, n)
    write_tokens(arena, src, 0, n, 0.0)
    br = arena.branch(src, n)
    pages = arena.slot_pages(src)
    cut = int(tpp * 1.5)  # inside the shared second page
    pinned = pages[arena.pages_for(cut):]  # what the cut would free: held elsewhere
    for p in pinned:
        arena.pool.incref(p)
    held = arena.pool.alloc(arena.pool.num_free)  # the rest of the pool, taken
    with pytest.raises(PoolExhaustedError):
        arena.truncate(src, cut)
    assert (arena.num_tokens(src), arena.slot_pages(src)) == (n, pages)
    for p in [*pinned, *held]:
        arena.pool.decref(p)
    arena.check_integrity()
    arena.truncate(src, cut)  # the cut's own pages now pay for the copy
    assert arena.pool.refcount(pages[1]) == 1  # only the branch maps it
    assert read_tokens(arena, br) == [float(t) for t in range(n)]
    arena.check_integrity()


def test_bad_input_is_typed_and_harmless(arena: KVArena) -> None:
    slot = arena.allocate()
    arena.grow(slot, 10)
    with pytest.raises(SlotOverflowError):
        arena.grow(slot, arena.max_tokens + 1)  # mapping past the slot
    with pytest.raises(InvalidBranchError):
        arena.branch(slot, 11)  # longer than the source
    with pytest.raises(InvalidBranchError):
        arena.truncate(slot, 11)
    with pytest.raises(SlotStateError):
        arena.commit(slot, slot)
    assert arena.num_tokens(slot) == 10 and arena.pool.num_used == arena.pages_for(10)
    arena.free(slot)
    with pytest.raises(SlotStateError):
        arena.free(slot)  # freeing twice
    with pytest.raises(SlotStateError):
        arena.grow(99, 1)
    arena.check_integrity()


def test_pool_exhaustion_leaves_the_slot_unchanged(backend: VMMBackend) -> None:
    pool = PagePool(backend, 2)
    arena = KVArena(pool, SPEC, num_slots=3, max_tokens=int(8 * tokens_per_page_for(backend)))
    slot = arena.allocate()
    arena.grow(slot, 5)
    with pytest.raises(PoolExhaustedError) as e:
        arena.grow(slot, int(3 * tokens_per_page_for(backend)))
    assert e.value.wanted == 2 and e.value.free == 1
    assert arena.num_tokens(slot) == 5 and arena.slot_pages(slot) == [0]
    arena.check_integrity()
    for _ in range(2):
        arena.allocate()
    with pytest.raises(NoFreeSlotError):
        arena.branch(slot, 5)
    arena.check_integrity()
    arena.close()
    pool.close()


def test_branch_failure_releases_everything(backend: VMMBackend) -> None:
    pool = PagePool(backend, 1)
    arena = KVArena(pool, SPEC, num_slots=2, max_tokens=int(4 * tokens_per_page_for(backend)))
    slot = arena.allocate()
    arena.grow(slot, 3)  # one partial page: a branch needs a boundary copy, the pool has none
    with pytest.raises(PoolExhaustedError):
        arena.branch(slot, 3)
    assert arena.free_slots() == 1 and pool.num_used == 1
    arena.check_integrity()
    arena.close()
    pool.close()


def test_kv_view_matches_layer_layout(arena: KVArena) -> None:
    slot = arena.allocate()
    arena.grow(slot, 3)
    arena.kv[slot, 2, 1, 0] = 3.0  # token 2, layer 1, K
    raw = arena.token_bytes_view(slot, 2, 3).view(torch.float32)  # [layers*2*heads*dim]
    per = 2 * 1 * 40
    assert bool((raw[per: per + 40] == 3.0).all())
    assert arena.kv.shape == (4, arena.max_tokens, 2, 2, 1, 40)


class CountingBackend:
    """Wraps a backend and counts page creations."""

    def __init__(self, inner: VMMBackend) -> None:
        self._inner = inner
        self.created = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def create_page(self) -> int:
        self.created += 1
        return self._inner.create_page()


def test_no_page_creation_after_the_pool_is_built(backend: VMMBackend) -> None:
    counting = CountingBackend(backend)
    pool = PagePool(counting, 16)  # type: ignore[arg-type]
    assert counting.created == 16
    tpp = tokens_per_page_for(backend)
    arena = KVArena(pool, SPEC, num_slots=4, max_tokens=int(6 * tpp))
    session = arena.allocate()
    arena.grow(session, int(2.5 * tpp))
    br = arena.branch(session, int(2.5 * tpp) - 1)
    arena.grow(br, int(4.5 * tpp))
    arena.truncate(br, int(3.2 * tpp))
    session = arena.commit(session, br)
    arena.reclaim()
    arena.free(session)
    assert counting.created == 16
    arena.check_integrity()
    arena.close()
    pool.close()
