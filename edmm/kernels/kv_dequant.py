"""The dequantising route's first half: a scaled FP8 KV cache's layer, for the tokens of some
sequences, written once as 16-bit values into a dense scratch that the 16-bit prefill kernel
then reads (`benchmarks.kernels.attention --fp8-prefill-sweep`, ``dequant-fused+bf16``).

On an H100 (2026-12-07) converting each e4m3 tile inside the prefill kernel cost 1.8x the
BF16 prefill at 16K, and torch's two-pass dequantisation into a scratch 1.42x (512 queries)
and 1.13x (a chunked 16K prefill): this kernel is that route in one pass over memory.
"""

from __future__ import annotations

import torch

from edmm.kernels._common import (
    FP8_KV_DTYPE,
    KernelInputError,
    cdiv,
    check_index,
    kv_scale_arg,
    require_triton,
)

BLOCK_T = 16  # tokens per program (a Qwen2.5-7B layer row is 1,024 values)


def dequantize_kv_varlen(kv_cache: torch.Tensor, layer: int, slot_ids: torch.Tensor,
                         ctx_lens: torch.Tensor, cu_ctx: torch.Tensor, kv_scale: torch.Tensor,
                         out: torch.Tensor, max_ctx: int) -> torch.Tensor:
    """Sequence b's first ``ctx_lens[b]`` tokens of slot ``slot_ids[b]``, layer ``layer``,
    into ``out[cu_ctx[b] : cu_ctx[b] + ctx_lens[b]]``; returns ``out``.

    kv_cache: FP8 [slots, max_tokens, layers, 2, Hkv, D], each token's layer row contiguous.
    kv_scale: float32 [2, Hkv], the layer's (stored value x scale = the model's value).
    slot_ids, ctx_lens: [B]; cu_ctx: [B + 1], int32 or int64, on the cache's device.
    out: [N, 2, Hkv, D] in float16, bfloat16 or float32, rows contiguous; untouched past
    each sequence's tokens. max_ctx: an upper bound of ``ctx_lens`` (the launch's size: a
    CUDA graph captures it, the contexts may change between replays).
    """
    require_triton(kv_cache.device)
    _check(kv_cache, layer, kv_scale, out)
    batch = slot_ids.shape[0]
    for name, t, n in (("slot_ids", slot_ids, batch), ("ctx_lens", ctx_lens, batch),
                       ("cu_ctx", cu_ctx, batch + 1)):
        check_index(t, name, n, kv_cache.device)
    if batch == 0 or max_ctx <= 0:
        return out
    from edmm.kernels import _triton_dequant as tk

    row = kv_cache.shape[3] * kv_cache.shape[4] * kv_cache.shape[5]
    tk.dequant_kv_kernel[(batch, cdiv(max_ctx, BLOCK_T))](
        kv_cache, kv_scale, slot_ids, ctx_lens, cu_ctx, out,
        kv_cache.stride(0), kv_cache.stride(1), layer * kv_cache.stride(2), out.stride(0),
        ROW=row, ROW_PAD=1 << (row - 1).bit_length(), HEAD_DIM=kv_cache.shape[5],
        BLOCK_T=BLOCK_T, num_warps=4)
    return out


def _check(kv: torch.Tensor, layer: int, kv_scale: torch.Tensor, out: torch.Tensor) -> None:
    if kv.dim() != 6 or kv.shape[3] != 2 or kv.dtype != FP8_KV_DTYPE:
        raise KernelInputError(f"kv_cache must be {FP8_KV_DTYPE} [slots, max_tokens, layers, 2, "
                               f"kv_heads, head_dim], got {kv.dtype} {tuple(kv.shape)}")
    heads, dim = kv.shape[4], kv.shape[5]
    if kv.stride(5) != 1 or kv.stride(4) != dim or kv.stride(3) != heads * dim:
        raise KernelInputError(f"kv_cache's layer rows must be contiguous, got {kv.stride()}")
    if not 0 <= layer < kv.shape[2]:
        raise KernelInputError(f"layer {layer} out of range [0, {kv.shape[2]})")
    kv_scale_arg(kv[:, :, layer], kv_scale)  # the attention kernels' check of the scales
    if (out.dim() != 4 or tuple(out.shape[1:]) != (2, heads, dim)
            or out.stride()[1:] != (heads * dim, dim, 1)
            or out.dtype not in (torch.float16, torch.bfloat16, torch.float32)
            or out.device != kv.device):
        raise KernelInputError(f"out must be 16- or 32-bit float [N, 2, {heads}, {dim}] with "
                               f"contiguous rows on {kv.device}, got {out.dtype} "
                               f"{tuple(out.shape)}")
