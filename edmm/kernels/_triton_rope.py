"""Triton kernel: rotary embedding of q and k fused with the KV-cache write.

Imported only when a kernel runs: this module imports triton at the top.

Grid: (tokens,). A program rotates one token's query heads into the output and its key heads
into the cache (HF's rotate-half convention: (x1, x2) -> (x1 cos1 - x2 sin1, x2 cos2 + x1 sin2)
over the two halves of the head dim, in float32, rounded once), and copies its value heads into
the cache, at the token's (slot, index). One launch replaces the rotary kernels, the stack of k
and v and the scatter into the cache.

FP8: the cache stores scaled e4m3 (`edmm.model.kv_quant`): each KV head's k and v are divided
by the layer's K and V scale of that head, clamped to +-448 and rounded (nearest even), so the
stored bytes are `quantize_fp8`'s.

TRIGGER (Hopper and later; not in the interpreter): each program first lets a kernel launched
after it with programmatic dependent launch (the split-K decode kernel) start, so that
kernel's programs are resident and waiting (``gdc_wait``, until this kernel has completed) by
the time it ends.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

FP8_MAX = tl.constexpr(448.0)  # the largest finite e4m3 value


@triton.jit
def _to_store(x, scale, FP8: tl.constexpr, dtype: tl.constexpr):
    """float32 rows ``x`` [H_PAD, n] as stored values of ``dtype``: with FP8 divided by each
    row's ``scale`` [H_PAD] and clamped to the e4m3 range first."""
    if FP8:
        x = x / scale[:, None]
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return x.to(dtype)


@triton.jit
def _rotate(x_ptr, stride_h, heads, c1, c2, s1, s2, out_ptr, stride_oh, scale,
            H_PAD: tl.constexpr, HALF: tl.constexpr, FP8: tl.constexpr):
    """Rotate ``heads`` rows of [*, 2 * HALF] at x_ptr into out_ptr (row strides given); with
    FP8, each row scaled by ``scale`` [H_PAD] on the way out (see `_to_store`)."""
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < heads)[:, None]
    rows = offs_h[:, None]
    x1 = tl.load(x_ptr + rows * stride_h + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + rows * stride_h + HALF + offs_d[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows * stride_oh + offs_d[None, :], _to_store(o1, scale, FP8, dtype),
             mask=mask)
    tl.store(out_ptr + rows * stride_oh + HALF + offs_d[None, :],
             _to_store(o2, scale, FP8, dtype), mask=mask)


@triton.jit
def rope_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, kv_ptr, slot_index_ptr, token_index_ptr,
    kv_scale_ptr,  # FP8: float32 [2, Hkv], the layer's K then V scales
    num_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,  # q/k/v [T, H, D]
    stride_ct, stride_st,  # cos/sin [T, D]
    stride_ot, stride_oh,  # q_out [T, Hq, D]
    stride_ks, stride_kk, stride_kkv, stride_khh,  # kv layer view [S, M, 2, Hkv, D]
    HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF: tl.constexpr, TRIGGER: tl.constexpr,
    FP8: tl.constexpr,
):
    """One token: q rotated into q_out; k rotated and v copied (with FP8: scaled) into the
    cache."""
    if TRIGGER:
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    c1 = tl.load(cos_ptr + t * stride_ct + offs_d).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs_d).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + offs_d).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + offs_d).to(tl.float32)
    ones = tl.full([HQ_PAD], 1.0, tl.float32)  # q is never scaled
    _rotate(q_ptr + t * stride_qt, stride_qh, num_heads, c1, c2, s1, s2,
            q_out_ptr + t * stride_ot, stride_oh, ones, HQ_PAD, HALF, False)
    slot = tl.load(slot_index_ptr + t).to(tl.int64)
    tok = tl.load(token_index_ptr + t).to(tl.int64)
    k_dst = kv_ptr + slot * stride_ks + tok * stride_kk
    offs_h = tl.arange(0, HKV_PAD)
    h_mask = offs_h < num_kv_heads
    k_scale = tl.full([HKV_PAD], 1.0, tl.float32)
    v_scale = k_scale
    if FP8:
        k_scale = tl.load(kv_scale_ptr + offs_h, mask=h_mask, other=1.0)
        v_scale = tl.load(kv_scale_ptr + num_kv_heads + offs_h, mask=h_mask, other=1.0)
    _rotate(k_ptr + t * stride_kt, stride_kh, num_kv_heads, c1, c2, s1, s2,
            k_dst, stride_khh, k_scale, HKV_PAD, HALF, FP8)
    mask = h_mask[:, None]
    full = tl.arange(0, 2 * HALF)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + full[None, :], mask=mask)
    v = _to_store(v.to(tl.float32), v_scale, FP8, kv_ptr.dtype.element_ty)
    tl.store(k_dst + stride_kkv + offs_h[:, None] * stride_khh + full[None, :], v, mask=mask)
