"""Prefill flash attention vs a float64 SDPA reference, on CPU through the Triton interpreter."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tiers import grid

from edmm.kernels import (
    KernelInputError,
    PrefillConfig,
    decode_attention_varlen,
    prefill_attention,
    prefill_attention_varlen,
)
from edmm.kernels.reference import prefill_attention_reference

pytestmark = pytest.mark.usefixtures("interpreted")

MakeCache = Callable[..., Any]  # conftest fixture: NaN-poisoned strided caches
CheckClose = Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]

LENS = {2: 1, 0: 77, 3: 140, 1: 200}
MAX_TOKENS = 200
SMALL = PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)  # many tiles, diagonal
SMALL_REVERSE = PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=2,
                              reverse=True)  # last tile first
SMALL_WS = PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=2, warp_specialize=True,
                         reverse=True)  # one loop, per-sequence descriptors (16-bit only)
SMALL_CONFIGS = {"default": SMALL, "reverse": SMALL_REVERSE, "warp-spec": SMALL_WS}


def _dtype(config: PrefillConfig | None) -> torch.dtype:
    """float32, or bf16 for the warp-specialized kernel (16-bit only: fp32 falls back)."""
    return torch.bfloat16 if config is not None and config.warp_specialize else torch.float32


def _run(
    cache: Any,
    slot: int,
    query_len: int,
    num_heads: int,
    layer: int = 1,
    config: PrefillConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel output and float64 reference for the last ``query_len`` tokens of ``slot``."""
    n = cache.lens[slot]
    head_dim = cache.kv.shape[-1]
    q = torch.randn(query_len, num_heads, head_dim).to(cache.kv.dtype)
    scale = head_dim**-0.5
    out = prefill_attention(q, cache.kv, layer, slot, n, query_len, scale, config=config)
    ref = prefill_attention_reference(q, cache.kv, layer, slot, n, scale, dtype=torch.float64)
    return out, ref


@grid({"config": {"default": None, "warp-spec": SMALL_WS},
       "dtype": [torch.float32, torch.float16, torch.bfloat16], "group": [1, 2, 3, 4]},
      fast=[(None, torch.float32, 1), (SMALL_WS, torch.float16, 2), (None, torch.bfloat16, 3),
            (SMALL_WS, torch.float32, 4)])  # warp-spec in fp32: the default kernel's fallback
def test_matches_reference(
    make_cache: MakeCache, check_close: CheckClose, dtype: torch.dtype, group: int,
    config: PrefillConfig | None
) -> None:
    cache = make_cache(LENS, dtype=dtype, num_slots=4, max_tokens=MAX_TOKENS)
    for slot, query_len in ((3, 45), (0, 77), (2, 1)):  # cached prefix; from scratch; 1 token
        out, ref = _run(cache, slot, query_len, 2 * group, config=config)
        assert out.shape == (query_len, 2 * group, 32) and out.dtype == dtype
        check_close(out, ref, dtype)


@grid({"small": SMALL_CONFIGS, ("slot", "query_len"): [(1, 200), (1, 70), (3, 33), (0, 16)]},
      fast=[(SMALL, (0, 16)), (SMALL_REVERSE, (3, 33)), (SMALL_WS, (1, 70))])
def test_small_tiles_cross_the_diagonal(
    make_cache: MakeCache, check_close: CheckClose, slot: int, query_len: int,
    small: PrefillConfig
) -> None:
    """Several query tiles, unmasked tiles before the diagonal, masked ones on it."""
    cache = make_cache(LENS, dtype=torch.bfloat16, num_slots=4, max_tokens=MAX_TOKENS)
    out, ref = _run(cache, slot, query_len, 4, layer=0, config=small)
    check_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_head_dims(make_cache: MakeCache, check_close: CheckClose, head_dim: int) -> None:
    cache = make_cache(
        {0: 50}, dtype=torch.float16, num_slots=1, max_tokens=64, kv_heads=1, head_dim=head_dim
    )
    out, ref = _run(cache, 0, 20, 2)
    check_close(out, ref, torch.float16)


@pytest.mark.parametrize("config", [None, *(pytest.param(c, marks=pytest.mark.slow) for c in (
    SMALL, SMALL_REVERSE, SMALL_WS))])  # fast tier: those three in the padded varlen test
def test_varlen_batch(
    make_cache: MakeCache, check_close: CheckClose, config: PrefillConfig | None
) -> None:
    dtype = _dtype(config)
    cache = make_cache(LENS, dtype=dtype, num_slots=4, max_tokens=MAX_TOKENS)
    seqs = [(1, 37), (2, 1), (0, 77), (3, 9)]  # (slot, query_len)
    qs = [torch.randn(ql, 4, 32).to(dtype) for _, ql in seqs]
    cu = torch.tensor([0] + [sum(ql for _, ql in seqs[: i + 1]) for i in range(len(seqs))])
    slots = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    lens = torch.tensor([LENS[s] for s, _ in seqs], dtype=torch.int32)
    out = prefill_attention_varlen(
        torch.cat(qs),
        cache.kv,
        1,
        cu.to(torch.int32),
        slots,
        lens,
        scale=0.17,
        config=config,
    )
    ref = torch.cat(
        [
            prefill_attention_reference(q, cache.kv, 1, s, LENS[s], 0.17, dtype=torch.float64)
            for q, (s, _) in zip(qs, seqs, strict=True)
        ]
    )
    check_close(out, ref, dtype)


@grid({"small": SMALL_CONFIGS}, fast=[(SMALL,), (SMALL_WS,)])  # reverse: the tests above
def test_varlen_padding_sequences_and_rows(make_cache: MakeCache, check_close: CheckClose,
                                           small: PrefillConfig) -> None:
    """A CUDA graph's padded batch: trailing sequences with no queries (on a pad slot) and
    trailing rows that belong to no sequence; the real rows match the reference."""
    dtype = _dtype(small)
    cache = make_cache(LENS, dtype=dtype, num_slots=4, max_tokens=MAX_TOKENS)
    seqs = [(3, 40), (1, 1)]  # (slot, query_len); 41 real rows
    qs = [torch.randn(ql, 4, 32).to(dtype) for _, ql in seqs]
    q = torch.cat([*qs, torch.randn(23, 4, 32).to(dtype)])  # 64 rows: 23 padding rows
    cu = torch.tensor([0, 40, 41, 41, 41], dtype=torch.int64)  # 2 padding sequences
    slots = torch.tensor([3, 1, 0, 0])
    lens = torch.tensor([LENS[3], LENS[1], 1, 1])
    out = prefill_attention_varlen(q, cache.kv, 0, cu, slots, lens, 0.2, config=small)
    ref = torch.cat([prefill_attention_reference(x, cache.kv, 0, s, LENS[s], 0.2,
                                                 dtype=torch.float64)
                     for x, (s, _) in zip(qs, seqs, strict=True)])
    check_close(out[:41], ref, dtype)


@grid({"small": SMALL_CONFIGS, "num_splits": [1, 3]},
      fast=[(SMALL, 3), (SMALL_WS, 1)])
def test_mixed_batch_single_queries_split_k(make_cache: MakeCache, check_close: CheckClose,
                                            num_splits: int, small: PrefillConfig) -> None:
    """The backend's mixed path: multi-query sequences through the prefill kernel (skipping
    single-query ones), single-query sequences through the varlen decode kernel into the same
    output, with padding sequences and rows as a CUDA graph has them."""
    dtype = _dtype(small)
    cache = make_cache(LENS, dtype=dtype, num_slots=4, max_tokens=MAX_TOKENS)
    seqs = [(1, 1), (3, 40), (2, 1), (0, 2)]  # (slot, query_len): decodes beside prefills
    qs = [torch.randn(ql, 4, 32).to(dtype) for _, ql in seqs]
    q = torch.cat([*qs, torch.randn(20, 4, 32).to(dtype)])  # 64 rows
    cu = torch.tensor([0, 1, 41, 42, 44, 44], dtype=torch.int64)  # one padding sequence
    slots = torch.tensor([1, 3, 2, 0, 0])
    lens = torch.tensor([LENS[1], LENS[3], LENS[2], LENS[0], 1])
    out = prefill_attention_varlen(q, cache.kv, 1, cu, slots, lens, 0.2, config=small,
                                   skip_single=True)
    out = decode_attention_varlen(q, cache.kv, 1, cu, slots, lens, out, 0.2,
                                  num_splits=num_splits)
    ref = torch.cat([prefill_attention_reference(x, cache.kv, 1, s, LENS[s], 0.2,
                                                 dtype=torch.float64)
                     for x, (s, _) in zip(qs, seqs, strict=True)])
    check_close(out[:44], ref, dtype)


@pytest.mark.slow  # a server, subprocess or seconds of waiting: the thorough tier
@grid({"small": SMALL_CONFIGS}, fast=[(SMALL,)])  # ~1 min a case in the interpreter
def test_many_padding_sequences_span_several_scans(make_cache: MakeCache,
                                                    check_close: CheckClose,
                                                    small: PrefillConfig) -> None:
    """A graph for many running sequences: hundreds of single-query and empty sequences around
    the prefills (more than one `SCAN` of them, the tile finder's vector width), a prefill after
    the first scan; with single queries skipped, the prefill rows match the reference."""
    dtype = _dtype(small)
    cache = make_cache(LENS, dtype=dtype, num_slots=4, max_tokens=MAX_TOKENS)
    seqs = [(1, 1)] * 100 + [(3, 40)] + [(2, 1)] * 30 + [(0, 9)] + [(1, 1)] * 3
    real = sum(ql for _, ql in seqs)
    qs = [torch.randn(ql, 4, 32).to(dtype) for _, ql in seqs]
    q = torch.cat([*qs, torch.randn(7, 4, 32).to(dtype)])  # 7 padding rows
    ends = torch.tensor([ql for _, ql in seqs]).cumsum(0)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), ends, ends[-1:].repeat(10)])
    slots = torch.tensor([s for s, _ in seqs] + [0] * 10)
    lens = torch.tensor([LENS[s] for s, _ in seqs] + [1] * 10)
    out = prefill_attention_varlen(q, cache.kv, 1, cu, slots, lens, 0.2, config=small,
                                   skip_single=True)
    for i in (100, 131):  # the two prefills' rows
        s, ql = seqs[i]
        start = int(cu[i])
        ref = prefill_attention_reference(qs[i], cache.kv, 1, s, LENS[s], 0.2,
                                          dtype=torch.float64)
        check_close(out[start:start + ql], ref, dtype)
    assert real == int(cu[-1]) and cu.shape[0] - 1 == len(seqs) + 10 > 128


def test_cache_is_not_written(make_cache: MakeCache) -> None:
    cache = make_cache(LENS, dtype=torch.float32, num_slots=4, max_tokens=MAX_TOKENS)
    before = cache.backing.clone()
    _run(cache, 3, 40, 2, config=SMALL)
    assert torch.equal(cache.backing.isnan(), before.isnan())
    assert torch.equal(cache.backing.nan_to_num(), before.nan_to_num())


def test_rejects_bad_lengths() -> None:
    kv = torch.zeros(2, 8, 1, 2, 1, 16)
    q = torch.zeros(4, 1, 16)
    with pytest.raises(KernelInputError, match="query_len"):
        prefill_attention(q, kv, 0, 0, 3, 4, 1.0)  # more queries than context
    with pytest.raises(KernelInputError, match="max_tokens"):
        prefill_attention(q, kv, 0, 0, 9, 4, 1.0)
    with pytest.raises(KernelInputError, match="tokens"):
        prefill_attention(q, kv, 0, 0, 8, 5, 1.0)
    with pytest.raises(KernelInputError, match="slot_id"):
        prefill_attention(q, kv, 0, 2, 8, 4, 1.0)
    with pytest.raises(KernelInputError, match="power of two"):
        prefill_attention(torch.zeros(4, 1, 24), torch.zeros(2, 8, 1, 2, 1, 24), 0, 0, 8, 4, 1.0)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_warp_specialized_kernel_runs_where_usable(
    make_cache: MakeCache, check_close: CheckClose, monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype
) -> None:
    """bf16 takes the warp-specialized kernel; fp32 (no 16-bit tensor cores) and a q whose
    rows are not 16-byte aligned fall back to the default kernel, with the same results."""
    module = sys.modules[prefill_attention.__module__]
    launches: list[torch.dtype] = []
    launch = module._launch_ws

    def spy(q: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        launches.append(q.dtype)
        launch(q, *args, **kwargs)

    monkeypatch.setattr(module, "_launch_ws", spy)
    cache = make_cache(LENS, dtype=dtype, num_slots=4, max_tokens=MAX_TOKENS)
    out, ref = _run(cache, 1, 70, 4, config=SMALL_WS)
    check_close(out, ref, dtype)
    assert launches == ([dtype] if dtype == torch.bfloat16 else [])
    odd = torch.randn(70, 4 * 32 + 1).to(dtype)[:, 1:].view(70, 4, 32)  # rows 2 B off
    assert not module.warp_specialize_usable(odd, cache.kv[:, :, 1])


def test_warp_specialize_takes_only_the_verified_launch_shape() -> None:
    with pytest.raises(KernelInputError, match="num_stages=2"):
        PrefillConfig(num_warps=4, num_stages=3, warp_specialize=True)
    with pytest.raises(KernelInputError, match="num_warps=4"):
        PrefillConfig(num_warps=8, num_stages=2, warp_specialize=True)
    assert PrefillConfig(num_warps=8, num_stages=3).num_stages == 3  # the default kernel: any
