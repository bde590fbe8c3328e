"""The FP8 KV dequantising kernel against `edmm.model.kv_quant.dequantize_fp8`, on CPU through
the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from edmm.kernels import KernelInputError
from edmm.kernels.kv_dequant import dequantize_kv_varlen
from edmm.model.kv_quant import FP8_KV_DTYPE, dequantize_fp8, quantize_fp8

pytestmark = pytest.mark.usefixtures("interpreted")

SLOTS, TOKENS, LAYERS, HEADS = 4, 40, 3, 2


def _cache(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random FP8 cache [slots, tokens, layers, 2, Hkv, D] and its scales [layers, 2, Hkv]."""
    torch.manual_seed(0)
    values = torch.randn(SLOTS, TOKENS, LAYERS, 2, HEADS, dim) * 3
    scales = torch.rand(LAYERS, 2, HEADS) * 0.05 + 0.01
    kv8 = torch.empty_like(values, dtype=FP8_KV_DTYPE)
    for layer in range(LAYERS):
        for kind in range(2):
            kv8[:, :, layer, kind] = quantize_fp8(values[:, :, layer, kind], scales[layer, kind])
    return kv8, scales


@pytest.mark.parametrize("dim", [32, 24])  # 24: a row of 96 values, padded to 128 in the kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_reference_and_leaves_the_rest(dim: int, dtype: torch.dtype) -> None:
    """Two sequences of other slots and lengths (one longer than a program's tokens, one
    shorter) land at their offsets, equal to dequantising each token in float32 then rounding;
    the scratch around them keeps its values."""
    kv8, scales = _cache(dim)
    layer, slots, ctx, cu = 1, [2, 0], [37, 5], [3, 40]
    out = torch.full((50, 2, HEADS, dim), 7.0, dtype=dtype)
    dequantize_kv_varlen(kv8, layer, torch.tensor(slots), torch.tensor(ctx, dtype=torch.int32),
                         torch.tensor([*cu, 45]), scales[layer].contiguous(), out, max_ctx=40)
    for slot, n, at in zip(slots, ctx, cu, strict=True):
        for kind in range(2):
            want = dequantize_fp8(kv8[slot, :n, layer, kind], scales[layer, kind], torch.float32)
            # the interpreter rounds float32 to bf16 by truncation: within one bf16 step
            torch.testing.assert_close(out[at:at + n, kind].float(), want,
                                       rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[3:40] = untouched[40:45] = False
    assert (out[untouched] == 7.0).all()


def test_nothing_to_do() -> None:
    kv8, scales = _cache(32)
    out = torch.zeros(0, 2, HEADS, 32, dtype=torch.bfloat16)
    empty = torch.zeros(0, dtype=torch.int64)
    assert dequantize_kv_varlen(kv8, 0, empty, empty, torch.zeros(1, dtype=torch.int64),
                                scales[0].contiguous(), out, max_ctx=16) is out


def test_rejects_bad_input() -> None:
    kv8, scales = _cache(32)
    one, ctx, cu = torch.tensor([0]), torch.tensor([4]), torch.tensor([0, 4])
    out = torch.zeros(8, 2, HEADS, 32, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="kv_cache must be"):
        dequantize_kv_varlen(kv8.float(), 0, one, ctx, cu, scales[0].contiguous(), out, 4)
    with pytest.raises(KernelInputError, match="layer 3 out of range"):
        dequantize_kv_varlen(kv8, 3, one, ctx, cu, scales[0].contiguous(), out, 4)
    with pytest.raises(KernelInputError, match="kv_scale must be"):
        dequantize_kv_varlen(kv8, 0, one, ctx, cu, scales[0].t(), out, 4)
    with pytest.raises(KernelInputError, match="out must be"):
        dequantize_kv_varlen(kv8, 0, one, ctx, cu, scales[0].contiguous(), out[:, :1], 4)
    with pytest.raises(KernelInputError, match="cu_ctx must have shape"):
        dequantize_kv_varlen(kv8, 0, one, ctx, one, scales[0].contiguous(), out, 4)
