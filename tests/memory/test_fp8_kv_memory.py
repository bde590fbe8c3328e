"""An FP8 KV cache in the arena: pages sized by the storage dtype (twice BF16's tokens in the
same pool, exact page arithmetic), and its bytes carried unchanged by branches, zero-copy
commits, offload to host memory (half BF16's bytes there) and restore."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from edmm.engine.prefix_cache import EntryRank, PrefixCache
from edmm.kernels._common import FP8_KV_DTYPE
from edmm.memory import KVArena, KVSpec, PagePool, PoolExhaustedError, open_backend
from edmm.memory.offload import HostKVStore
from edmm.memory.vmm import VMMBackend

QWEN_7B = (28, 4, 128)  # layers, KV heads, head dim: 56 KiB of BF16 KV per token
SMALL = (2, 2, 32)  # 512 B per BF16 token, 256 B per FP8 one


@contextmanager
def _arena(backend: VMMBackend, shape: tuple[int, int, int], dtype: torch.dtype,
           num_pages: int, max_tokens: int, num_slots: int = 4) -> Iterator[KVArena]:
    pool = PagePool(backend, num_pages)
    arena = KVArena(pool, KVSpec(*shape, dtype), num_slots=num_slots, max_tokens=max_tokens)
    try:
        yield arena
        arena.check_integrity()
    finally:
        arena.close()
        pool.close()


def _tokens_that_fit(arena: KVArena) -> int:
    """The most tokens one slot maps from the whole pool, found by growing it: n fits,
    n + 1 raises `PoolExhaustedError` (the slot unchanged)."""
    n = arena.pool.capacity * arena.page_size // arena.spec.token_bytes
    slot = arena.allocate()
    arena.grow(slot, n)
    with pytest.raises(PoolExhaustedError):
        arena.grow(slot, n + 1)
    assert arena.num_tokens(slot) == n and arena.pool.num_free == 0
    arena.free(slot)
    return n


@pytest.mark.parametrize(("shape", "page", "pages"), [
    (QWEN_7B, 2 << 20, 8),  # the GPU's 2 MiB pages: 292 BF16 tokens, 585 FP8 ones
    (SMALL, 4096, 24),  # page boundaries inside BF16 tokens
])
def test_a_pool_holds_twice_the_tokens_in_fp8(shape: tuple[int, int, int], page: int,
                                              pages: int) -> None:
    backend = open_backend("host", host_page_size=page)
    try:
        fits = {}
        for dtype in (torch.bfloat16, FP8_KV_DTYPE):
            max_tokens = 2 * pages * page // (shape[0] * 2 * shape[1] * shape[2])
            with _arena(backend, shape, dtype, pages, max_tokens) as arena:
                assert arena.spec.token_bytes == shape[0] * 2 * shape[1] * shape[2] * (
                    2 if dtype == torch.bfloat16 else 1)
                fits[dtype] = _tokens_that_fit(arena)
    finally:
        backend.close()
    assert fits[FP8_KV_DTYPE] >= 1.9 * fits[torch.bfloat16]
    if shape == QWEN_7B:
        assert (fits[torch.bfloat16], fits[FP8_KV_DTYPE]) == (292, 585)


def _random_bytes(arena: KVArena, slot: int, start: int, end: int, seed: int) -> torch.Tensor:
    """Write random bytes (every e4m3 pattern, NaNs included) into tokens [start, end) of a
    slot; returns a copy of them."""
    gen = torch.Generator().manual_seed(seed)
    view = arena.token_bytes_view(slot, start, end)
    view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=gen))
    return view.clone()


def test_branch_and_commit_carry_fp8_bytes(backend: VMMBackend) -> None:
    """A branch at a point inside a page shares the full pages and copies the boundary one;
    the session commits to it and the retired slot is reclaimed: every FP8 byte of the
    shared prefix is the session's, the branch's own tokens are its own."""
    with _arena(backend, SMALL, FP8_KV_DTYPE, num_pages=16, max_tokens=64) as arena:
        session = arena.allocate()
        arena.grow(session, 40)
        prefix = _random_bytes(arena, session, 0, 40, seed=0)
        branch = arena.branch(session, 37)  # 256 B tokens: 16 per 4 KiB page, 37 inside one
        arena.grow(branch, 50)
        tail = _random_bytes(arena, branch, 37, 50, seed=1)
        assert arena.kv.dtype == FP8_KV_DTYPE
        assert torch.equal(arena.token_bytes_view(session, 0, 40), prefix)  # untouched
        session = arena.commit(session, branch)
        assert arena.reclaim() == 1
        tb = arena.spec.token_bytes
        assert torch.equal(arena.token_bytes_view(session, 0, 37), prefix[:37 * tb])
        assert torch.equal(arena.token_bytes_view(session, 37, 50), tail)
        arena.free(session)


def test_offload_and_restore_carry_fp8_bytes_at_half_the_host_bytes(
        backend: VMMBackend) -> None:
    """A retained session evicted to the host and restored: its FP8 KV comes back byte for
    byte, and the host held half the bytes BF16 KV of the same tokens takes."""
    held = {}
    for dtype in (torch.bfloat16, FP8_KV_DTYPE):
        with _arena(backend, SMALL, dtype, num_pages=16, max_tokens=64) as arena:
            store = HostKVStore(arena, capacity_bytes=8 * arena.page_size, block_tokens=4)
            cache = PrefixCache(arena, block_size=4, offload=store)
            tokens = list(range(1, 41))
            slot = arena.allocate()
            arena.grow(slot, 40)
            kv = _random_bytes(arena, slot, 0, 40, seed=2)
            cache.release(slot, tokens, 40, tag="s1", rank=EntryRank.RETAINED)
            assert cache.evict_one() and arena.pool.num_used == 0
            assert cache.restore("s1")
            store.poll()  # (synchronous copies: counted already)
            held[dtype] = store.counters.saved_bytes
            assert store.counters.loaded_bytes == held[dtype]
            hit = cache.acquire([*tokens, 99], max_tokens=64, claim=("s1",))
            assert hit is not None and hit.num_tokens == 40
            assert torch.equal(arena.token_bytes_view(hit.slot, 0, 40), kv)
            cache.check_integrity()
            arena.free(hit.slot)
    assert held[FP8_KV_DTYPE] == 40 * 256 and held[torch.bfloat16] == 2 * held[FP8_KV_DTYPE]
