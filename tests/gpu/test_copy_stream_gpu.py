"""CUDA side-stream host copies (`StreamCopier`) through the prefix index: restored KV is bit
equal to what left, an evicted session's pages are not unmapped or reused while its copy to
the host runs, and the step after a restore waits for it on the device."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from edmm.engine import PrefixCache
from edmm.engine.prefix_cache import EntryRank
from edmm.memory import KVArena, KVSpec, PagePool
from edmm.memory.backends import open_backend
from edmm.memory.copies import StreamCopier
from edmm.memory.offload import HostKVStore

pytestmark = pytest.mark.gpu

QWEN = KVSpec(num_layers=28, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
N = 4000  # 4000 x 56 KiB: 219 MiB, 110 pages of 2 MiB
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU sleep on the copy stream: the copy is late


@pytest.fixture
def cache() -> Iterator[PrefixCache]:
    backend = open_backend("cuda")
    pool = PagePool(backend, 120)  # the session's 110 pages and 10 more: freed pages are reused
    arena = KVArena(pool, QWEN, num_slots=4, max_tokens=8192)
    store = HostKVStore(arena, 1 << 30, StreamCopier(arena.kv.device))
    c = PrefixCache(arena, block_size=16, offload=store)
    yield c
    store.drain()
    c.clear()
    arena.check_integrity()
    arena.close()
    pool.close()
    backend.close()


def _paused(cache: PrefixCache, tokens: list[int]) -> torch.Tensor:
    arena = cache.arena
    slot = arena.allocate()
    arena.grow(slot, len(tokens))
    kv = torch.randn(len(tokens), 28, 2, 4, 128, dtype=torch.bfloat16, device="cuda")
    arena.kv[slot, : len(tokens)] = kv
    cache.release(slot, tokens, len(tokens), tag="s", rank=EntryRank.RETAINED)
    return kv


def _late_copies(cache: PrefixCache) -> None:
    """Hold the copy stream back, so the next copy is still queued when the host goes on."""
    assert cache.offload is not None and isinstance(cache.offload.copier, StreamCopier)
    with torch.cuda.stream(cache.offload.copier.stream):
        torch.cuda._sleep(SLEEP_CYCLES)


def test_restored_kv_is_bit_equal_and_awaited(cache: PrefixCache) -> None:
    tokens = list(range(1, N + 1))
    kv = _paused(cache, tokens)
    assert cache.evict_one() and cache.offloaded_tokens("s") == N
    _late_copies(cache)
    assert cache.restore("s")
    (slot,) = cache.tagged("s")
    assert cache.pending_copies(slot) == 1  # the host did not wait
    hit = cache.acquire([*tokens, 0], 2 * N, claim=("s",))
    assert hit is not None and hit.num_tokens == N
    got = cache.arena.kv[hit.slot, :N].clone()  # on the compute stream: after the restore
    assert torch.equal(got, kv)
    cache.release(hit.slot, [], 0)


def test_pages_are_not_reused_under_a_running_offload(cache: PrefixCache) -> None:
    tokens = list(range(1, N + 1))
    kv = _paused(cache, tokens)
    arena = cache.arena
    _late_copies(cache)
    assert cache.evict_one()  # the copy to the host is queued behind the sleep
    other = arena.allocate()  # takes the freed pages, overwritten on the compute stream
    arena.grow(other, N)
    arena.kv[other, :N] = 0
    store = cache.offload
    assert store is not None
    store.drain()
    arena.free(other)
    assert cache.restore("s")
    hit = cache.acquire(tokens, 2 * N, claim=("s",))
    assert hit is not None and torch.equal(arena.kv[hit.slot, :N], kv)
    cache.release(hit.slot, [], 0)


def test_write_behind_copy_is_bit_equal(cache: PrefixCache) -> None:
    arena = cache.arena
    hog = arena.allocate()
    arena.grow(hog, 2400)  # 66 pages; the session's 42 leave 12 free: its eviction is near
    tokens = list(range(1, 1501))
    kv = _paused(cache, tokens)
    assert cache.shadowed_total == 1
    assert cache.evict_one() and cache.shadow_hits == 1
    arena.free(hog)
    assert cache.restore("s")
    hit = cache.acquire(tokens, 4000, claim=("s",))
    assert hit is not None and torch.equal(arena.kv[hit.slot, :1500], kv)
    cache.release(hit.slot, [], 0)
