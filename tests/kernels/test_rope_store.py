"""Fused RoPE + KV write vs the model's rotary op and `write_kv`, through the interpreter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from rope_inputs import fused_qkv, rope_tables

from edmm.kernels import KernelInputError, rope_store_kv
from edmm.model.attention import AttentionMetadata, write_kv
from edmm.model.fusion import rotary_qk

pytestmark = pytest.mark.usefixtures("interpreted")

MakeCache = Callable[..., Any]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(7, 1, 32), (4, 2, 16), (28, 4, 128)])
def test_matches_rotary_and_write_kv(make_cache: MakeCache, dtype: torch.dtype, hq: int,
                                     hkv: int, d: int) -> None:
    lens = {0: 10, 2: 5}
    cache = make_cache(lens, dtype=dtype, num_slots=3, max_tokens=16, kv_heads=hkv, head_dim=d)
    ref_cache = make_cache(lens, dtype=dtype, num_slots=3, max_tokens=16, kv_heads=hkv,
                           head_dim=d)
    meta = AttentionMetadata.build([2, 0], [2, 3], [7, 13])  # tokens 5..6 and 10..12
    assert meta.slot_index is not None and meta.token_index is not None
    q, k, v = fused_qkv(5, hq, hkv, d, dtype)
    cos, sin = rope_tables(meta.token_index.tolist(), d, dtype)
    got_q = rope_store_kv(q, k, v, cos, sin, cache.kv, 1, meta.slot_index, meta.token_index)
    q64, k64 = rotary_qk(q.double(), k.double(), cos.double(), sin.double())
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_q.double(), q64, atol=atol, rtol=atol)
    write_kv(ref_cache.kv, 1, k64.to(dtype), v, meta)
    torch.testing.assert_close(cache.backing.double(), ref_cache.backing.double(), atol=atol,
                               rtol=atol, equal_nan=True)  # the same cells written, no other


def test_rejects_bad_inputs(make_cache: MakeCache) -> None:
    cache = make_cache({}, dtype=torch.float32, num_slots=1, max_tokens=4)
    q, k, v = fused_qkv(2, 4, 2, 32, torch.float32)
    cos, sin = rope_tables([0, 1], 32, torch.float32)
    idx = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(KernelInputError, match="cos/sin"):
        rope_store_kv(q, k, v, cos[:1], sin, cache.kv, 0, idx, idx)
    with pytest.raises(KernelInputError, match="slot_index"):
        rope_store_kv(q, k, v, cos, sin, cache.kv, 0, idx[:1], idx)
    with pytest.raises(KernelInputError, match="heads"):
        rope_store_kv(q, k[:, :1], v[:, :1], cos, sin, cache.kv, 0, idx, idx)
