"""Attention on the GPU through EDMM's Triton kernels, reading the arena's strided KV in place.

Decode batches (every query length 1) go to the split-K decode kernel, which takes slot ids and
context lengths as device tensors, so a CUDA graph captured once replays for any lengths up to
``max_context``. In batches with a prefill, sequences of several queries go to the varlen
prefill kernel (end-aligned causal) and single-query ones to the split-K decode kernel in its
varlen mode; both launches depend on the token and sequence counts only (capturable).
With a `LongPrefill` route (cuDNN's fused attention), eager passes whose multi-query sequences
are all long take it instead of the Triton prefill kernel. Sliding-window layers fall back to
the reference SDPA backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from edmm.kernels import PrefillConfig
from edmm.kernels.fused_sdpa import LongPrefill, end_aligned_by_parts
from edmm.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataError,
    TorchSDPABackend,
    write_kv,
)
from edmm.model.fusion import rotary_qk

# Hopper: the warp-specialized kernel, 478 TFLOP/s against 421 for the default on 512 tokens
# over a 16K prefix, 490 against 429 (the best earlier config) on a 16K prefill in 2048-token
# chunks (H200, `python -m edmm.bench.attention --prefill-sweep`,
# benchmarks/results/2026-11-30-h200-session4/attention-sweep.md).
# Elsewhere (or fp32) the default kernel runs with its default launch parameters.
PREFILL = PrefillConfig(block_m=128, block_n=128, num_warps=4, num_stages=2,
                        warp_specialize=True, reverse=True)


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels over the arena; see the module docstring. RoPE is fused with the KV
    write (`rope_store_kv`).

    Args:
        max_context: the longest context a decode call (or captured graph) serves; it fixes
            the split count of the decode kernel.
        prefill: launch parameters of the prefill kernel (`PREFILL`, or the default kernel's
            `PrefillConfig()` for comparisons).
        long_prefill: a route for long eager passes (`CUDNN_LONG_PREFILL`); its calls take
            host-side lengths, so it is never taken while a CUDA graph is captured nor on a
            graph's static metadata (``placeholder_lists``, also in the warm-up runs).
    """

    fuses_rope = True

    def __init__(self, max_context: int, prefill: PrefillConfig = PREFILL,
                 long_prefill: LongPrefill | None = None) -> None:
        self.max_context = max_context
        self.prefill = prefill
        self.long_prefill = long_prefill
        self._fallback = TorchSDPABackend()

    def forward(
        self,
        q: Tensor,  # [T, Hq, D], rotated unless rope is given
        k: Tensor,  # [T, Hkv, D], rotated unless rope is given
        v: Tensor,  # [T, Hkv, D]
        kv_cache: Tensor,  # [S, M, L, 2, Hkv, D]
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        rope: tuple[Tensor, Tensor] | None = None,  # cos, sin [T, D]
    ) -> Tensor:
        """Rotate (if ``rope``) and write k/v into the cache, then attend; returns [T, Hq, D]."""
        if window is not None:
            if rope is not None:
                q, k = rotary_qk(q, k, *rope)
            return self._fallback.forward(q, k, v, kv_cache, layer, meta, scale, window)
        from edmm.kernels import (
            decode_attention,
            decode_attention_varlen,
            prefill_attention_varlen,
            rope_store_kv,
        )

        if (meta.slot_ids_t is None or meta.context_lens_t is None or meta.query_start_loc is None
                or meta.slot_index is None or meta.token_index is None):
            raise AttentionMetadataError("metadata has no device tensors; call meta.to(device)")
        if rope is not None:
            q = rope_store_kv(q, k, v, *rope, kv_cache, layer, meta.slot_index,
                              meta.token_index)  # [T, Hq, D]
        else:
            write_kv(kv_cache, layer, k, v, meta)
        if all(n == 1 for n in meta.query_lens):
            return decode_attention(q, kv_cache, layer, meta.slot_ids_t, meta.context_lens_t,
                                    scale, max_context=self.max_context)
        # Mixed: multi-query sequences in query tiles (or the long route), single-query ones
        # split-K, in place.
        route = self._long_route(q, meta)
        if route is not None:
            out = self._long_prefill(q, kv_cache, layer, meta, scale, route)
        else:
            out = prefill_attention_varlen(q, kv_cache, layer, meta.query_start_loc,
                                           meta.slot_ids_t, meta.context_lens_t, scale,
                                           config=self.prefill, skip_single=True)
        return decode_attention_varlen(q, kv_cache, layer, meta.query_start_loc,
                                       meta.slot_ids_t, meta.context_lens_t, out, scale,
                                       max_context=self.max_context)

    def _long_route(self, q: Tensor, meta: AttentionMetadata) -> LongPrefill | None:
        """The long route if this pass takes it, else None."""
        route = self.long_prefill
        if (route is None or meta.placeholder_lists or _capturing(q) or not route.usable(q)
                or any(1 < n < route.min_queries for n in meta.query_lens)):
            return None
        return route

    def _long_prefill(self, q: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata,
                      scale: float, route: LongPrefill) -> Tensor:
        """Multi-query sequences through ``route``, one call pair each; single-query rows are
        left for the decode kernel."""
        out = torch.empty_like(q)  # [T, Hq, D]
        start = 0
        for s, n, c in zip(meta.slot_ids, meta.query_lens, meta.context_lens, strict=True):
            if n > 1:
                kv = kv_cache[s, :c, layer]  # [c, 2, Hkv, D] view
                k, v = (kv[:, i].transpose(0, 1)[None] for i in (0, 1))  # [1, Hkv, c, D]
                q4 = q[start:start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
                o = end_aligned_by_parts(q4, k, v, scale, route.attend)
                out[start:start + n] = o[0].transpose(0, 1)
            start += n
        return out


def _capturing(q: Tensor) -> bool:
    """True while a CUDA graph is being captured on q's device's current stream."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def default_backend(device: torch.device | str, max_context: int,
                    prefill: PrefillConfig = PREFILL,
                    long_prefill: LongPrefill | None = None) -> AttentionBackend:
    """Triton kernels (``prefill``: the prefill kernel's launch parameters; ``long_prefill``:
    a route for long eager passes) on a CUDA device where triton is usable, else the
    reference SDPA."""
    from edmm.kernels import triton_usable

    if torch.device(device).type == "cuda" and triton_usable(device):
        return TritonAttentionBackend(max_context, prefill, long_prefill)
    return TorchSDPABackend()
