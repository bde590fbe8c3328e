"""The skinny matmul kernel vs a float64 matmul, on CPU through the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from edmm.kernels import KernelInputError
from edmm.kernels._common import CounterWorkspace, SkinnyConfig
from edmm.kernels.skinny_matmul import MAX_ROWS, skinny_linear

pytestmark = pytest.mark.usefixtures("interpreted")


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)  # [M, K]
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)  # [N, K]
    b = torch.randn(n, generator=gen).to(dtype) if bias else None  # [N]
    return x, w, b


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """float64 product (+ bias) -> [M, N] float64."""
    ref = x.double() @ w.double().T
    return ref + b.double() if b is not None else ref


def _assert_rounded_once(got: torch.Tensor, ref: torch.Tensor) -> None:
    """got is ref rounded to got's dtype, up to one unit in its last place (fp32 sums over K
    in another order than float64's)."""
    assert got.dtype != torch.float64 and not got.isnan().any()
    ulp = torch.finfo(got.dtype).eps * ref.abs().clamp_min(1e-3)
    assert ((got.double() - ref).abs() <= ulp + 1e-6).all(), (got.double() - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_matches_float64(dtype: torch.dtype, bias: bool, splits: int) -> None:
    x, w, b = _inputs(5, 96, 200, dtype, bias)  # K = 200: a partial K tile; N: a partial tile
    out = skinny_linear(x, w, b, SkinnyConfig(block_n=64, block_k=32, splits=splits))
    assert out.shape == (5, 96) and out.dtype == dtype
    _assert_rounded_once(out, _reference(x, w, b))


@pytest.mark.parametrize("m", [1, 2, MAX_ROWS])
def test_row_counts_and_even_tiles(m: int) -> None:
    """Rows 1 .. 16; N and K multiples of the tiles (the unmasked loads), 4 splits."""
    x, w, b = _inputs(m, 128, 256, torch.bfloat16, bias=True, seed=m)
    out = skinny_linear(x, w, b, SkinnyConfig(block_n=32, block_k=32, splits=4))
    _assert_rounded_once(out, _reference(x, w, b))


def test_split_merge_is_deterministic_and_leaves_counters_zero() -> None:
    """The merge sums splits in split order: the same bits twice; the counters end at 0, so
    the next launch with the same workspace merges right (a stale count would skip a merge)."""
    x, w, b = _inputs(3, 80, 300, torch.bfloat16, bias=False)
    ws = CounterWorkspace()
    cfg = SkinnyConfig(block_n=16, block_k=32, splits=5)
    first = skinny_linear(x, w, b, cfg, ws)
    second = skinny_linear(x, w, b, cfg, ws)
    assert torch.equal(first, second)
    assert not ws.counters(1, x.device).any()
    _assert_rounded_once(second, _reference(x, w, b))


def test_more_splits_than_k_tiles() -> None:
    """splits > K / block_k: the split count shrinks to the tiles, no empty split."""
    x, w, b = _inputs(2, 32, 64, torch.float32, bias=True)
    out = skinny_linear(x, w, b, SkinnyConfig(block_n=16, block_k=32, splits=8))
    _assert_rounded_once(out, _reference(x, w, b))


def test_strided_rows_of_x() -> None:
    """x a row slice of a wider tensor (row stride != K)."""
    x, w, b = _inputs(4, 48, 64, torch.float32, bias=False)
    wide = torch.zeros(4, 100)
    wide[:, 10:74] = x
    out = skinny_linear(wide[:, 10:74], w, b, SkinnyConfig(block_n=16, block_k=16, splits=2))
    _assert_rounded_once(out, _reference(x, w, b))


def test_zero_rows() -> None:
    x, w, b = _inputs(0, 32, 64, torch.float32, bias=False)
    assert skinny_linear(x, w, b).shape == (0, 32)


@pytest.mark.parametrize("case", ["rows", "k", "bias", "dtype", "stride", "block"])
def test_bad_input_is_a_named_error(case: str) -> None:
    x, w, b = _inputs(2, 32, 64, torch.float32, bias=True)
    kw: dict = {}
    if case == "rows":
        x = torch.zeros(MAX_ROWS + 1, 64)
    elif case == "k":
        w = torch.zeros(32, 48)
    elif case == "bias":
        b = torch.zeros(31)
    elif case == "dtype":
        w = w.to(torch.bfloat16)
    elif case == "stride":
        w = torch.zeros(64, 32).T
    with pytest.raises(KernelInputError):
        if case == "block":
            kw["config"] = SkinnyConfig(block_n=24)
        skinny_linear(x, w, b, **kw)
