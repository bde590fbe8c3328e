"""Decode attention (one new query token per sequence) over the strided KV arena.

Flash-decoding: the context of each sequence is split into ``num_splits`` chunks processed by
separate programs, so a single long sequence still fills the GPU; a second small kernel merges
the chunks (over head-dim slices too with ``DecodeConfig(sliced_reduce=True)``), or
(``DecodeConfig(fused=True)``) the split kernel merges them itself, through a
`CounterWorkspace` of counters. The launch shape depends only on static arguments
(``num_splits``, or the ``max_context`` it is derived from), never on tensor values: no host
sync, capturable in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from edmm.kernels._common import (
    FP8_KV_DTYPE,
    CounterWorkspace,
    DecodeConfig,
    KernelInputError,
    cdiv,
    check_index,
    decode_tma_usable,
    dot_precision,
    kv_layer_view,
    kv_scale_arg,
    next_pow2,
    pdl_usable,
    require_triton,
    unit_last_stride,
)
from edmm.kernels._cuda_decode import cuda_decode_usable
from edmm.kernels._cuda_decode import launch_split as launch_cuda_split

MIN_SPLIT_TOKENS = 256  # fewer tokens per split: more merge traffic than parallelism gained
DEFAULT_MAX_SPLITS = 128
MAX_SPLITS = 256  # the merge kernel holds one head's splits in registers
MAX_FUSED_SPLITS = 1024  # the fused merge walks the splits in chunks
MERGE_VALUES_PER_THREAD = 32  # fp32 partial values one thread loads per fused-merge step
MERGE_LSE_SPLITS = 256  # log-sum-exps per step of the fused merge's first pass
REDUCE_SLICE_BYTES = 8192  # fp32 partials one sliced-reduce program merges (about)
PROGRAMS_PER_SM = 2
VARLEN_DECODES = 4  # single-query sequences a mixed batch is assumed to hold (split count)
DEFAULT_SMS = 132  # H200; used when the device has no SM count (CPU interpreter)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch: int, num_kv_heads: int, max_context: int,
                       device: torch.device | str = "cuda") -> int:
    """Splits that give ~2 programs per SM, at least `MIN_SPLIT_TOKENS` tokens each.

    Depends only on static sizes, so a CUDA graph captured with it stays valid for any
    context up to ``max_context``.
    """
    want = cdiv(PROGRAMS_PER_SM * _num_sms(torch.device(device)), batch * num_kv_heads)
    cap = cdiv(max_context, MIN_SPLIT_TOKENS)
    return max(1, min(want, cap, DEFAULT_MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_ids: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_context: int | None = None,
    config: DecodeConfig | None = None,
    workspace: CounterWorkspace | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its slot's first ``context_lens`` tokens.

    Args:
        q: [B, Hq, D] fp16/bf16/fp32, unit stride on D.
        kv_cache: [slots, max_tokens, layers, 2, Hkv, D], any strides with unit stride on D;
            only tokens < context_len of the slots in ``slot_ids`` are read. fp16/bf16/fp32,
            or scaled FP8 (float8_e4m3fn, with ``kv_scale``).
        layer: layer index into ``kv_cache``.
        slot_ids: [B] int32/int64 on q's device.
        context_lens: [B] int32/int64 on q's device, each in [0, max_tokens] (0 gives zeros).
        scale: softmax scale (usually D ** -0.5).
        num_splits: chunks per sequence; default `default_num_splits` of ``max_context``.
            Each sequence's chunk size follows its own length (a multiple of the tile), so any
            length is computed in full; the split count only sets the parallelism.
        max_context: the largest context this call (or graph) is meant to serve, for the
            default split count; default max_tokens.
        config: launch parameters; default `DecodeConfig()`.
        workspace: the counters of a fused launch (``config.fused``); default a fresh
            zeroed one per call (one more small launch: callers that launch often, or
            capture graphs, keep one `CounterWorkspace`).
        kv_scale: an FP8 cache's float32 [2, Hkv] K and V scales of ``layer`` (stored values
            times these are the model's K and V); ignored for other caches.

    Returns:
        [B, Hq, D] in q's dtype.
    """
    require_triton(q.device)
    if q.dim() != 3:
        raise KernelInputError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    q = unit_last_stride(q)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [B, Hq, D]
    return _decode(q, kv_cache, layer, None, slot_ids, context_lens, out, scale, num_splits,
                   max_context, config, workspace, kv_scale, split_batch=q.shape[0])


def decode_attention_varlen(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    cu_seqlens_q: torch.Tensor,
    slot_ids: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_context: int | None = None,
    config: DecodeConfig | None = None,
    workspace: CounterWorkspace | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_attention` for the sequences with exactly one query of a packed batch, in place.

    A mixed batch (prefill chunks beside decodes) runs its single-query sequences here, split-K
    over their context, and the others through `prefill_attention_varlen`, which skips them.

    Args:
        q: [T, Hq, D]; sequence b owns rows cu_seqlens_q[b] : cu_seqlens_q[b + 1].
        cu_seqlens_q: [B + 1]; slot_ids, context_lens: [B] (int32/int64, q's device).
        out: [T, Hq, D] in q's dtype, unit stride on D: row cu_seqlens_q[b] of each
            single-query sequence b is written, no other row.
        num_splits, max_context, config, workspace, kv_scale: as in `decode_attention` (the
            default split count assumes a few of the B sequences are single-query).

    Returns ``out``. The launch depends on B and the static arguments only (capturable).
    """
    require_triton(q.device)
    if q.dim() != 3 or out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise KernelInputError(f"q and out must be [T, Hq, D] alike with unit stride on D, got "
                               f"{tuple(q.shape)} {q.dtype} and {tuple(out.shape)} {out.dtype}")
    batch = slot_ids.shape[0]
    check_index(cu_seqlens_q, "cu_seqlens_q", batch + 1, q.device)
    return _decode(unit_last_stride(q), kv_cache, layer, cu_seqlens_q, slot_ids, context_lens,
                   out, scale, num_splits, max_context, config, workspace, kv_scale,
                   split_batch=min(batch, VARLEN_DECODES))


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, cu_q: torch.Tensor | None,
            slot_ids: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor, scale: float,
            num_splits: int | None, max_context: int | None, config: DecodeConfig | None,
            workspace: CounterWorkspace | None, kv_scale: torch.Tensor | None,
            split_batch: int) -> torch.Tensor:
    """Checks, split count (by default for ``split_batch`` active sequences), partial
    buffers and the launches of both entry points."""
    kv = kv_layer_view(kv_cache, layer, q)  # [S, M, 2, Hkv, D]
    scale_arg = kv_scale_arg(kv, kv_scale)  # [2, Hkv] float32, or a placeholder
    batch = slot_ids.shape[0] if cu_q is not None else q.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv.shape[3]
    check_index(slot_ids, "slot_ids", batch, q.device)
    check_index(context_lens, "context_lens", batch, q.device)
    if num_splits is None:
        num_splits = default_num_splits(split_batch, num_kv_heads, max_context or kv.shape[1],
                                        q.device)
    cfg = config or DecodeConfig()
    if cfg.cuda and cuda_decode_usable(q, kv) is not None:  # the Triton kernel of that tile
        # (the CUDA kernel reads 16-bit KV of q's dtype only: FP8 caches come here too)
        cfg = replace(cfg, cuda=False, cluster=False)
    limit = MAX_FUSED_SPLITS if cfg.fused else MAX_SPLITS
    if not 1 <= num_splits <= limit:
        raise KernelInputError(f"num_splits must be in [1, {limit}], got {num_splits}")
    if batch == 0:
        return out
    merged = cfg.cluster and num_splits > 1  # the split kernel's clusters merge themselves
    part_o, part_lse = _partials(batch, num_heads, 1 if merged else num_splits, head_dim,
                                 q.device)
    fused = cfg.fused and num_splits > 1
    counters = ((workspace or CounterWorkspace()).counters(batch * num_kv_heads, q.device)
                if fused else part_lse)  # [>= B * Hkv] int32; unused unless fused
    pdl = cfg.pdl and pdl_usable(q.device)
    prefetch = cfg.prefetch and pdl_usable(q.device)
    _launch_split(q, kv, slot_ids, context_lens, out, part_o, part_lse, cu_q, counters, scale,
                  num_splits, cfg, fused, pdl, prefetch, kv_scale=scale_arg)
    if num_splits > 1 and not fused and not merged:
        _launch_reduce(part_o, part_lse, out, cu_q, pdl, cfg.early_launch,
                       sliced=cfg.sliced_reduce)
    return out


def _partials(batch: int, num_heads: int, num_splits: int, head_dim: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 buffers of the split outputs [B, Hq, S, D] and log-sum-exps [B, Hq, S]."""
    if num_splits == 1:  # the split kernel writes `out` directly; placeholders only
        empty = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=device)
        return empty, empty[..., 0]
    part_o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                         device=device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device)
    return part_o, part_lse


def _launch_split(q: torch.Tensor, kv: torch.Tensor, slot_ids: torch.Tensor,
                  context_lens: torch.Tensor, out: torch.Tensor, part_o: torch.Tensor,
                  part_lse: torch.Tensor, cu_q: torch.Tensor | None, counters: torch.Tensor,
                  scale: float, num_splits: int, cfg: DecodeConfig, fused: bool,
                  pdl: bool, prefetch: bool, kv_scale: torch.Tensor | None = None) -> None:
    """Launch the split kernel over (B, Hkv, num_splits): Triton's, or with ``cfg.cuda``
    the CUDA C++ one (grid (num_splits, Hkv, B), the same partials). ``kv_scale``: an FP8
    cache's checked scales (`kv_scale_arg`)."""
    if cfg.cuda:
        launch_cuda_split(q, kv, slot_ids, context_lens, out, part_o, part_lse, cu_q,
                          scale * math.log2(math.e), num_splits, cfg.num_warps,
                          cfg.num_stages, pdl, cfg.cluster)
        return
    from edmm.kernels import _triton_decode as tk

    head_dim = q.shape[2]
    num_kv_heads = kv.shape[3]
    group = q.shape[1] // num_kv_heads
    merge_g = next_pow2(group)
    merge_s = lse_s = 1  # unused without the fused merge: no recompile per split count
    if fused:
        merge_s = max(1, min(next_pow2(num_splits), MERGE_VALUES_PER_THREAD * 32 * cfg.num_warps
                             // (merge_g * head_dim)))
        lse_s = min(next_pow2(num_splits), MERGE_LSE_SPLITS)
    grid = (slot_ids.shape[0], num_kv_heads, num_splits)
    tma = cfg.tma and decode_tma_usable(kv)
    tk.decode_split_kernel[grid](
        q, kv, slot_ids, context_lens, out, part_o, part_lse,
        cu_q if cu_q is not None else slot_ids,  # unused without VARLEN
        _kv_descriptor(kv, cfg.block_n) if tma else kv,  # unused without TMA
        counters, kv if kv_scale is None else kv_scale, num_splits,  # scales unused unless FP8
        scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        out.stride(0), out.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_N=cfg.block_n, SINGLE_SPLIT=num_splits == 1, DOT_PRECISION=dot_precision(q.dtype),
        VARLEN=cu_q is not None, FUSED=fused, MERGE_G=merge_g, MERGE_S=merge_s, LSE_S=lse_s,
        PDL=pdl, EARLY=cfg.early_launch, PREFETCH=prefetch,
        PREFETCH_TOKENS=cfg.prefetch_tiles * cfg.block_n,
        ELEM_BYTES=kv.element_size(), BALANCED=cfg.balanced, TMA=tma,
        FP8=kv.dtype == FP8_KV_DTYPE,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_pdl_launch(pdl),
    )


def _kv_descriptor(kv: torch.Tensor, block_n: int) -> object:
    """Host tensor descriptor of the layer view ``kv`` [S, M, 2, Hkv, D] as token rows
    [S, M, 2 * Hkv * D] (see `decode_tma_usable`), box [1, block_n, D]: one head's K or V tile."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    slots, tokens, two, heads, dim = kv.shape
    return TensorDescriptor(kv, [slots, tokens, two * heads * dim], [kv.stride(0), kv.stride(1), 1],
                            [1, block_n, dim])


def _pdl_launch(pdl: bool) -> dict[str, bool]:
    """Triton's launch option of programmatic dependent launch (only passed when on)."""
    return {"launch_pdl": True} if pdl else {}


def _launch_reduce(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                   cu_q: torch.Tensor | None, pdl: bool, early: bool,
                   sliced: bool = False) -> None:
    """Launch the merge kernel over (B, Hq, head-dim slices): one slice, or with ``sliced``
    as many as keep each program's partials near `REDUCE_SLICE_BYTES`."""
    from edmm.kernels import _triton_decode as tk

    batch, num_heads, num_splits, head_dim = part_o.shape
    splits_pad = next_pow2(num_splits)
    slices = 1
    if sliced:
        slices = max(1, min(head_dim // 16, splits_pad * head_dim * 4 // REDUCE_SLICE_BYTES))
    block_d = head_dim // slices
    warps = (splits_pad * block_d // 512) if sliced else (splits_pad * head_dim // 2048)
    tk.decode_reduce_kernel[(batch, num_heads, slices)](
        part_o, part_lse, out, cu_q if cu_q is not None else part_lse,  # unused without VARLEN
        num_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        SPLITS_PAD=splits_pad, BLOCK_D=block_d, VARLEN=cu_q is not None, PDL=pdl, EARLY=early,
        num_warps=min(16, max(1, warps)),  # ~64 fp32 per thread (sliced: ~16)
        **_pdl_launch(pdl),
    )
