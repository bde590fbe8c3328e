"""SDPA references of the kernels: per-sequence strided views of the arena, no triton.

Slower than the kernels and they read context lengths on the host; used by tests (in float64)
and as the baseline of ``benchmarks.kernels.attention``. An FP8 cache's values are multiplied
by the layer's ``kv_scale`` [2, Hkv] (K scales, V scales) in the reference's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def slot_kv(kv_cache: torch.Tensor, layer: int, slot: int,
            num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-copy K and V of a slot's first ``num_tokens`` tokens, each [Hkv, n, D]."""
    kv = kv_cache[slot, :num_tokens, layer]  # [n, 2, Hkv, D]
    return kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)


def _values(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype,
            kv_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [Hkv, n, D] in ``dtype``, times ``kv_scale`` [2, Hkv] when given."""
    k, v = k.to(dtype), v.to(dtype)
    if kv_scale is None:
        return k, v
    scale = kv_scale.to(dtype)
    return k * scale[0][:, None, None], v * scale[1][:, None, None]


def end_aligned_causal_mask(query_len: int, context_len: int,
                            device: torch.device | str = "cpu") -> torch.Tensor:
    """[query_len, context_len] bool: query i sees keys < context_len - query_len + i + 1."""
    i = torch.arange(query_len, device=device)[:, None]
    j = torch.arange(context_len, device=device)[None, :]
    return j < context_len - query_len + i + 1


def decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_ids: Sequence[int],
    context_lens: Sequence[int],
    scale: float,
    dtype: torch.dtype | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, Hq, D] attention of q [B, Hq, D] over each slot's tokens, computed in ``dtype``.

    An empty context gives zeros (as the kernel does).
    """
    dtype = dtype or q.dtype
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    for b, (slot, n) in enumerate(zip(slot_ids, context_lens, strict=True)):
        if n == 0:
            continue
        k, v = _values(*slot_kv(kv_cache, layer, slot, n), dtype, kv_scale)  # [Hkv, n, D]
        qb = q[b, :, None].to(dtype)  # [Hq, 1, D]
        out[b] = F.scaled_dot_product_attention(
            qb, k, v, scale=scale, enable_gqa=True)[:, 0]
    return out


def prefill_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_id: int,
    context_len: int,
    scale: float,
    dtype: torch.dtype | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """[Lq, Hq, D] end-aligned causal attention of q [Lq, Hq, D] over a slot's first tokens."""
    dtype = dtype or q.dtype
    k, v = _values(*slot_kv(kv_cache, layer, slot_id, context_len), dtype,
                   kv_scale)  # [Hkv, n, D]
    mask = end_aligned_causal_mask(q.shape[0], context_len, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).to(dtype), k, v, attn_mask=mask, scale=scale,
        enable_gqa=True)  # [Hq, Lq, D]
    return out.transpose(0, 1)
