"""Prefill attention: new query tokens attending causally over a slot's KV in the arena.

The queries are the last ``query_len`` of the ``context_len`` tokens (their KV already written):
query i sees keys < context_len - query_len + i + 1. A Triton flash-attention forward (KV tiles,
online softmax, GQA) reads the strided cache in place and never touches a token at or past
the context length; on Hopper, `PrefillConfig.warp_specialize` takes its warp-specialized
form (TMA producer, two consumer warpgroups) where `warp_specialize_usable` allows.
"""

from __future__ import annotations

import functools
import math

import torch

from edmm.kernels._common import (
    KernelInputError,
    PrefillConfig,
    cdiv,
    check_index,
    dot_precision,
    hopper_or_interpreted,
    kv_layer_view,
    require_triton,
    unit_last_stride,
)


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_id: int,
    context_len: int,
    query_len: int,
    scale: float,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """End-aligned causal attention of one sequence's new tokens.

    Args:
        q: [query_len, Hq, D] fp16/bf16/fp32, unit stride on D.
        kv_cache: [slots, max_tokens, layers, 2, Hkv, D]; tokens < context_len of ``slot_id``
            are read, nothing else.
        layer, slot_id: where the KV lives.
        context_len: tokens in the slot including the new ones; 1 <= query_len <= context_len.
        query_len: new tokens (== q.shape[0]).
        scale: softmax scale.
        config: launch parameters; default `PrefillConfig()`.

    Returns:
        [query_len, Hq, D] in q's dtype.
    """
    require_triton(q.device)
    _check_q(q)
    if q.shape[0] != query_len:
        raise KernelInputError(f"q has {q.shape[0]} tokens, query_len is {query_len}")
    if not 0 <= slot_id < kv_cache.shape[0]:
        raise KernelInputError(f"slot_id {slot_id} out of range [0, {kv_cache.shape[0]})")
    if not 1 <= query_len <= context_len <= kv_cache.shape[1]:
        raise KernelInputError(f"need 1 <= query_len ({query_len}) <= context_len "
                               f"({context_len}) <= max_tokens ({kv_cache.shape[1]})")
    q = unit_last_stride(q)
    kv = kv_layer_view(kv_cache, layer, q)  # [S, M, 2, Hkv, D]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [Lq, Hq, D]
    cfg = config or PrefillConfig()
    plain = _plain_config(cfg, q, kv)
    if plain is None:
        ids = torch.tensor([0, query_len, slot_id, context_len], dtype=torch.int32)
        ids = ids.to(q.device)
        _launch_ws(q, kv, out, (ids[:2], ids[2:3], ids[3:]), scale, cfg, skip_single=False)
        return out
    cfg = plain
    _launch(q, kv, out, None, (slot_id, context_len, query_len), cdiv(query_len, cfg.block_m), 1,
            scale, cfg)
    return out


def prefill_attention_varlen(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    cu_seqlens_q: torch.Tensor,
    slot_ids: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    config: PrefillConfig | None = None,
    skip_single: bool = False,
) -> torch.Tensor:
    """`prefill_attention` for a batch of B sequences whose queries are packed in q.

    Args:
        q: [T, Hq, D]; sequence b owns rows cu_seqlens_q[b] : cu_seqlens_q[b + 1].
        cu_seqlens_q: [B + 1] int32/int64, cumulative query counts starting at 0.
        slot_ids, context_lens: [B] int32/int64.

    Each query_len must be <= its context_len; a sequence may have no queries (a CUDA graph's
    padding). With ``skip_single``, sequences of exactly one query are skipped, their rows of
    the output left unwritten for `decode_attention_varlen` (split-K suits them: one query
    tile walking a long context alone would serialise on one program per head). The launch
    depends on T and B only (``T * rows per query // block_m + B`` tiles), so it is
    capturable once per shape. Values on the device are not checked (that would sync); the
    contracts above are the caller's. Returns [T, Hq, D] in q's dtype.
    """
    require_triton(q.device)
    _check_q(q)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
        raise KernelInputError(f"cu_seqlens_q must be [B + 1], got {tuple(cu_seqlens_q.shape)}")
    batch = cu_seqlens_q.shape[0] - 1
    check_index(cu_seqlens_q, "cu_seqlens_q", batch + 1, q.device)
    check_index(slot_ids, "slot_ids", batch, q.device)
    check_index(context_lens, "context_lens", batch, q.device)
    q = unit_last_stride(q)
    kv = kv_layer_view(kv_cache, layer, q)  # [S, M, 2, Hkv, D]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [T, Hq, D]
    if batch == 0 or q.shape[0] == 0:
        return out
    cfg = config or PrefillConfig()
    plain = _plain_config(cfg, q, kv)
    if plain is None:
        _launch_ws(q, kv, out, (cu_seqlens_q, slot_ids, context_lens), scale, cfg, skip_single)
        return out
    cfg = plain
    tiles = q.shape[0] // cfg.block_m + batch
    _launch(q, kv, out, (cu_seqlens_q, slot_ids, context_lens), (0, 0, 0), tiles, batch,
            scale, cfg, skip_single)
    return out


def _check_q(q: torch.Tensor) -> None:
    if q.dim() != 3:
        raise KernelInputError(f"q must be [tokens, Hq, D], got {tuple(q.shape)}")


def _launch(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
            varlen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
            single: tuple[int, int, int], tiles: int, batch: int, scale: float,
            cfg: PrefillConfig, skip_single: bool = False) -> None:
    """Launch `prefill_kernel` over (row tiles, Hq); ``varlen`` tensors or the ``single``
    sequence's ints."""
    from edmm.kernels import _triton_prefill as tk

    num_heads, head_dim = q.shape[1], q.shape[2]
    cu_q, slot_ids, ctx_lens = varlen if varlen is not None else (out, out, out)  # unused
    tk.prefill_kernel[(tiles, num_heads)](
        q, kv, out, cu_q, slot_ids, ctx_lens,
        *single, batch, batch.bit_length(),
        scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        out.stride(0), out.stride(1),
        GROUP=num_heads // kv.shape[3], HEAD_DIM=head_dim, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, VARLEN=varlen is not None, SKIP_SINGLE=skip_single,
        DOT_PRECISION=dot_precision(q.dtype), REVERSE=cfg.reverse,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _plain_config(cfg: PrefillConfig, q: torch.Tensor, kv: torch.Tensor
                  ) -> PrefillConfig | None:
    """The plain kernel's launch parameters for this call, or None when the warp-specialized
    kernel takes it (a warp-specialized config where that kernel cannot run falls back to
    `PrefillConfig()`: its own launch parameters are the warp-specialized kernel's)."""
    if not cfg.warp_specialize:
        return cfg
    return None if warp_specialize_usable(q, kv) else PrefillConfig()


def warp_specialize_usable(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the warp-specialized kernel runs here: a Hopper GPU (or the interpreter), a
    16-bit dtype, and q / KV addresses and strides the copy engine takes (16-byte aligned)."""
    if not hopper_or_interpreted(q.device):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or q.stride(1) != q.shape[2]:
        return False
    elem = q.element_size()
    addresses = (q.data_ptr(), kv.data_ptr())
    strides = (q.stride(0), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3))
    return all(a % 16 == 0 for a in addresses) and all(s * elem % 16 == 0 for s in strides)


def _launch_ws(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
               varlen: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float,
               cfg: PrefillConfig, skip_single: bool) -> None:
    """Launch the warp-specialized kernel over (row tiles, Hq); it makes its descriptors on
    the device, in scratch from `_descriptor_scratch`."""
    import triton

    from edmm.kernels import _triton_prefill as tk

    cu_q, slot_ids, ctx_lens = varlen
    batch = cu_q.shape[0] - 1
    num_heads, head_dim = q.shape[1], q.shape[2]
    triton.set_allocator(functools.partial(_descriptor_scratch, device=q.device))
    tk.prefill_ws_kernel[(q.shape[0] // cfg.block_m + batch, num_heads)](
        q, kv, out, cu_q, slot_ids, ctx_lens, batch, batch.bit_length(), q.shape[0],
        scale * math.log2(math.e),
        q.stride(0),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        out.stride(0), out.stride(1),
        GROUP=num_heads // kv.shape[3], HEAD_DIM=head_dim, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, SKIP_SINGLE=skip_single, REVERSE=cfg.reverse,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _descriptor_scratch(size: int, alignment: int, stream: int | None,
                        device: torch.device) -> torch.Tensor:
    """Global memory on ``device`` for the descriptors a kernel makes there (triton's
    allocator protocol; the caching allocator's blocks are 512-byte aligned)."""
    return torch.empty(size, dtype=torch.int8, device=device)
