"""Attention on the GPU through EDMM's Triton kernels, reading the arena's strided KV in place.

Decode batches (every query length 1) go to the split-K decode kernel, which takes slot ids and
context lengths as device tensors, so a CUDA graph captured once replays for any lengths up to
``max_context``. In batches with a prefill, sequences of several queries go to the varlen
prefill kernel (end-aligned causal) and single-query ones to the split-K decode kernel in its
varlen mode; both launches depend on the token and sequence counts only (capturable). An eager
pass with no single-query sequence skips the decode launch. Sliding-window layers fall back to
the reference SDPA backend. Every kernel reads and writes the cache in its dtype, FP8 with the
layer's scales (`edmm.model.kv_quant`).

cuDNN's fused attention (`edmm.kernels.fused_sdpa`) was measured on an H200 as a route for
long eager passes and not taken: slower on a cached prefix (439 vs 480 TFLOP/s for 512 queries
over 16K) and on a 16K prefill in 2048-token chunks (432 vs 494), faster only on one fresh 16K
pass (449 vs 460 ms for the whole model), a pass the engine's token budget never runs.
"""

from __future__ import annotations

from torch import Tensor

from edmm.kernels import DecodeConfig, PrefillConfig
from edmm.kernels._common import CounterWorkspace
from edmm.kernels.decode_routes import DecodeRoutes
from edmm.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataError,
    TorchSDPABackend,
    write_kv,
)
from edmm.model.fusion import rotary_qk
from edmm.model.kv_quant import is_fp8

# Hopper: the warp-specialized kernel, 478 TFLOP/s against 421 for the default on 512 tokens
# over a 16K prefix, 490 against 429 (the best earlier config) on a 16K prefill in 2048-token
# chunks (H200, `python -m benchmarks.kernels.attention --prefill-sweep`).
# Elsewhere (or fp32) the default kernel runs with its default launch parameters.
PREFILL = PrefillConfig(block_m=128, block_n=128, num_warps=4, num_stages=2,
                        warp_specialize=True, reverse=True)
# FP8 KV: the pipelined (not warp-specialized) kernel with 128x128 tiles and 8 warps. Each e4m3
# tile is converted to bf16 in registers before the MMA. Of the five configs of
# `benchmarks.kernels.attention --fp8-prefill-sweep` (H100, 2026-12-07) it was fastest: 453.7
# us for 512 queries on a 16K prefix and 7.28 ms for a 16K prefill in 2048-token chunks, one
# layer, against 634.8 us and 9.95 ms for the warp-specialized 128x64 one used before (BF16:
# 249.5 us, 3.95 ms). It keeps 80 bytes on the stack (tests/kernels/test_compile_sm90.py
# bounds it); 128x64 with 8 warps has none but took 520.7 us and 8.46 ms.
PREFILL_FP8 = PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3,
                            warp_specialize=False, reverse=True)
# Single-query rows of a mixed batch: the split kernel merges its own splits. At the default
# split count (~17 at 16K) the fused merge costs about what the reduce launch does (batch 1,
# 16K, 16 splits, 64x4x3 with PDL: 20.3 vs 19.9 us per layer on an H200; without: 21.2 vs
# 21.4), and a mixed CUDA graph with no such row at replay runs one near-empty launch per layer
# instead of two (the reduce kernel took 28 x 0.9 us of a 512-token step in an H200 profile).
VARLEN_DECODE = DecodeConfig(fused=True, pdl=True)


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels over the arena; see the module docstring. RoPE is fused with the KV
    write (`rope_store_kv`).

    Args:
        max_context: the longest context a decode call (or captured graph) serves; it fixes
            the split count of the decode kernel.
        prefill: launch parameters of the prefill kernel (`PREFILL`, or the default kernel's
            `PrefillConfig()` for comparisons); `PREFILL` reads an FP8 cache with
            `PREFILL_FP8`'s tiles.
        decode_routes: a measured table of the decode kernel's split count and launch config
            per (batch, context) (`edmm.kernels.decode_routes`), looked up for decode batches
            at ``max_context``; None: the kernel's own heuristic.
    """

    fuses_rope = True

    def __init__(self, max_context: int, prefill: PrefillConfig = PREFILL,
                 decode_routes: DecodeRoutes | None = None) -> None:
        self.max_context = max_context
        self.prefill = prefill
        self.decode_routes = decode_routes
        self.decode_workspace = CounterWorkspace()  # counters of fused decode launches
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
        kv_scale: Tensor | None = None,  # [2, Hkv] float32, FP8 caches only
    ) -> Tensor:
        """Rotate (if ``rope``) and write k/v into the cache, then attend; returns [T, Hq, D]."""
        if window is not None:
            if rope is not None:
                q, k = rotary_qk(q, k, *rope)
            return self._fallback.forward(q, k, v, kv_cache, layer, meta, scale, window,
                                          kv_scale=kv_scale)
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
                              meta.token_index, kv_scale)  # [T, Hq, D]
        else:
            write_kv(kv_cache, layer, k, v, meta, kv_scale)
        if all(n == 1 for n in meta.query_lens):
            route = (self.decode_routes.lookup(q.shape[0], self.max_context)
                     if self.decode_routes is not None else None)
            if route is None:
                return decode_attention(q, kv_cache, layer, meta.slot_ids_t,
                                        meta.context_lens_t, scale, max_context=self.max_context,
                                        kv_scale=kv_scale)
            return decode_attention(q, kv_cache, layer, meta.slot_ids_t, meta.context_lens_t,
                                    scale, num_splits=route.num_splits, config=route.config,
                                    workspace=self.decode_workspace, kv_scale=kv_scale)
        # Mixed: multi-query sequences in query tiles, single-query ones split-K, in place.
        prefill = PREFILL_FP8 if is_fp8(kv_cache.dtype) and self.prefill == PREFILL else (
            self.prefill)
        out = prefill_attention_varlen(q, kv_cache, layer, meta.query_start_loc,
                                       meta.slot_ids_t, meta.context_lens_t, scale,
                                       config=prefill, skip_single=True, kv_scale=kv_scale)
        if not meta.placeholder_lists and 1 not in meta.query_lens:
            return out  # eager, and the lists are real: no row for the decode kernel
        return decode_attention_varlen(q, kv_cache, layer, meta.query_start_loc,
                                       meta.slot_ids_t, meta.context_lens_t, out, scale,
                                       max_context=self.max_context, config=VARLEN_DECODE,
                                       workspace=self.decode_workspace, kv_scale=kv_scale)

