"""Split-K decode attention vs a float64 SDPA reference, on CPU through the Triton interpreter."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiers import grid

from edmm.kernels import (
    DecodeConfig,
    KernelInputError,
    decode_attention,
    decode_attention_varlen,
    default_num_splits,
)
from edmm.kernels._common import CounterWorkspace, decode_tma_usable
from edmm.kernels.decode_attention import MAX_FUSED_SPLITS
from edmm.kernels.reference import decode_attention_reference

pytestmark = pytest.mark.usefixtures("interpreted")

MakeCache = Callable[..., Any]  # conftest fixture: NaN-poisoned strided caches
CheckClose = Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]

# slot -> context length: 1 token, a partial tile, an exact tile multiple, a full slot (max 300)
LENS = {3: 1, 0: 77, 4: 128, 1: 300, 2: 203}
MAX_TOKENS = 300
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _run(
    cache: Any, q: torch.Tensor, slots: list[int], layer: int = 1, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel output and float64 reference for q [B, Hq, D] against ``slots``."""
    lens = [cache.lens.get(s, 0) for s in slots]
    scale = q.shape[-1] ** -0.5
    out = decode_attention(
        q,
        cache.kv,
        layer,
        torch.tensor(slots, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        scale,
        **kw,
    )
    ref = decode_attention_reference(q, cache.kv, layer, slots, lens, scale, dtype=torch.float64)
    return out, ref


@grid({"dtype": DTYPES, "group": [1, 2, 4], "num_splits": [1, 4]},
      fast=[(torch.float32, 1, 1), (torch.float16, 2, 4), (torch.bfloat16, 4, 1)])
def test_matches_reference(
    make_cache: MakeCache, check_close: CheckClose, dtype: torch.dtype, group: int, num_splits: int
) -> None:
    cache = make_cache(LENS, dtype=dtype, num_slots=5, max_tokens=MAX_TOKENS)
    slots = [1, 3, 0, 4]
    q = torch.randn(len(slots), 2 * group, 32).to(dtype)
    out, ref = _run(cache, q, slots, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == dtype
    check_close(out, ref, dtype)


@pytest.mark.slow  # fast tier: a group of 7 in test_fused_matches_reference
def test_qwen_group_of_seven_and_many_splits(
    make_cache: MakeCache, check_close: CheckClose
) -> None:
    """Hq/Hkv = 7 (padded to 16 rows); splits past the context are empty and merge to 0."""
    cache = make_cache(LENS, dtype=torch.bfloat16, num_slots=5, max_tokens=MAX_TOKENS)
    q = torch.randn(5, 14, 32).to(torch.bfloat16)
    out, ref = _run(cache, q, [0, 1, 2, 3, 4], layer=0, num_splits=9)
    check_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_head_dims(make_cache: MakeCache, check_close: CheckClose, head_dim: int) -> None:
    cache = make_cache(
        {0: 90, 1: 33},
        dtype=torch.float16,
        num_slots=2,
        max_tokens=96,
        kv_heads=1,
        head_dim=head_dim,
    )
    q = torch.randn(2, 2, head_dim).to(torch.float16)
    out, ref = _run(cache, q, [1, 0], num_splits=2)
    check_close(out, ref, torch.float16)


@pytest.mark.slow  # fast tier: the split counts against the reference
def test_split_count_does_not_change_the_result(make_cache: MakeCache) -> None:
    cache = make_cache(LENS, dtype=torch.float32, num_slots=5, max_tokens=MAX_TOKENS)
    q = torch.randn(3, 4, 32)
    one, _ = _run(cache, q, [1, 2, 0], num_splits=1)
    for splits in (2, 3, 5):
        many, _ = _run(cache, q, [1, 2, 0], num_splits=splits, config=DecodeConfig(block_n=16))
        torch.testing.assert_close(many, one, atol=1e-6, rtol=1e-6)


def test_default_splits_from_max_context(make_cache: MakeCache, check_close: CheckClose) -> None:
    cache = make_cache(LENS, dtype=torch.float32, num_slots=5, max_tokens=MAX_TOKENS)
    q = torch.randn(1, 2, 32)
    assert default_num_splits(1, 2, MAX_TOKENS, "cpu") == 2  # capped by 256 tokens per split
    assert default_num_splits(1, 4, 16384, "cpu") == 64
    assert default_num_splits(64, 4, 32768, "cpu") == 2
    out, ref = _run(cache, q, [1])
    check_close(out, ref, torch.float32)


def test_empty_context_gives_zeros(make_cache: MakeCache) -> None:
    cache = make_cache({0: 10}, dtype=torch.float32, num_slots=2, max_tokens=32)
    q = torch.randn(2, 2, 32)
    for splits in (1, 3):
        out, ref = _run(cache, q, [1, 0], num_splits=splits)  # slot 1 holds 0 tokens
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        torch.testing.assert_close(out[1].double(), ref[1], atol=2e-5, rtol=2e-5)


def test_strided_query_and_int64_indices(make_cache: MakeCache, check_close: CheckClose) -> None:
    cache = make_cache(LENS, dtype=torch.float32, num_slots=5, max_tokens=MAX_TOKENS)
    qkv = torch.randn(2, 8, 32)  # q is the first 4 heads of a fused projection
    q = qkv[:, :4]
    lens = [LENS[2], LENS[4]]
    out = decode_attention(
        q, cache.kv, 0, torch.tensor([2, 4]), torch.tensor(lens), 0.2, num_splits=3
    )
    ref = decode_attention_reference(q, cache.kv, 0, [2, 4], lens, 0.2, dtype=torch.float64)
    check_close(out, ref, torch.float32)


def test_cache_is_not_written(make_cache: MakeCache) -> None:
    cache = make_cache(LENS, dtype=torch.float16, num_slots=5, max_tokens=MAX_TOKENS)
    before = cache.backing.clone()
    _run(cache, torch.randn(2, 4, 32).to(torch.float16), [1, 0], num_splits=4)
    assert torch.equal(cache.backing.isnan(), before.isnan())
    assert torch.equal(cache.backing.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("head_dim", [8, 48, 256])
def test_rejects_unsupported_head_dim(head_dim: int) -> None:
    kv = torch.zeros(1, 4, 1, 2, 1, head_dim)
    q = torch.zeros(1, 1, head_dim)
    idx = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="power of two"):
        decode_attention(q, kv, 0, idx, idx, 1.0)


@pytest.mark.parametrize(
    ("q_shape", "q_dtype", "kv_heads", "match"),
    [
        ((1, 3, 16), torch.float32, 2, "multiple"),
        ((1, 2, 16), torch.float16, 2, "share"),
        ((2, 16), torch.float32, 2, r"\[B, Hq, D\]"),
    ],
)
def test_rejects_bad_inputs(
    q_shape: tuple[int, ...], q_dtype: torch.dtype, kv_heads: int, match: str
) -> None:
    kv = torch.zeros(1, 4, 1, 2, kv_heads, 16)
    idx = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(KernelInputError, match=match):
        decode_attention(torch.zeros(q_shape, dtype=q_dtype), kv, 0, idx, idx, 1.0)


# ---------------------------------------------------------------------------- fused merge
FUSED = DecodeConfig(block_n=16, num_warps=2, num_stages=2, fused=True)
CPU = torch.device("cpu")


def _counters_zero(ws: CounterWorkspace) -> bool:
    return not ws.counters(1, CPU).any()


@grid({"dtype": DTYPES, ("heads", "kv_heads"): [(14, 2), (4, 2), (2, 2)],
       "num_splits": [2, 5, 40]},
      fast=[(torch.float32, (14, 2), 2), (torch.float16, (4, 2), 5)])

def test_fused_matches_reference(make_cache: MakeCache, check_close: CheckClose,
                                 dtype: torch.dtype, heads: int, kv_heads: int,
                                 num_splits: int) -> None:
    """The split kernel merging its own splits: ragged contexts (1 token, partial and exact
    tiles, a full slot, an empty one), 40 splits of 16-token tiles past every context (empty
    splits), GQA groups of 7, 2 and 1; the counters end at zero."""
    cache = make_cache(LENS, dtype=dtype, num_slots=6, max_tokens=MAX_TOKENS,
                       kv_heads=kv_heads)
    slots = [1, 3, 0, 5, 4, 2]  # slot 5 holds no token
    q = torch.randn(len(slots), heads, 32).to(dtype)
    ws = CounterWorkspace()
    out, ref = _run(cache, q, slots, num_splits=num_splits, config=FUSED, workspace=ws)
    check_close(out, ref, dtype)
    assert torch.equal(out[3], torch.zeros_like(out[3]))  # empty context: zeros
    assert _counters_zero(ws)


@pytest.mark.slow  # fast tier: the fused kernel against the reference, its counters zero
def test_fused_equals_two_launches_and_reuses_its_workspace(make_cache: MakeCache) -> None:
    """One workspace over calls of other batch sizes, split counts and layers: each result
    equals the two-launch kernel's (the same partials, merged in another order)."""
    cache = make_cache(LENS, dtype=torch.float32, num_slots=5, max_tokens=MAX_TOKENS)
    ws = CounterWorkspace()
    unfused = DecodeConfig(block_n=16, num_warps=2, num_stages=2)
    for slots, splits, layer in (([1, 3, 0], 7, 0), ([2], 19, 1), ([4, 1, 0, 3, 2], 3, 1)):
        q = torch.randn(len(slots), 4, 32)
        got, _ = _run(cache, q, slots, layer, num_splits=splits, config=FUSED, workspace=ws)
        want, _ = _run(cache, q, slots, layer, num_splits=splits, config=unfused)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        assert _counters_zero(ws)


@pytest.mark.parametrize(("config", "num_splits"), [
    pytest.param(FUSED, 6, id="fused"),
    pytest.param(DecodeConfig(16, 2, 2, sliced_reduce=True), 80, id="sliced",
                 marks=pytest.mark.slow)])  # fast tier: test_sliced_reduce_second_slice
def test_varlen_rows_of_a_merged_launch(make_cache: MakeCache, check_close: CheckClose,
                                        config: DecodeConfig, num_splits: int) -> None:
    """VARLEN, the splits merged by the split kernel itself (fused) or by the reduce over
    head-dim slices (80 splits: two slices): only single-query sequences are computed and
    merged (a padding sequence of one query included), rows of the others stay as they were."""
    cache = make_cache(LENS, dtype=torch.bfloat16, num_slots=5, max_tokens=MAX_TOKENS)
    cu = torch.tensor([0, 1, 5, 6, 6, 7], dtype=torch.int64)  # (1, 4, 1, 0, 1) queries
    slots = torch.tensor([1, 3, 2, 0, 4])
    lens = torch.tensor([LENS[1], LENS[3], LENS[2], LENS[0], LENS[4]])
    q = torch.randn(8, 14, 32).to(torch.bfloat16)
    out = torch.full_like(q, 7.0)
    ws = CounterWorkspace()
    decode_attention_varlen(q, cache.kv, 1, cu, slots, lens, out, 0.2, num_splits=num_splits,
                            config=config, workspace=ws)
    for row, b in ((0, 0), (5, 2), (6, 4)):
        s = int(slots[b])
        ref = decode_attention_reference(q[row:row + 1], cache.kv, 1, [s], [LENS[s]], 0.2,
                                         dtype=torch.float64)
        check_close(out[row:row + 1], ref, torch.bfloat16)
    assert bool((out[1:5] == 7.0).all()) and bool((out[7] == 7.0).all())
    assert _counters_zero(ws)


def test_fused_merge_past_one_lse_step(make_cache: MakeCache, check_close: CheckClose) -> None:
    """300 splits, more than the 256 log-sum-exps of the fused merge's first step (and than
    the two-launch path takes), at the smallest shape (one sequence, one KV head, one query
    head): the fast tier's case of that path."""
    cache = make_cache({0: 20}, dtype=torch.float32, num_slots=1, max_tokens=32, kv_heads=1)
    out, ref = _run(cache, torch.randn(1, 1, 32), [0], num_splits=300, config=FUSED)
    check_close(out, ref, torch.float32)


@pytest.mark.slow  # fast tier: the test above
def test_fused_split_limit_and_workspace_growth(make_cache: MakeCache,
                                                check_close: CheckClose) -> None:
    cache = make_cache({0: 20}, dtype=torch.float32, num_slots=1, max_tokens=32)
    q = torch.randn(1, 2, 32)
    idx, lens = torch.zeros(1, dtype=torch.int32), torch.tensor([20])
    out = decode_attention(q, cache.kv, 0, idx, lens, 0.2, num_splits=300, config=FUSED)
    ref = decode_attention_reference(q, cache.kv, 0, [0], [20], 0.2, dtype=torch.float64)
    check_close(out, ref, torch.float32)  # > MAX_SPLITS of the two-launch path
    with pytest.raises(KernelInputError, match="num_splits"):
        decode_attention(q, cache.kv, 0, idx, lens, 0.2, num_splits=MAX_FUSED_SPLITS + 1,
                         config=FUSED)
    ws = CounterWorkspace()
    small = ws.counters(4, CPU)
    assert ws.counters(4, CPU) is small and not small.any()
    big = ws.counters(small.numel() + 1, CPU)
    assert big.numel() > small.numel() and not big.any()
    outgrown = weakref.ref(small)
    del small
    gc.collect()
    assert outgrown() is not None  # kept alive: a graph captured with it still uses it


def test_pdl_is_ignored_off_hopper(make_cache: MakeCache, check_close: CheckClose) -> None:
    """``pdl`` and ``prefetch`` are Hopper forms (PTX); in the interpreter the kernels run
    without them."""
    cache = make_cache(LENS, dtype=torch.float32, num_slots=5, max_tokens=MAX_TOKENS)
    q = torch.randn(2, 4, 32)
    for cfg in (DecodeConfig(16, 2, 2, pdl=True, prefetch=True),
                DecodeConfig(16, 2, 2, fused=True, pdl=True, prefetch=True)):
        out, ref = _run(cache, q, [1, 2], num_splits=4, config=cfg)
        check_close(out, ref, torch.float32)


# ---------------------------------------------------------------------------- balanced, TMA
BALANCED_TMA = [DecodeConfig(16, 2, 2, balanced=True), DecodeConfig(16, 2, 2, tma=True),
                DecodeConfig(32, 2, 2, balanced=True, tma=True),
                DecodeConfig(16, 2, 2, balanced=True, tma=True, fused=True)]


@grid({"dtype": DTYPES, "config": dict(zip(["balanced", "tma", "both", "both-fused"],
                                          BALANCED_TMA, strict=True)),
       "num_splits": [1, 3, 33]},
      fast=[(torch.float32, BALANCED_TMA[0], 3), (torch.float16, BALANCED_TMA[1], 1),
            (torch.bfloat16, BALANCED_TMA[2], 3), (torch.float16, BALANCED_TMA[3], 3)])
def test_balanced_and_tma_match_reference(make_cache: MakeCache, check_close: CheckClose,
                                          dtype: torch.dtype, config: DecodeConfig,
                                          num_splits: int) -> None:
    """Equal token shares per split (tiles starting mid-tile, 33 splits past short contexts)
    and descriptor loads of the full tiles: ragged contexts, NaN past each one (a TMA box
    reaching past a context shows), an empty slot gives zeros."""
    cache = make_cache(LENS, dtype=dtype, num_slots=6, max_tokens=MAX_TOKENS)
    assert decode_tma_usable(cache.kv[:, :, 1])  # the descriptor path really runs
    slots = [1, 3, 0, 5, 4, 2]  # slot 5 holds no token
    q = torch.randn(len(slots), 14, 32).to(dtype)
    out, ref = _run(cache, q, slots, num_splits=num_splits, config=config,
                    workspace=CounterWorkspace())
    check_close(out, ref, dtype)
    assert not out[3].any()


def test_tma_needs_contiguous_heads(make_cache: MakeCache, check_close: CheckClose) -> None:
    """A cache whose KV heads are not contiguous within a token has no row descriptor: the
    kernel loads by pointers instead, with the same result."""
    cache = make_cache(LENS, dtype=torch.float32, num_slots=5, max_tokens=MAX_TOKENS,
                       kv_heads=4)
    kv = cache.kv[:, :, :, :, ::2]  # [S, M, L, 2, 2, D]: every other head, a gap between
    assert not decode_tma_usable(kv[:, :, 1]) and decode_tma_usable(cache.kv[:, :, 1])
    q = torch.randn(2, 4, 32)
    slots, lens = [1, 2], [LENS[1], LENS[2]]
    out = decode_attention(q, kv, 1, torch.tensor(slots), torch.tensor(lens), 0.2,
                           num_splits=4, config=DecodeConfig(16, 2, 2, tma=True))
    ref = decode_attention_reference(q, kv, 1, slots, lens, 0.2, dtype=torch.float64)
    check_close(out, ref, torch.float32)


# ---------------------------------------------------------------------------- sliced reduce
SLICED = [DecodeConfig(16, 2, 2, sliced_reduce=True),
          DecodeConfig(16, 2, 3, balanced=True, sliced_reduce=True)]


@grid({"config": dict(zip(["sliced", "balanced-sliced"], SLICED, strict=True)),
       ("dtype", "num_splits"): [(torch.float32, 5), (torch.float16, 1), (torch.bfloat16, 33),
                                 (torch.bfloat16, 80)]},
      fast=[(SLICED[1], (torch.float32, 5))])  # two slices: test_varlen_rows_of_a_merged_launch
def test_sliced_reduce_matches_reference(make_cache: MakeCache, check_close: CheckClose,
                                         dtype: torch.dtype, config: DecodeConfig,
                                         num_splits: int) -> None:
    """The merge over head-dim slices (two of the 32 columns at more than 64 splits, one
    below) over ragged contexts (1 token, NaN past each context, an empty slot, splits past
    the short contexts): every row against the float64 reference."""
    cache = make_cache(LENS, dtype=dtype, num_slots=6, max_tokens=MAX_TOKENS)
    slots = [1, 3, 0, 5, 4, 2]  # slot 5 holds no token
    q = torch.randn(len(slots), 14, 32).to(dtype)
    out, ref = _run(cache, q, slots, num_splits=num_splits, config=config)
    check_close(out, ref, dtype)
    assert not out[3].any()  # empty context: zeros


def test_sliced_reduce_second_slice(make_cache: MakeCache, check_close: CheckClose) -> None:
    """80 splits merged over two head-dim slices, at the smallest shape (one sequence, one KV
    head, one query head): the fast tier's case of the second slice."""
    cache = make_cache({0: MAX_TOKENS}, dtype=torch.float32, num_slots=1, max_tokens=MAX_TOKENS,
                       kv_heads=1)
    out, ref = _run(cache, torch.randn(1, 1, 32), [0], num_splits=80, config=SLICED[0])
    check_close(out, ref, torch.float32)


@pytest.mark.slow  # fast tier: one slice and two against the reference
def test_sliced_reduce_equals_the_one_slice_merge_in_float32(make_cache: MakeCache) -> None:
    """Head dim 128: 2 splits merge in one slice, 33 and 64 in four of 32 columns; the result
    is the unsliced merge's up to rounding."""
    cache = make_cache(LENS, dtype=torch.float32, num_slots=5, max_tokens=MAX_TOKENS,
                       head_dim=128)
    q = torch.randn(4, 4, 128)
    for splits in (2, 33, 64):
        want, _ = _run(cache, q, [1, 2, 0, 3], num_splits=splits,
                       config=DecodeConfig(16, 2, 2))
        got, _ = _run(cache, q, [1, 2, 0, 3], num_splits=splits,
                      config=DecodeConfig(16, 2, 2, sliced_reduce=True))
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_sweep_letter_and_route_flag_of_the_sliced_reduce(tmp_path: Path) -> None:
    """``r`` after a sweep config's numbers sets `DecodeConfig.sliced_reduce`; a routing
    table keeps the flag."""
    from benchmarks.kernels import decode_sweep as sweep
    from edmm.kernels.decode_routes import DecodeRoutes

    configs = sweep.parse_configs("64x2x3r,16x4x3btr")
    assert configs == (DecodeConfig(64, 2, 3, sliced_reduce=True),
                       DecodeConfig(16, 4, 3, balanced=True, tma=True, sliced_reduce=True))
    for bad in ("64x2x3rr", "64x2x3w", "64x2x3p"):
        with pytest.raises(SystemExit):
            sweep.parse_configs(bad)
    path = tmp_path / "routes.json"
    path.write_text(json.dumps({"routes": [
        {"batch": 1, "context": 16384, "num_splits": 64, "block_n": 64, "num_warps": 2,
         "num_stages": 3, "graph_us": 11.0, "pdl": True, "sliced_reduce": True}]}))
    route = DecodeRoutes.from_json(path).lookup(1, 16384)
    assert route is not None and route.config == DecodeConfig(64, 2, 3, pdl=True,
                                                               sliced_reduce=True)


def test_rejects_bad_index_tensors() -> None:
    kv = torch.zeros(1, 4, 1, 2, 1, 16)
    q = torch.zeros(2, 1, 16)
    good = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="slot_ids"):
        decode_attention(q, kv, 0, torch.zeros(3, dtype=torch.int32), good, 1.0)
    with pytest.raises(KernelInputError, match="int32 or int64"):
        decode_attention(q, kv, 0, good, torch.zeros(2), 1.0)
    with pytest.raises(KernelInputError, match="layer"):
        decode_attention(q, kv, 1, good, good, 1.0)
    with pytest.raises(KernelInputError, match="num_splits"):
        decode_attention(q, kv, 0, good, good, 1.0, num_splits=257)


def test_decode_parts_calls_run_the_routed_kernel() -> None:
    """`decode_parts`' per-layer calls (the GPU bench of where a layer's time goes) at a
    small context: ``full`` is the kernel's result, ``split only`` writes the partials its
    merge would read, the launch floor writes one value per program."""
    from benchmarks.kernels.decode_parts import part_fns

    torch.manual_seed(0)
    kv = torch.randn(1, 40, 28, 2, 4, 128).to(torch.bfloat16)  # Qwen2.5-7B heads, 28 layers
    q = torch.randn(1, 28, 128).to(torch.bfloat16)
    fns = part_fns(kv, q, 40, 3, DecodeConfig(16, 2, 2))
    out = fns["full"](2)
    ref = decode_attention_reference(q, kv, 2, [0], [40], 128**-0.5, dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    part_o = fns["split only"](2)  # [1, 28, 3, 128] fp32 partials
    assert part_o.shape == (1, 28, 3, 128) and bool(part_o.isfinite().all())
    assert bool((fns["launch floor"](0) == 1.0).all())  # one per program of (1, 4, 3)


def test_read_floor_kernel_reads_exactly_the_layer_bytes() -> None:
    """The streaming-read floor of `decode_parts` sums each program's share of the K+V bytes
    of slots 0 .. B - 1, tokens < context, of one layer: whole token rows, or per KV head as
    the decode kernel reads them; over the arena's view or a contiguous copy of the same
    shape. Every program's sum against torch's."""
    from benchmarks.kernels.decode_parts import Floor, stream_fns

    torch.manual_seed(0)
    kv = torch.randn(3, 50, 4, 2, 4, 16)  # [S, M, L, 2, Hkv, D]
    kv[:, 45:] = float("nan")  # past the context: never read
    kv[2] = float("nan")  # past the batch
    floors = (Floor(3, 4, 2, 2), Floor(7, 8, 2, 2, per_head=True))
    for f, fn in stream_fns(kv, 2, 45, floors, contiguous=False).items():
        rows = kv[:2, :45, 1].reshape(90, 2, 4, 16)  # [(slot, token), 2, Hkv, D]
        share = -(-90 // f.programs)
        if f.per_head:  # [Hkv, programs]
            want = torch.stack([torch.stack([rows[p * share:(p + 1) * share, :, h].sum()
                                             for p in range(f.programs)]) for h in range(4)])
        else:
            want = torch.stack([rows[p * share:(p + 1) * share].sum()
                                for p in range(f.programs)])
        torch.testing.assert_close(fn(5).view_as(want), want, atol=1e-4, rtol=1e-4)
    for fn in stream_fns(kv, 2, 45, floors, contiguous=True).values():
        assert bool(fn(1).isfinite().all())  # a fresh buffer per layer, no NaN read

