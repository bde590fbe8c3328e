"""Attention metadata, KV-cache writes and the reference attention backend.

KV contract: ``kv_cache[s, t, l, 0]`` / ``kv_cache[s, t, l, 1]`` are K / V of token ``t`` of
the sequence in slot ``s`` at layer ``l``, shape [num_kv_heads, head_dim]. ``kv_cache`` may be
a strided view in which only tokens ``< context_len`` of the slots in this pass are backed, so
everything here touches exactly those tokens: writes go in place through ``index_put_`` (or
slice copies) and reads are per-sequence slices viewed with ``transpose``, never gathers.

The cache's dtype may differ from the model's (`edmm.model.kv_quant`): writes convert to it,
and an FP8 cache stores each layer's K and V divided by their per-head scales (``kv_scale``
[2, Hkv] float32 of the layer), which reads multiply back.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from edmm.model.errors import KVCacheError, ModelError
from edmm.model.kv_quant import dequantize_fp8, is_fp8, quantize_fp8


class AttentionMetadataError(ModelError):
    """The per-sequence lists of an :class:`AttentionMetadata` are inconsistent."""


@dataclass
class AttentionMetadata:
    """What one forward pass computes, for B sequences flattened into T tokens."""

    slot_ids: list[int]  # [B] arena slot of each sequence
    query_lens: list[int]  # [B] new tokens of each sequence in this pass (sum = T)
    context_lens: list[int]  # [B] tokens in the KV after this pass (cached + new)
    # Derived index tensors (see ``build``); None until built for a device.
    slot_index: Tensor | None = field(default=None, repr=False)  # [T] slot of each token
    token_index: Tensor | None = field(default=None, repr=False)  # [T] its index in the slot
    last_token_index: Tensor | None = field(default=None, repr=False)  # [B] last token's row
    slot_ids_t: Tensor | None = field(default=None, repr=False)  # [B] slot_ids
    context_lens_t: Tensor | None = field(default=None, repr=False)  # [B] context_lens
    query_start_loc: Tensor | None = field(default=None, repr=False)  # [B+1] cumsum of query_lens
    # True for a CUDA graph's static inputs: the lists above are placeholders that only fit
    # the shapes (and pick the kernel); the lengths live in the tensors alone.
    placeholder_lists: bool = False

    def __post_init__(self) -> None:
        b = len(self.slot_ids)
        if len(self.query_lens) != b or len(self.context_lens) != b:
            raise AttentionMetadataError(
                f"slot_ids/query_lens/context_lens lengths differ: "
                f"{b}/{len(self.query_lens)}/{len(self.context_lens)}"
            )
        if len(set(self.slot_ids)) != b:
            raise AttentionMetadataError(f"duplicate slot ids {self.slot_ids}")
        for q, c in zip(self.query_lens, self.context_lens, strict=True):
            if not 1 <= q <= c:
                raise AttentionMetadataError(f"need 1 <= query_len <= context_len, got {q}, {c}")

    @property
    def num_seqs(self) -> int:
        """B."""
        return len(self.slot_ids)

    @property
    def num_tokens(self) -> int:
        """T = sum(query_lens)."""
        return sum(self.query_lens)

    @classmethod
    def build(
        cls,
        slot_ids: list[int],
        query_lens: list[int],
        context_lens: list[int],
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata with the derived index tensors on ``device``."""
        return cls(list(slot_ids), list(query_lens), list(context_lens)).to(device)

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """Self if the index tensors already live on ``device``, else a copy with them built
        (all int64, transferred in one host-to-device copy)."""
        device = torch.device(device)
        have = self.slot_index.device if self.slot_index is not None else None
        if have is not None and have.type == device.type and device.index in (None, have.index):
            return self
        parts = self.index_arrays()
        flat = torch.from_numpy(np.concatenate(parts))
        return self.with_tensors(flat.to(device, non_blocking=True).split(
            [len(p) for p in parts]))

    def index_arrays(self) -> list[np.ndarray]:
        """The host arrays of the derived index tensors, in `with_tensors`' order: slot and
        index in the slot of each token ``[T]``, each sequence's last row ``[B]``, slot ids
        ``[B]``, context lengths ``[B]``, query start offsets ``[B+1]`` (all int64)."""
        slot_ids, query_lens, context_lens = (
            np.asarray(v, dtype=np.int64)
            for v in (self.slot_ids, self.query_lens, self.context_lens))  # [B] each
        starts = np.zeros(len(query_lens) + 1, dtype=np.int64)  # [B+1]
        np.cumsum(query_lens, out=starts[1:])
        # token j of sequence b sits at row starts[b] + j and slot index c_b - q_b + j
        token_index = np.arange(starts[-1], dtype=np.int64) + np.repeat(
            context_lens - query_lens - starts[:-1], query_lens)  # [T]
        return [np.repeat(slot_ids, query_lens), token_index, starts[1:] - 1, slot_ids,
                context_lens, starts]

    def with_tensors(self, views: Sequence[Tensor]) -> AttentionMetadata:
        """A copy whose index tensors are ``views`` (`index_arrays` on a device)."""
        return AttentionMetadata(
            self.slot_ids,
            self.query_lens,
            self.context_lens,
            slot_index=views[0],
            token_index=views[1],
            last_token_index=views[2],
            slot_ids_t=views[3],
            context_lens_t=views[4],
            query_start_loc=views[5],
        )


def write_kv(kv_cache: Tensor, layer: int, k: Tensor, v: Tensor, meta: AttentionMetadata,
             kv_scale: Tensor | None = None) -> None:
    """Store the new k/v [T, Hkv, D] of ``layer`` at their (slot, token) in place, converted to
    the cache's dtype; an FP8 cache needs ``kv_scale`` [2, Hkv] (`quantize_fp8` of each)."""
    if meta.slot_index is None or meta.token_index is None:
        raise AttentionMetadataError("metadata has no index tensors; call meta.to(device)")
    k, v = _stored(kv_cache, k, v, kv_scale)
    if torch.are_deterministic_algorithms_enabled():
        # Deterministic index_put_ may copy the whole destination; use slice copies instead.
        _write_kv_slices(kv_cache, layer, k, v, meta)
        return
    index = (meta.slot_index, meta.token_index)
    new = torch.stack((k, v), dim=1)  # [T, 2, Hkv, D]
    if is_fp8(kv_cache.dtype):  # as bytes: index_put_ of every device takes uint8
        kv_cache, new = kv_cache.view(torch.uint8), new.view(torch.uint8)
    kv_cache[:, :, layer].index_put_(index, new)  # [S, M, 2, Hkv, D]


def _stored(kv_cache: Tensor, k: Tensor, v: Tensor, kv_scale: Tensor | None
            ) -> tuple[Tensor, Tensor]:
    """k and v [T, Hkv, D] as the cache stores them."""
    if is_fp8(kv_cache.dtype):
        if kv_scale is None:
            raise KVCacheError("an FP8 KV cache needs the layer's kv_scale")
        return quantize_fp8(k, kv_scale[0]), quantize_fp8(v, kv_scale[1])
    return k.to(kv_cache.dtype), v.to(kv_cache.dtype)


def read_kv(kv_cache: Tensor, slot: int, num_tokens: int, layer: int, dtype: torch.dtype,
            kv_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """K and V of a slot's first ``num_tokens`` tokens of ``layer`` in ``dtype``, each
    [Hkv, n, D]: views of the cache when it holds ``dtype``, else converted copies (an FP8
    cache's multiplied by ``kv_scale`` [2, Hkv])."""
    k = kv_cache[slot, :num_tokens, layer, 0]  # [n, Hkv, D] view
    v = kv_cache[slot, :num_tokens, layer, 1]  # [n, Hkv, D] view
    if is_fp8(kv_cache.dtype):
        if kv_scale is None:
            raise KVCacheError("an FP8 KV cache needs the layer's kv_scale")
        k, v = dequantize_fp8(k, kv_scale[0], dtype), dequantize_fp8(v, kv_scale[1], dtype)
    elif kv_cache.dtype != dtype:
        k, v = k.to(dtype), v.to(dtype)
    return k.transpose(0, 1), v.transpose(0, 1)


def _write_kv_slices(
    kv_cache: Tensor, layer: int, k: Tensor, v: Tensor, meta: AttentionMetadata
) -> None:
    start = 0
    for s, q, c in zip(meta.slot_ids, meta.query_lens, meta.context_lens, strict=True):
        kv_cache[s, c - q : c, layer, 0].copy_(k[start : start + q])
        kv_cache[s, c - q : c, layer, 1].copy_(v[start : start + q])
        start += q


def attention_mask(
    num_queries: int, context_len: int, window: int | None, device: torch.device
) -> Tensor | None:
    """Bool mask [n, c] for n queries at the END of c keys (query i sees keys <= c-n+i,
    and with a window only keys > c-n+i-window). None when the mask is all-True or plainly
    causal (n == c), which callers handle without a mask."""
    plain = window is None or context_len <= window
    if plain and (num_queries == 1 or num_queries == context_len):
        return None
    q_pos = torch.arange(context_len - num_queries, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask  # [n, c]


class AttentionBackend(abc.ABC):
    """Computes attention of one layer for a flattened batch and updates the KV cache.

    A backend whose ``fuses_rope`` is True takes q and k unrotated together with
    ``rope=(cos, sin)`` ([T, D] each) and applies the rotary embedding itself (fused with its
    KV write); the caller then skips its own rotary op. Otherwise q and k come rotated.

    ``kv_read_align``: the backend's kernels may read a slot's KV up to its context rounded up
    to this many tokens (a kernel loading whole key tiles); the arena they read must map that
    far (`KVArena`'s ``read_align``). 1: never past the context.

    ``kv_scale``: the layer's float32 [2, Hkv] K and V scales, read only when ``kv_cache`` is
    FP8 (`edmm.model.kv_quant`).
    """

    fuses_rope: bool = False
    kv_read_align: int = 1

    @abc.abstractmethod
    def forward(
        self,
        q: Tensor,  # [T, Hq, D]
        k: Tensor,  # [T, Hkv, D]
        v: Tensor,  # [T, Hkv, D]
        kv_cache: Tensor,  # [S, M, L, 2, Hkv, D]
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        rope: tuple[Tensor, Tensor] | None = None,
        kv_scale: Tensor | None = None,  # [2, Hkv] float32, FP8 caches only
    ) -> Tensor:
        """Write k/v into ``kv_cache`` and return the attention output [T, Hq, D]."""


class TorchSDPABackend(AttentionBackend):
    """Reference backend: one ``scaled_dot_product_attention`` call per sequence."""

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_cache: Tensor,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        rope: tuple[Tensor, Tensor] | None = None,
        kv_scale: Tensor | None = None,
    ) -> Tensor:
        write_kv(kv_cache, layer, k, v, meta, kv_scale)
        out = torch.empty_like(q)  # [T, Hq, D]
        gqa = q.shape[1] != k.shape[1]
        start = 0
        for s, n, c in zip(meta.slot_ids, meta.query_lens, meta.context_lens, strict=True):
            qs = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            kc, vc = read_kv(kv_cache, s, c, layer, q.dtype, kv_scale)  # [Hkv, c, D] each
            ks, vs = kc.unsqueeze(0), vc.unsqueeze(0)  # [1, Hkv, c, D]
            mask = attention_mask(n, c, window, q.device)
            causal = mask is None and n > 1
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
            )  # [1, Hq, n, D]
            out[start : start + n] = o[0].transpose(0, 1)
            start += n
        return out
