"""Inputs of the fused RoPE + KV-write kernel (`edmm.kernels.rope_store_kv`) for its tests: the
q, k, v views of one projection output and the rotary tables."""

from __future__ import annotations

import torch


def fused_qkv(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Strided q [t, hq, d], k and v [t, hkv, d] views of one fused projection output
    [t, (hq + 2 hkv) d] of random values, as the model has them."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def rope_tables(positions: list[int], d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The cos and sin tables [T, d] of RoPE (base 10000, halves repeated) at ``positions``,
    computed in float64 and cast to ``dtype``."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.tensor(positions, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)  # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)
