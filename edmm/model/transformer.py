"""Decoder-only transformer for Llama / Qwen2 / Qwen3 / Mistral, token-flattened (no padding).

Parameter names follow HF (``model.layers.N.self_attn.o_proj.weight``, ...) except two fused
projections: ``self_attn.qkv_proj`` (rows: q, k, v) and ``mlp.gate_up_proj`` (rows: gate, up);
see :mod:`edmm.model.loader` for the mapping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edmm.kernels._common import FP8_KV_DTYPE
from edmm.model.attention import AttentionBackend, AttentionMetadata, TorchSDPABackend
from edmm.model.config import ModelConfig
from edmm.model.errors import ContextTooLongError, KVCacheError
from edmm.model.fusion import PointwiseOps
from edmm.model.kv_quant import check_kv_scales, is_fp8
from edmm.model.layers import Matmul, Projection, RMSNorm, SwiGLUMLP
from edmm.model.rope import RotaryEmbedding, default_max_positions


class Attention(nn.Module):
    """GQA self-attention with optional qkv bias and optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.window_for_layer(layer_idx)
        self.backend = backend
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Projection(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = Projection(q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.ops = PointwiseOps()
        self.kv_scale: Tensor | None = None  # [2, Hkv] of an FP8 cache (`set_kv_scales`)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        """x [T, hidden], cos/sin [T, D] -> [T, hidden]."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.backend.fuses_rope:  # rotated inside, with the KV write
            o = self.backend.forward(q, k, v, kv_cache, self.layer_idx, meta, self.scale,
                                     self.window, rope=(cos, sin),
                                     kv_scale=self.kv_scale)  # [T, Hq, D]
        else:
            q, k = self.ops.rotary_qk(q, k, cos, sin)
            o = self.backend.forward(
                q, k, v, kv_cache, self.layer_idx, meta, self.scale, self.window,
                kv_scale=self.kv_scale,
            )  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    The residual stream is carried separately, vLLM-style: each block returns its output and
    the residual, and the next norm adds them (`RMSNorm.add_forward`), so the add fuses into
    the norm's kernel. The arithmetic is HF's: the same adds in the same dtype.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        meta: AttentionMetadata,
    ) -> tuple[Tensor, Tensor]:
        """x [T, hidden] (the previous block's output), residual [T, hidden] or None for the
        first layer -> (this block's output, the residual stream before it), each [T, hidden]."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The full model: ``forward`` gives final hidden states, ``compute_logits`` the logits.

    Args:
        cfg: model shape.
        backend: attention implementation (default: :class:`TorchSDPABackend`).
        max_positions: length of the rotary cos/sin cache (default: the config's context,
            times the rope factor for linear/dynamic/yarn scaling).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend | None = None,
        max_positions: int | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend if backend is not None else TorchSDPABackend()
        self.model = DecoderModel(cfg, self.backend)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(cfg, max_positions or default_max_positions(cfg))
        self.ops = PointwiseOps()  # shared by every layer; see `enable_fusion`
        self.matmul: Matmul = F.linear  # the LM head's; see `set_matmul`
        self.kv_scales: Tensor | None = None  # [L, 2, Hkv] float32; see `set_kv_scales`
        for m in self.modules():
            if isinstance(m, (Attention, RMSNorm, SwiGLUMLP)):
                m.ops = self.ops

    def enable_fusion(self) -> None:
        """Run RMSNorm, RoPE and SiLU-and-multiply as fused compiled kernels (for CUDA)."""
        self.ops.compile()

    def set_matmul(self, matmul: Matmul) -> None:
        """Run every projection (`Projection` modules) and the LM head through ``matmul``,
        an ``F.linear`` alike (e.g. `edmm.kernels.skinny_matmul.RoutedMatmul`)."""
        self.matmul = matmul
        for m in self.modules():
            if isinstance(m, Projection):
                m.matmul = matmul

    def set_kv_scales(self, scales: Tensor | None) -> None:
        """The scales of an FP8 KV cache (`edmm.model.kv_quant`): ``scales`` [L, 2, Hkv]
        float32 on the model's device (per layer, K then V, per KV head), kept for the model's
        life (CUDA graphs read their address); None: caches in a float dtype only."""
        if scales is not None:
            cfg = self.cfg
            check_kv_scales(scales, cfg.num_layers, cfg.num_kv_heads)
            scales = scales.to(self.model.embed_tokens.weight.device).contiguous()
        self.kv_scales = scales
        for m in self.modules():
            if isinstance(m, Attention):
                m.kv_scale = scales[m.layer_idx] if scales is not None else None

    def set_backend(self, backend: AttentionBackend) -> None:
        """Swap the attention implementation of every layer."""
        self.backend = backend
        for m in self.modules():
            if isinstance(m, Attention):
                m.backend = backend

    def forward(
        self,
        input_ids: Tensor,  # [T] int64, new tokens of all sequences, concatenated
        positions: Tensor,  # [T] int64 absolute position of each token
        kv_cache: Tensor,  # [num_slots, max_tokens, num_layers, 2, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> Tensor:
        """Run the new tokens through the model, appending their K/V to ``kv_cache``.

        Returns the final-norm hidden states [T, hidden]; pick rows (e.g.
        ``meta.last_token_index``) and pass them to :meth:`compute_logits`.
        """
        self._check_inputs(input_ids, positions, kv_cache, meta)
        meta = meta.to(input_ids.device)
        cos, sin = self.rotary(positions)  # [T, D] each
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        residual: Tensor | None = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, cos, sin, kv_cache, meta)
        if residual is None:  # a model with no layers
            return self.model.norm(h)
        return self.model.norm.add_forward(h, residual)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return self.matmul(hidden, weight, None).float()

    def _check_inputs(
        self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor, meta: AttentionMetadata
    ) -> None:
        cfg = self.cfg
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [T], got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        if input_ids.shape[0] != meta.num_tokens:
            raise ValueError(f"{input_ids.shape[0]} tokens but sum(query_lens)={meta.num_tokens}")
        want = (cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
        if kv_cache.dim() != 6 or tuple(kv_cache.shape[2:]) != want:
            raise KVCacheError(
                f"kv_cache shape {tuple(kv_cache.shape)} does not match "
                f"[num_slots, max_tokens, {', '.join(map(str, want))}]"
            )
        model_dtype = self.model.embed_tokens.weight.dtype
        if kv_cache.dtype not in (model_dtype, torch.bfloat16, FP8_KV_DTYPE):
            raise KVCacheError(f"kv_cache dtype {kv_cache.dtype} is neither the model's "
                               f"({model_dtype}), bfloat16 nor {FP8_KV_DTYPE}")
        if is_fp8(kv_cache.dtype) and self.kv_scales is None:
            raise KVCacheError("an FP8 kv_cache needs the model's KV scales (set_kv_scales)")
        num_slots, max_tokens = kv_cache.shape[0], kv_cache.shape[1]
        if any(not 0 <= s < num_slots for s in meta.slot_ids):
            raise KVCacheError(f"slot ids {meta.slot_ids} out of range [0, {num_slots})")
        longest = max(meta.context_lens, default=0)
        if longest > max_tokens:
            raise KVCacheError(
                f"context of {longest} tokens exceeds kv_cache max_tokens {max_tokens}"
            )
        if longest > self.rotary.max_positions:
            raise ContextTooLongError(
                f"context of {longest} tokens exceeds the rotary cache "
                f"({self.rotary.max_positions} positions)"
            )

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (rotary caches), e.g. after ``to_empty``."""
        self.rotary.reset_cache()
