"""End-aligned causal attention from two top-left-causal calls merged by log-sum-exp
(`end_aligned_by_parts`, the core of the attention bench's cuDNN candidate): checked on the
CPU with ATen's CPU flash kernel, which also returns its log-sum-exp, against SDPA with an
explicit mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edmm.kernels.fused_sdpa import end_aligned_by_parts
from edmm.model.attention import attention_mask

SCALE = 128**-0.5


def cpu_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """An `AttendLSE` on the CPU (ATen's CPU flash kernel, which returns its log-sum-exp;
    top-left causality, like cuDNN's): [1, Hq, n, D] x [1, Hkv, c, D] -> out, lse [1, Hq, n]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale)
    return out, lse


@pytest.mark.parametrize(("n", "c"), [(1, 9), (5, 9), (9, 9), (16, 40), (40, 40)])
def test_end_aligned_by_parts_matches_masked_sdpa(n: int, c: int) -> None:
    g = torch.Generator().manual_seed(n * 100 + c)
    q = torch.randn(1, 6, n, 128, generator=g)  # [1, Hq, n, D]
    k, v = (torch.randn(1, 2, c, 128, generator=g) for _ in range(2))  # [1, Hkv, c, D]
    mask = attention_mask(n, c, None, q.device)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and n > 1,
                                         scale=SCALE, enable_gqa=True)
    got = end_aligned_by_parts(q, k, v, SCALE, cpu_attend)
    assert got.shape == ref.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
