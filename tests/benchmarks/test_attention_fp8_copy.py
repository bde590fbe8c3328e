"""The FP8 copy the kernel bench's FP8 prefill sweep reads (its timings need a GPU)."""

from __future__ import annotations

import torch

from benchmarks.kernels.attention import fp8_copy
from edmm.model.kv_quant import FP8_HEADROOM, FP8_MAX


def test_fp8_copy_is_slot_zero_scaled_per_layer_and_head() -> None:
    torch.manual_seed(0)
    kv = torch.randn(2, 64, 3, 2, 4, 16)  # [S, M, L, 2, Hkv, D]
    kv[0, :, 1, 0, 2] *= 50.0  # one head of one layer's K far larger than the rest
    kv8, scales = fp8_copy(kv, 48)
    assert kv8.shape == (1, 48, 3, 2, 4, 16) and kv8.dtype == torch.float8_e4m3fn
    assert scales.shape == (3, 2, 4) and scales.dtype == torch.float32
    src = kv[0:1, :48]
    # Each head's largest magnitude is stored at 448 / headroom, the others in proportion.
    stored = kv8.float().abs().amax(dim=(0, 1, 5))
    assert torch.allclose(stored, torch.full_like(stored, FP8_MAX / FP8_HEADROOM), rtol=0.07)
    assert scales[1, 0, 2] > 30 * scales[1, 0, 1]
    back = kv8.float() * scales[None, None, :, :, :, None]
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormals below 2^-6 (steps of 2^-9).
    bound = src.abs() * 2.0**-4 + scales[None, None, :, :, :, None] * 2.0**-9
    assert ((back - src).abs() <= bound + 1e-7).all()
    assert not torch.equal(back, src)  # rounded: a copy that kept BF16 would not be FP8
