"""The one-row projection against F.linear, on CPU through the Triton interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edmm.kernels import GemvConfig, KernelInputError, gemv

pytestmark = pytest.mark.usefixtures("interpreted")

SMALL = GemvConfig(block_n=4, block_k=16)  # several tiles each way, ragged edges


@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small-tiles"])
@pytest.mark.parametrize(("n", "k"), [(37, 50), (64, 512), (5, 1030)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear_fp32(n: int, k: int, bias: bool, config: GemvConfig | None) -> None:
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    torch.testing.assert_close(gemv(x, w, b, config), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_bf16_rounds_once_like_linear() -> None:
    """bf16 in and out, float32 inside: within one bf16 rounding of F.linear."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 300, generator=gen).bfloat16()
    w = (torch.randn(70, 300, generator=gen) * 0.05).bfloat16()
    b = torch.randn(70, generator=gen).bfloat16()
    got = gemv(x, w, b, SMALL)
    exact = F.linear(x.double(), w.double(), b.double())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, rtol=8e-3, atol=8e-3)


def test_weight_row_stride() -> None:
    """A weight that is a row slice of a wider matrix (unit stride on k only)."""
    wide = torch.randn(20, 96)
    w = wide[:, 16:80]  # [20, 64], row stride 96
    x = torch.randn(1, 64)
    torch.testing.assert_close(gemv(x, w, None, SMALL), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_rejects_bad_shapes() -> None:
    w = torch.zeros(8, 16)
    with pytest.raises(KernelInputError, match="x \\[1, 16\\]"):
        gemv(torch.zeros(2, 16), w)
    with pytest.raises(KernelInputError, match="bias"):
        gemv(torch.zeros(1, 16), w, torch.zeros(7))
    with pytest.raises(KernelInputError, match="dtype"):
        gemv(torch.zeros(1, 16, dtype=torch.float64), w)
