"""Rotary position embeddings (HF rotate-half convention) with precomputed cos/sin caches.

Supported ``rope_type``: default, linear, dynamic (NTK), llama3, yarn. The frequency
formulas follow ``transformers.modeling_rope_utils`` so results match HF.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from edmm.model.config import ModelConfig


def _base_inv_freq(base: float, dim: int) -> Tensor:
    """[dim/2] float32 ``1 / base^(2i/dim)``."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(cfg: ModelConfig, p: dict) -> Tensor:
    inv_freq = _base_inv_freq(cfg.rope_theta, cfg.head_dim)
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(cfg: ModelConfig, p: dict) -> tuple[Tensor, float]:
    base, dim = cfg.rope_theta, cfg.head_dim
    factor = p["factor"]
    orig = p["original_max_position_embeddings"]
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _dynamic_freqs(cfg: ModelConfig, p: dict, num_positions: int) -> Tensor:
    """[P, dim/2] angles for dynamic NTK scaling.

    HF recomputes the base whenever the sequence grows past ``max_position_embeddings``;
    decoding one token at a time, the token at position ``p`` is rotated with the base for
    length ``p + 1``. We bake exactly that into the cache so a token's rotation never depends
    on what else is in the batch (cache-consistent), and it matches HF's incremental decoding.
    """
    dim, max_pos, factor = cfg.head_dim, cfg.max_position_embeddings, p["factor"]
    pos = torch.arange(num_positions, dtype=torch.float32)
    seq_len = torch.clamp(torch.arange(1, num_positions + 1, dtype=torch.float64), min=max_pos)
    base = cfg.rope_theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]
    inv_freq = 1.0 / (base.float()[:, None] ** exponents[None, :])  # [P, dim/2]
    return pos[:, None] * inv_freq


def rope_angles(cfg: ModelConfig, num_positions: int) -> tuple[Tensor, float]:
    """Rotation angles [P, head_dim/2] (float32) for positions 0..P-1, and the cos/sin scale."""
    p = cfg.rope_scaling or {}
    rope_type = cfg.rope_type
    scale = 1.0
    if rope_type == "dynamic":
        return _dynamic_freqs(cfg, p, num_positions), scale
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(cfg, p)
    elif rope_type == "yarn":
        inv_freq, scale = _yarn_inv_freq(cfg, p)
    else:
        inv_freq = _base_inv_freq(cfg.rope_theta, cfg.head_dim)
        if rope_type == "linear":
            inv_freq = inv_freq / p["factor"]
    pos = torch.arange(num_positions, dtype=torch.float32)
    return pos[:, None] * inv_freq[None, :], scale


def default_max_positions(cfg: ModelConfig) -> int:
    """Rotary cache length when none is given: the context the scaling was designed for."""
    p = cfg.rope_scaling or {}
    n = cfg.max_position_embeddings
    if cfg.rope_type in ("linear", "dynamic"):
        n = int(n * p["factor"])
    elif cfg.rope_type == "yarn":
        n = max(n, int(p["original_max_position_embeddings"] * p["factor"]))
    return n


class RotaryEmbedding(nn.Module):
    """cos/sin caches [max_positions, head_dim] indexed by absolute position.

    The caches are non-persistent buffers in the model dtype (HF casts cos/sin to the
    activation dtype too). After ``to_empty`` call :meth:`reset_cache` to refill them.
    """

    cos_cache: Tensor  # [max_positions, head_dim]
    sin_cache: Tensor  # [max_positions, head_dim]

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_positions = max_positions
        self.register_buffer(
            "cos_cache", torch.empty(max_positions, cfg.head_dim), persistent=False
        )
        self.register_buffer(
            "sin_cache", torch.empty(max_positions, cfg.head_dim), persistent=False
        )
        self.reset_cache()

    @torch.no_grad()
    def reset_cache(self) -> None:
        """(Re)compute the caches in float32 on CPU and copy them into the buffers."""
        if self.cos_cache.is_meta:
            return
        angles, scale = rope_angles(self.cfg, self.max_positions)  # [P, D/2]
        emb = torch.cat((angles, angles), dim=-1)  # [P, D]
        self.cos_cache.copy_(emb.cos() * scale)
        self.sin_cache.copy_(emb.sin() * scale)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, head_dim]."""
        return self.cos_cache[positions], self.sin_cache[positions]
