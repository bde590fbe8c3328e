"""Helpers of the prefix-cache tests: a tiny KV spec and slots whose KV spells their tokens."""

from __future__ import annotations

import torch

from edmm.memory import KVArena, KVSpec

# 1 layer x {K, V} x 1 head x 64 dims x 4 B = 512 B per token: 8 tokens per 4 KiB page.
SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float32)


def filled(arena: KVArena, tokens: list[int]) -> int:
    """A slot whose KV of token i holds the value tokens[i]."""
    slot = arena.allocate()
    arena.grow(slot, len(tokens))
    arena.kv[slot, :len(tokens)] = torch.tensor(tokens, dtype=torch.float32).view(-1, 1, 1, 1, 1)
    return slot


def kv_values(arena: KVArena, slot: int) -> list[int]:
    n = arena.num_tokens(slot)
    return [int(v) for v in arena.kv[slot, :n, 0, 0, 0, 0].tolist()]
