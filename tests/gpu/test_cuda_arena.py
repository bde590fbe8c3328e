"""CUDA-only checks of the arena with the real model shape (run on the device machine)."""

from __future__ import annotations

import pytest
import torch

from edmm.memory import KVArena, KVSpec, PagePool
from edmm.memory.backends import open_backend

pytestmark = pytest.mark.gpu

QWEN = KVSpec(num_layers=28, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)


def test_attention_on_arena_views_matches_contiguous_kv() -> None:
    backend = open_backend("cuda")
    pool = PagePool(backend, 64)
    arena = KVArena(pool, QWEN, num_slots=2, max_tokens=4096)
    slot = arena.allocate()
    n = 1500  # 1500 x 56 KiB: 41 pages, the last partial
    arena.grow(slot, n)
    kv = torch.randn(n, 28, 2, 4, 128, dtype=torch.bfloat16, device="cuda")
    arena.kv[slot, :n] = kv
    br = arena.branch(slot, n - 3)
    q = torch.randn(1, 28, 1, 128, dtype=torch.bfloat16, device="cuda")
    for layer in (0, 13, 27):
        k, v = arena.layer_kv(br, layer)  # [n-3, 4, 128] zero-copy
        assert k.is_cuda and k.data_ptr() == arena.slot_address(br) + layer * 2 * 4 * 128 * 2
        got = torch.nn.functional.scaled_dot_product_attention(
            q, k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], enable_gqa=True)
        ref_k = kv[: n - 3, layer, 0].permute(1, 0, 2)[None].contiguous()
        ref_v = kv[: n - 3, layer, 1].permute(1, 0, 2)[None].contiguous()
        ref = torch.nn.functional.scaled_dot_product_attention(q, ref_k, ref_v, enable_gqa=True)
        torch.testing.assert_close(got, ref)
    assert arena.slot_pages(br)[:-1] == arena.slot_pages(slot)[: len(arena.slot_pages(br)) - 1]
    arena.check_integrity()
    arena.close()
    pool.close()
    backend.close()


def test_page_size_is_the_driver_granularity() -> None:
    backend = open_backend("cuda")
    assert backend.page_size == 2 * 1024 * 1024
    backend.close()


def test_offload_round_trip_through_pinned_host_memory() -> None:
    """A slot's KV copied to pinned host memory and back into another slot, byte for byte."""
    from edmm.memory.offload import BlockSave, HostKVStore

    backend = open_backend("cuda")
    pool = PagePool(backend, 64)
    arena = KVArena(pool, QWEN, num_slots=2, max_tokens=4096)
    store = HostKVStore(arena, capacity_bytes=1 << 30)
    slot, other = arena.allocate(), arena.allocate()
    n = 1000
    arena.grow(slot, n)
    arena.grow(other, n)
    arena.kv[slot, :n] = torch.randn(n, 28, 2, 4, 128, dtype=torch.bfloat16, device="cuda")
    bt = store.block_tokens
    blocks = [BlockSave(i, start, min(bt, n - start))
              for i, start in enumerate(range(0, n, bt))]
    ticket, held = store.save(slot, blocks)
    assert ticket is not None and held == len(blocks)
    assert store.buffer.is_pinned() and not store.buffer.is_cuda
    store.load(other, [(b.key, b.start) for b in blocks], 0, n)
    assert torch.equal(arena.kv[other, :n], arena.kv[slot, :n])
    store.clear()
    arena.check_integrity()
    arena.close()
    pool.close()
    backend.close()
