"""Attention with FlashAttention-4's prefill kernel and the Triton split-K decode kernel.

Batches with a prefill (several queries in a sequence) attend through FA4's varlen forward
on the arena's strided K/V views (`edmm.kernels.fa4`: end-aligned causal, grouped KV heads, no
copy); their single-query sequences, and decode batches, stay on the Triton split-K decode
kernel (FA4's Hopper forward has no split-KV: 171 us per layer for one 16K decode against 16
us). RoPE is fused with the KV write as in `TritonAttentionBackend`. Sliding-window layers and
fp32 fall back to the Triton backend's own paths.

An FP8 KV cache (`edmm.model.kv_quant`) takes the Triton backend's path whole: its prefill
kernel reads the e4m3 tiles in place and folds the per-head scales into the scores and the
output. FA4's CuTe forward takes fp16/bf16 K/V only (FP8 is on its list of features it does not
support), and the other way in, dequantising the keys a pass reads into a bf16 scratch for FA4,
needs a scratch a CUDA graph can capture, so of a fixed size: the keys a mixed step reads are
bounded only by the sum of its prefilling sequences' contexts (several ``max_model_len``s, GBs
for a 32K model at one layer), and the copy itself re-reads and re-writes the context each layer
(16 MB read, 32 MB written per 16K sequence and layer: ~16 us at 3 TB/s, about 8% of the FA4
attention of a 512-token chunk on 16K). The price, an FP8 engine's prefill attention at the
Triton kernel's speed rather than FA4's, is in ``docs/limits.md`` (FP8 KV cache).

Measured on an H200 (one layer, Qwen2.5-7B heads, CUDA-event medians): 512 queries on a 16K
prefix 611-614 TFLOP/s against 420 for the Triton kernel, a 16K one-pass prefill
700-720 against 490.

The arena must map each slot `FA4_KV_TILE` tokens past its context (``read_align``, see
`edmm.kernels.fa4`): `kv_read_align` says so to whoever builds the arena.
"""

from __future__ import annotations

from torch import Tensor

from edmm.kernels.decode_routes import DecodeRoutes
from edmm.kernels.fa4 import FA4_DTYPES, FA4_KV_TILE, FA4VarlenArgs, fa4_varlen_args
from edmm.model.attention import AttentionMetadata, AttentionMetadataError, write_kv
from edmm.model.attention_triton import VARLEN_DECODE, TritonAttentionBackend


class FA4AttentionBackend(TritonAttentionBackend):
    """FA4 for the multi-query part of a pass, Triton for decode rows; see module docstring.

    Args:
        max_context: the longest context a decode call (or captured graph) serves (the
            decode kernel's split count).
        decode_routes: the decode kernel's measured routing table, as in
            `TritonAttentionBackend`.
    """

    kv_read_align = FA4_KV_TILE

    def __init__(self, max_context: int, decode_routes: DecodeRoutes | None = None) -> None:
        super().__init__(max_context, decode_routes=decode_routes)
        self._args_meta: AttentionMetadata | None = None  # the pass `_args` belongs to
        self._args_layer = -1  # the last layer that used them
        self._args: FA4VarlenArgs | None = None

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
        decode_only = all(n == 1 for n in meta.query_lens)
        if (window is not None or decode_only or q.dtype not in FA4_DTYPES
                or kv_cache.dtype != q.dtype):  # FP8 (or any other) KV: Triton's prefill
            return super().forward(q, k, v, kv_cache, layer, meta, scale, window, rope,
                                   kv_scale)
        from edmm.kernels import decode_attention_varlen, rope_store_kv
        from edmm.kernels.fa4 import fa4_varlen_attention

        if (meta.slot_ids_t is None or meta.context_lens_t is None or meta.query_start_loc is None
                or meta.slot_index is None or meta.token_index is None):
            raise AttentionMetadataError("metadata has no device tensors; call meta.to(device)")
        if rope is not None:
            q = rope_store_kv(q, k, v, *rope, kv_cache, layer, meta.slot_index,
                              meta.token_index)  # [T, Hq, D]
        else:
            write_kv(kv_cache, layer, k, v, meta)
        args = self._varlen_args(meta, kv_cache, layer)
        out = fa4_varlen_attention(q, kv_cache, layer, args, scale)  # [T, Hq, D]
        if not meta.placeholder_lists and 1 not in meta.query_lens:
            return out  # eager, and the lists are real: no row for the decode kernel
        return decode_attention_varlen(q, kv_cache, layer, meta.query_start_loc,
                                       meta.slot_ids_t, meta.context_lens_t, out, scale,
                                       max_context=self.max_context, config=VARLEN_DECODE,
                                       workspace=self.decode_workspace)

    def _varlen_args(self, meta: AttentionMetadata, kv_cache: Tensor,
                     layer: int) -> FA4VarlenArgs:
        """FA4's per-slot arguments of the pass ``meta`` describes, built at its first FA4
        layer and reused by its later layers. A new pass (another ``meta``, or the same one
        from a layer not above the last: a CUDA graph's capture after its warm-up runs)
        builds them again, so a captured graph rebuilds them from its static inputs on every
        replay."""
        if self._args is None or meta is not self._args_meta or layer <= self._args_layer:
            assert meta.query_start_loc is not None and meta.slot_ids_t is not None
            assert meta.context_lens_t is not None
            self._args = fa4_varlen_args(meta.query_start_loc, meta.slot_ids_t,
                                         meta.context_lens_t, kv_cache.shape[0],
                                         skip_single=True)
            self._args_meta = meta
        self._args_layer = layer
        return self._args
