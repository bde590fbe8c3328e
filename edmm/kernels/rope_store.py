"""Rotary embedding of q and k fused with the write of k and v into the KV arena.

A decode step otherwise spends three launches per layer here (the rotary kernel, stacking k
and v, the scatter into the cache); this is one, and it writes only the tokens' own rows of
the cache. The launch depends on the token count only (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from edmm.kernels._common import (
    FP8_KV_DTYPE,
    KernelInputError,
    check_index,
    kv_layer_view,
    kv_scale_arg,
    next_pow2,
    pdl_usable,
    require_triton,
)


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_index: torch.Tensor,
    token_index: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k (HF rotate-half RoPE), store rotated k and v in the cache.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D] (strided views of a fused qkv projection are fine:
            unit stride on D).
        cos, sin: [T, D], the token positions' rotary tables.
        kv_cache: [slots, max_tokens, layers, 2, Hkv, D]; token t's K and V go to
            ``kv_cache[slot_index[t], token_index[t], layer]``, nothing else is written.
        slot_index, token_index: [T] int32/int64 on q's device.
        kv_scale: an FP8 cache's float32 [2, Hkv] K and V scales of ``layer``: k and v are
            stored as ``clamp(x / scale, -448, 448)`` in e4m3 (`edmm.model.kv_quant`);
            ignored for other caches, which store k and v converted to their dtype.

    Returns:
        The rotated queries [T, Hq, D] (contiguous, q's dtype).
    """
    require_triton(q.device)
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise KernelInputError(f"q must be [T, Hq, D], k and v [T, Hkv, D], got "
                               f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    t, _, head_dim = q.shape
    if (k.shape[0] != t or k.shape[2] != head_dim or cos.shape != (t, head_dim)
            or sin.shape != (t, head_dim)):
        raise KernelInputError(f"k [{t}, Hkv, {head_dim}] and cos/sin [{t}, {head_dim}] "
                               f"expected, got {tuple(k.shape)}, {tuple(cos.shape)}, "
                               f"{tuple(sin.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, cos, sin)):
        raise KernelInputError("q, k, v, cos and sin need unit stride on the last dim")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise KernelInputError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    kv = kv_layer_view(kv_cache, layer, q)  # [S, M, 2, Hkv, D]
    if kv.shape[3] != k.shape[1]:
        raise KernelInputError(f"k has {k.shape[1]} heads, the cache {kv.shape[3]}")
    check_index(slot_index, "slot_index", t, q.device)
    check_index(token_index, "token_index", t, q.device)
    scale = kv_scale_arg(kv, kv_scale)  # [2, Hkv] float32, or a placeholder
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    if t == 0:
        return out
    from edmm.kernels import _triton_rope as tk

    tk.rope_store_kernel[(t,)](
        q, k, v, cos, sin, out, kv, slot_index, token_index, scale,
        q.shape[1], k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        out.stride(0), out.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        HQ_PAD=next_pow2(q.shape[1]), HKV_PAD=next_pow2(k.shape[1]), HALF=head_dim // 2,
        TRIGGER=pdl_usable(q.device), FP8=kv.dtype == FP8_KV_DTYPE, num_warps=4,
    )
    return out
