"""Helpers of the prefix-cache tests: a tiny KV spec and slots whose KV spells their tokens."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from edmm.memory import KVArena, KVSpec, PagePool, open_backend

# 1 layer x {K, V} x 1 head x 64 dims x 4 B = 512 B per token: 8 tokens per 4 KiB page.
SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float32)


@contextmanager
def host_arena(num_pages: int, num_slots: int = 4, max_tokens: int = 64) -> Iterator[KVArena]:
    """An arena of `SPEC` on the host twin (4 KiB pages); integrity-checked and closed after."""
    backend = open_backend("host", host_page_size=4096)
    pool = PagePool(backend, num_pages)
    arena = KVArena(pool, SPEC, num_slots=num_slots, max_tokens=max_tokens)
    try:
        yield arena
        arena.check_integrity()
    finally:
        arena.close()
        pool.close()
        backend.close()


def filled(arena: KVArena, tokens: list[int]) -> int:
    """A slot whose KV of token i holds the value tokens[i]."""
    slot = arena.allocate()
    arena.grow(slot, len(tokens))
    arena.kv[slot, :len(tokens)] = torch.tensor(tokens, dtype=torch.float32).view(-1, 1, 1, 1, 1)
    return slot


def kv_values(arena: KVArena, slot: int) -> list[int]:
    n = arena.num_tokens(slot)
    return [int(v) for v in arena.kv[slot, :n, 0, 0, 0, 0].tolist()]
