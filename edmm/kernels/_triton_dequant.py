"""Triton dequantisation of a scaled FP8 KV cache's layer into a dense 16-bit scratch.

Imported only when a kernel runs: this module imports triton at the top.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["layer_offset"])
def dequant_kv_kernel(
    kv_ptr,  # FP8 cache, one token's layer row of ROW values at a time
    scale_ptr,  # float32 [2 * Hkv]: the layer's K scales, then its V scales
    slot_ids_ptr, ctx_lens_ptr, cu_ptr,  # [B], [B], [B + 1]: where each sequence goes in out
    out_ptr,  # [N, ROW] in out's dtype
    stride_ks, stride_kt, layer_offset, stride_ot,
    ROW: tl.constexpr, ROW_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Tokens [BLOCK_T * program_id(1), +BLOCK_T) of sequence ``program_id(0)``: each value
    of the layer's row [2, Hkv, D] times its (K or V, head) scale, in float32, rounded once
    to out's dtype; tokens past the sequence's context are left alone."""
    b = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    ctx = tl.load(ctx_lens_ptr + b)
    if t0 >= ctx:
        return
    slot = tl.load(slot_ids_ptr + b).to(tl.int64)
    dst0 = tl.load(cu_ptr + b).to(tl.int64)
    t = t0 + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.arange(0, ROW_PAD)  # [ROW_PAD]
    mask = (t < ctx)[:, None] & (cols < ROW)[None, :]
    src = (kv_ptr + slot * stride_ks + layer_offset + t.to(tl.int64)[:, None] * stride_kt
           + cols[None, :])
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_T, ROW_PAD]
    scale = tl.load(scale_ptr + cols // HEAD_DIM, mask=cols < ROW, other=0.0)  # [ROW_PAD]
    dst = out_ptr + (dst0 + t.to(tl.int64))[:, None] * stride_ot + cols[None, :]
    tl.store(dst, (x * scale[None, :]).to(out_ptr.dtype.element_ty), mask=mask)
