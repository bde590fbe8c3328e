"""Helpers of the tests that drive KV memory on a bare arena (the prefix index, the offload
tier, the scheduler, speculation branches): the one tiny KV spec, and slots whose KV spells
their tokens."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from edmm.engine import EngineConfig
from edmm.memory import KVArena, KVSpec, PagePool, open_backend

# 1 layer x {K, V} x 1 head x 64 dims x 4 B = 512 B per token: 8 tokens per 4 KiB page.
SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float32)
PAGE = 4096

# The tiny model: 4 layers x {K, V} x 2 kv heads x 32 dims x 4 B = 2 KiB per token; 8 per page.
TINY_HOST_PAGE = 16384
TINY_MAX_LEN = 256


@contextmanager
def host_arena(num_pages: int, num_slots: int = 4, max_tokens: int = 64,
               spec: KVSpec = SPEC) -> Iterator[KVArena]:
    """An arena of ``spec`` on the host twin (4 KiB pages); integrity-checked and closed
    after."""
    backend = open_backend("host", host_page_size=PAGE)
    pool = PagePool(backend, num_pages)
    arena = KVArena(pool, spec, num_slots=num_slots, max_tokens=max_tokens)
    try:
        yield arena
        arena.check_integrity()
    finally:
        arena.close()
        pool.close()
        backend.close()


def filled(arena: KVArena, tokens: list[int], src: int | None = None, at: int = 0) -> int:
    """A slot whose KV of token i holds the value tokens[i]; branched from ``src`` at ``at``
    (its first ``at`` tokens shared) if given."""
    slot = arena.allocate() if src is None else arena.branch(src, at)
    arena.grow(slot, len(tokens))
    values = torch.tensor(tokens[at:], dtype=torch.float32).view(-1, 1, 1, 1, 1)
    arena.kv[slot, at:len(tokens)] = values
    return slot


def kv_values(arena: KVArena, slot: int) -> list[int]:
    """The values the KV of each of the slot's tokens holds."""
    n = arena.num_tokens(slot)
    return [int(v) for v in arena.kv[slot, :n, 0, 0, 0, 0].tolist()]


def tiny_engine_config(folder: Path | str, **overrides: Any) -> EngineConfig:
    """A small float32 engine on the tiny model (16 KiB host pages)."""
    kwargs: dict[str, Any] = dict(
        model=str(folder), dtype="float32", host_page_size=TINY_HOST_PAGE,
        max_model_len=TINY_MAX_LEN, num_slots=24, max_num_seqs=8, num_pages=400,
        max_num_batched_tokens=512)
    return EngineConfig(**{**kwargs, **overrides})
