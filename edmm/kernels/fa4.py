"""FlashAttention-4 (``flash-attn-4``, CuTe DSL) over the KV arena's strided views, in place.

FA4's ``flash_attn_varlen_func`` runs end-aligned causal attention (query i of n sees keys
< seqlen_k - n + i + 1) with grouped KV heads. It takes K/V either packed with ``cu_seqlens_k``
offsets or batched ``[batch, seqlen_k, Hkv, D]`` with per-batch ``seqused_k``. The arena's slot
stride is a whole number of pages, not of tokens, so no token offset reaches a slot: the call
uses the batched form with the arena's slots as FA4's batch, ``kv_cache[:, :, layer, 0]`` and
``[..., 1]`` as K and V ([slots, max_tokens, Hkv, D], no copy). The pass's sequences become
per-slot lengths (`fa4_varlen_args`): slot ``s`` of sequence b gets its query rows from
``cu_seqlens_q[s]`` = b's first row, ``seqused_q[s]`` of them, and ``seqused_k[s]`` keys;
slots outside the pass get none.

What FA4 reads that other kernels do not (from its source, 4.0.0b36): K/V tiles of
`FA4_KV_TILE` tokens are loaded whole by the copy engine, so a sequence's last tile reads up to
``FA4_KV_TILE - 1`` tokens past its context (masked, but they must be mapped and finite): the
arena of an FA4 engine maps its slots that far (`KVArena` ``read_align``). On Hopper FA4 has
no split-KV forward, so decode rows stay on the Triton split-K kernel (``seqused_q`` = 0 for
single-query sequences with ``skip_single``).

CUDA graphs: the launch grid depends on the token count and the slot count only (FA4's varlen
scheduler sizes it from ``total_q`` and the batch), lengths are read on the device, and on
Hopper ``max_seqlen_q`` / ``max_seqlen_k`` only choose host-side tile configs; the bounds given
are fixed upper bounds (the pass's tokens, the slot's max_tokens), valid for every replay.
FA4 JIT-compiles one kernel per config on its first call (seconds): graph capture's warm-up
runs make that happen at start-up.

Importing this module never imports FA4; `fa4_available` checks for it.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

from edmm.kernels._common import KernelInputError, KernelUnavailableError, kv_layer_view

FA4_MODULE = "flash_attn.cute"
FA4_KV_TILE = 128  # the most K/V tokens one FA4 forward tile loads (tile_n, head_dim <= 256)
FA4_DTYPES = (torch.float16, torch.bfloat16)
FA4_CAPABILITIES = (9, 10, 11)  # Hopper and Blackwell majors FA4's forward targets


@functools.cache
def fa4_available() -> bool:
    """Whether FA4 can be imported: ``flash_attn.cute`` is installed and its import (CuTe DSL,
    CUDA libraries) succeeds. Checked once."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        importlib.import_module(FA4_MODULE)
    except Exception:  # a broken install (missing CUDA libraries, wrong Python) is "not here"
        return False
    return True


def fa4_capable(device: torch.device | str) -> bool:
    """Whether ``device`` is a GPU FA4's forward targets (compute capability 9.x-11.x)."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] in FA4_CAPABILITIES)


def fa4_usable(device: torch.device | str) -> bool:
    """Whether FA4 runs on ``device``: a capable GPU and FA4 importable."""
    return fa4_capable(device) and fa4_available()


@dataclass(frozen=True)
class FA4VarlenArgs:
    """Per-slot lengths of one pass, FA4's batch being the arena's slots (all int32, [S] or
    [S + 1], on the pass's device)."""

    cu_seqlens_q: torch.Tensor  # [S + 1] first query row of each slot's sequence
    seqused_q: torch.Tensor  # [S] query rows FA4 computes for the slot (0: none)
    seqused_k: torch.Tensor  # [S] keys of the slot's context (0 outside the pass)


def fa4_varlen_args(query_start_loc: torch.Tensor, slot_ids: torch.Tensor,
                    context_lens: torch.Tensor, num_slots: int,
                    skip_single: bool) -> FA4VarlenArgs:
    """FA4's per-slot arguments of a pass of B sequences, built on the device (no sync, so a
    CUDA graph captures it).

    Args:
        query_start_loc: [B + 1] cumulative query counts (int32/int64), starting at 0.
        slot_ids: [B] slot of each sequence; a slot may repeat only among sequences with no
            queries (a CUDA graph's padding, all alike).
        context_lens: [B] keys of each sequence after the pass.
        num_slots: S, the arena's slots.
        skip_single: give single-query sequences no rows (the decode kernel takes them).
    """
    device = query_start_loc.device
    starts = query_start_loc.to(torch.int32)  # [B + 1]
    query_lens = starts[1:] - starts[:-1]  # [B]
    if skip_single:
        query_lens = torch.where(query_lens == 1, torch.zeros_like(query_lens), query_lens)
    slots = slot_ids.to(torch.int64)  # [B]
    cu_q = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)  # [S + 1]
    cu_q[slots] = starts[:-1]
    cu_q[num_slots] = starts[-1]
    used_q = torch.zeros(num_slots, dtype=torch.int32, device=device)  # [S]
    used_q[slots] = query_lens
    used_k = torch.zeros(num_slots, dtype=torch.int32, device=device)  # [S]
    used_k[slots] = context_lens.to(torch.int32)
    return FA4VarlenArgs(cu_q, used_q, used_k)


def fa4_varlen_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                         args: FA4VarlenArgs, scale: float) -> torch.Tensor:
    """End-aligned causal attention of a pass's queries over the arena through FA4.

    Args:
        q: [T, Hq, D] fp16/bf16, unit stride on D (rows of sequence b from its first row).
        kv_cache: [slots, max_tokens, layers, 2, Hkv, D] in q's dtype; each slot mapped (and
            finite) up to its context rounded up to `FA4_KV_TILE` tokens.
        layer: layer index into ``kv_cache``.
        args: `fa4_varlen_args` of the pass.
        scale: softmax scale.

    Returns:
        [T, Hq, D] in q's dtype; rows FA4 does not compute (``seqused_q`` 0, padding past the
        last sequence) are left unwritten.
    """
    if q.dim() != 3:
        raise KernelInputError(f"q must be [tokens, Hq, D], got {tuple(q.shape)}")
    if q.dtype not in FA4_DTYPES:
        raise KernelInputError(f"FA4 takes {FA4_DTYPES}, got {q.dtype}")
    kv = kv_layer_view(kv_cache, layer, q)  # [S, M, 2, Hkv, D]
    if kv.dtype != q.dtype:
        raise KernelInputError(f"FA4 reads K/V of q's dtype ({q.dtype}), got {kv.dtype}: an "
                               "FP8 cache attends through the Triton prefill kernel")
    if args.seqused_k.shape[0] != kv.shape[0]:
        raise KernelInputError(f"args are for {args.seqused_k.shape[0]} slots, the cache has "
                               f"{kv.shape[0]}")
    if not fa4_available():
        raise KernelUnavailableError(f"{FA4_MODULE} is not importable (pip install "
                                     "'edmm[cuda]' on a GPU machine)")
    from flash_attn.cute import flash_attn_varlen_func

    out, _ = flash_attn_varlen_func(
        q, kv[:, :, 0], kv[:, :, 1],  # q [T, Hq, D]; K, V [S, M, Hkv, D] strided views
        cu_seqlens_q=args.cu_seqlens_q, seqused_q=args.seqused_q, seqused_k=args.seqused_k,
        max_seqlen_q=q.shape[0], max_seqlen_k=kv.shape[1],  # upper bounds of every replay
        softmax_scale=scale, causal=True)
    return out  # [T, Hq, D]
