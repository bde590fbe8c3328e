"""Every attention path over an FP8 KV cache (e4m3 with per-layer, per-KV-head scales), on the
CPU through the Triton interpreter.

Two checks per path: the kernel computes attention over the values the FP8 bytes stand for
(against a float64 reference of the dequantised cache, within the tolerance of q's dtype),
and FP8 storage itself stays within `FP8_ROW_ERROR` of the full-precision values it was
quantised from (the same reference over those values).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from rope_inputs import fused_qkv, rope_tables
from tiers import grid

import edmm.kernels
import edmm.kernels.fa4
from edmm.kernels import (
    DecodeConfig,
    KernelInputError,
    PrefillConfig,
    decode_attention,
    decode_attention_varlen,
    prefill_attention,
    prefill_attention_varlen,
    rope_store_kv,
)
from edmm.kernels._common import FP8_KV_DTYPE
from edmm.kernels.reference import decode_attention_reference, prefill_attention_reference
from edmm.model import PRESETS, AttentionMetadata
from edmm.model.attention import TorchSDPABackend, write_kv
from edmm.model.attention_fa4 import FA4AttentionBackend
from edmm.model.attention_triton import PREFILL_FP8, TritonAttentionBackend
from edmm.model.fusion import rotary_qk
from edmm.model.kv_quant import FP8_HEADROOM, FP8_MAX
from edmm.model.transformer import CausalLM

pytestmark = pytest.mark.usefixtures("interpreted")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Each test's random queries from the same seed: the FP8 error bounds are statistics of
    them, which must not depend on what ran before (the test order, the tier)."""
    torch.manual_seed(0)

MakeCache = Callable[..., Any]  # conftest fixture: NaN-poisoned strided caches
CheckClose = Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]

LENS = {3: 1, 0: 77, 4: 128, 1: 200, 2: 150}
MAX_TOKENS = 200
# Relative error per output row (error norm / reference norm) of attention over FP8 KV
# against the same attention over the values before quantisation: e4m3 rounds each value
# within 2^-4 of itself; random KV of head dim 32 measured 4-5% on average, 12% at most
# (rows whose output nearly cancels).
FP8_MEAN_ROW_ERROR = 0.06
FP8_ROW_ERROR = 0.15  # max over rows
SMALL = PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)
SMALL_WS = PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=2,
                         warp_specialize=True, reverse=True)


@dataclass
class FP8Cache:
    """An FP8 cache, the values it was quantised from, and its per-layer scales."""

    fp8: Any  # PoisonedCache of float8_e4m3fn (NaN where nothing may be read)
    exact: Any  # PoisonedCache of the float32 values before quantisation
    scales: torch.Tensor  # [L, 2, Hkv] float32

    def scale(self, layer: int) -> torch.Tensor:
        """The kernels' ``kv_scale`` of ``layer``: [2, Hkv]."""
        return self.scales[layer]


def _fp8_cache(make_cache: MakeCache, lens: dict[int, int], seed: int = 0,
               **kw: Any) -> FP8Cache:
    """A NaN-poisoned cache whose (layer, K|V, head) magnitudes spread over 0.3 .. 3, stored
    as FP8 with calibration-style scales (each head's largest value at 448 / 16)."""
    base = make_cache(lens, dtype=torch.float32, seed=seed, **kw)
    backing = base.backing  # [S + 1, M + 3, L + 1, 2, Hkv, D]
    gen = torch.Generator().manual_seed(seed + 1)
    mag = 10 ** (torch.rand(backing.shape[2:5], generator=gen) - 0.5)  # [L + 1, 2, Hkv]
    values = backing * mag[None, None, :, :, :, None]
    amax = values.nan_to_num(0.0).abs().amax(dim=(0, 1, 5))  # [L + 1, 2, Hkv]
    scales = amax * FP8_HEADROOM / FP8_MAX
    stored = (values / scales[None, None, :, :, :, None]).clamp(-FP8_MAX, FP8_MAX)
    stored = stored.to(FP8_KV_DTYPE)  # NaN stays NaN
    m = base.kv.shape[1]
    exact = type(base)(values, values[1:, :m, 1:], dict(lens))
    fp8 = type(base)(stored, stored[1:, :m, 1:], dict(lens))
    return FP8Cache(fp8, exact, scales[1:].contiguous())


def _check_fp8_error(got: torch.Tensor, exact: torch.Tensor) -> None:
    """Attention over FP8 KV (``got``) within the FP8 bounds of the float64 attention over
    the values before quantisation (``exact``)."""
    err = (got.double() - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-6)
    assert float(err.max()) <= FP8_ROW_ERROR and float(err.mean()) <= FP8_MEAN_ROW_ERROR, (
        f"row error max {float(err.max()):.3f}, mean {float(err.mean()):.3f}")


def _decode_refs(cache: FP8Cache, q: torch.Tensor, slots: list[int], layer: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 references over the dequantised FP8 cache and over the exact values."""
    lens = [cache.fp8.lens.get(s, 0) for s in slots]
    scale = q.shape[-1] ** -0.5
    deq = decode_attention_reference(q, cache.fp8.kv, layer, slots, lens, scale,
                                     dtype=torch.float64, kv_scale=cache.scale(layer))
    exact = decode_attention_reference(q, cache.exact.kv, layer, slots, lens, scale,
                                       dtype=torch.float64)
    return deq, exact


DECODE_CONFIGS = {"reduce": DecodeConfig(), "fused": DecodeConfig(fused=True),
                  "tma": DecodeConfig(balanced=True, tma=True),
                  "cuda-route": DecodeConfig(block_n=64, num_warps=4, cuda=True)}


@grid({"config": DECODE_CONFIGS, "dtype": [torch.float32, torch.bfloat16], "group": [1, 4],
       "num_splits": [1, 4]},
      fast=[(DECODE_CONFIGS["reduce"], torch.float32, 1, 4),
            (DECODE_CONFIGS["fused"], torch.bfloat16, 4, 4),
            (DECODE_CONFIGS["tma"], torch.bfloat16, 1, 1),
            (DECODE_CONFIGS["cuda-route"], torch.float32, 4, 4)])  # each launch form once
def test_decode_reads_fp8(make_cache: MakeCache, check_close: CheckClose, dtype: torch.dtype,
                          group: int, config: DecodeConfig, num_splits: int) -> None:
    """The split-K decode kernel in each launch form (the CUDA kernel's route falls back to
    the Triton kernel of its tile for FP8) over an FP8 cache."""
    cache = _fp8_cache(make_cache, LENS, num_slots=5, max_tokens=MAX_TOKENS)
    slots = [1, 3, 0, 4]
    q = torch.randn(len(slots), 2 * group, 32).to(dtype)
    lens = [LENS[s] for s in slots]
    out = decode_attention(q, cache.fp8.kv, 1, torch.tensor(slots), torch.tensor(lens),
                           32 ** -0.5, num_splits=num_splits, config=config,
                           kv_scale=cache.scale(1))
    deq, exact = _decode_refs(cache, q, slots, 1)
    check_close(out, deq, dtype)
    _check_fp8_error(out, exact)


def test_decode_varlen_reads_fp8(make_cache: MakeCache, check_close: CheckClose) -> None:
    """A mixed batch's single-query rows: only their rows written, over the FP8 cache."""
    cache = _fp8_cache(make_cache, LENS, num_slots=5, max_tokens=MAX_TOKENS)
    q = torch.randn(6, 4, 32).to(torch.bfloat16)
    cu = torch.tensor([0, 1, 4, 5])  # single, three queries (skipped), single
    out = torch.full_like(q, float("nan"))
    decode_attention_varlen(q, cache.fp8.kv, 0, cu, torch.tensor([1, 0, 2]),
                            torch.tensor([200, 77, 150]), out, 32 ** -0.5, num_splits=3,
                            config=DecodeConfig(fused=True), kv_scale=cache.scale(0))
    deq, exact = _decode_refs(cache, q[[0, 4]], [1, 2], 0)
    check_close(out[[0, 4]], deq, torch.bfloat16)
    _check_fp8_error(out[[0, 4]], exact)
    assert out[1:4].isnan().all() and out[5].isnan().all()


@grid({"config": {"default": None, "small": SMALL, "ws": SMALL_WS},
       ("slot", "query_len"): [(1, 200), (0, 30), (2, 1)]},
      fast=[(None, (2, 1)), (SMALL, (0, 30)), (SMALL_WS, (1, 200))])  # each kernel once
def test_prefill_reads_fp8(make_cache: MakeCache, check_close: CheckClose,
                           config: PrefillConfig | None, slot: int, query_len: int) -> None:
    """The prefill kernels (plain, small tiles across the diagonal, warp-specialized with
    bf16 q over e4m3 descriptors) over an FP8 cache."""
    cache = _fp8_cache(make_cache, LENS, num_slots=5, max_tokens=MAX_TOKENS)
    q = torch.randn(query_len, 4, 32).to(torch.bfloat16)
    n = LENS[slot]
    out = prefill_attention(q, cache.fp8.kv, 1, slot, n, query_len, 0.2, config=config,
                            kv_scale=cache.scale(1))
    deq = prefill_attention_reference(q, cache.fp8.kv, 1, slot, n, 0.2, dtype=torch.float64,
                                      kv_scale=cache.scale(1))
    exact = prefill_attention_reference(q, cache.exact.kv, 1, slot, n, 0.2,
                                        dtype=torch.float64)
    check_close(out, deq, torch.bfloat16)
    _check_fp8_error(out, exact)


@pytest.mark.parametrize("config", [SMALL, SMALL_WS], ids=["small", "ws"])
def test_prefill_varlen_reads_fp8(make_cache: MakeCache, check_close: CheckClose,
                                  config: PrefillConfig,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed batch (its single-query row skipped); the warp-specialized config really
    launches the warp-specialized kernel over the FP8 cache."""
    kernels = sys.modules[prefill_attention_varlen.__module__]
    ws_launches: list[int] = []
    launch = kernels._launch_ws
    monkeypatch.setattr(kernels, "_launch_ws",
                        lambda *a, **k: (ws_launches.append(1), launch(*a, **k)))
    cache = _fp8_cache(make_cache, LENS, num_slots=5, max_tokens=MAX_TOKENS)
    seqs = [(1, 37), (3, 1), (0, 77), (2, 9)]  # (slot, query_len)
    qs = [torch.randn(ql, 4, 32).to(torch.bfloat16) for _, ql in seqs]
    cu = torch.tensor([0, 37, 38, 115, 124])
    out = prefill_attention_varlen(torch.cat(qs), cache.fp8.kv, 0, cu,
                                   torch.tensor([s for s, _ in seqs]),
                                   torch.tensor([LENS[s] for s, _ in seqs]), 0.2,
                                   config=config, skip_single=True, kv_scale=cache.scale(0))
    rows = [0, 2, 3]  # the multi-query sequences
    deq = torch.cat([prefill_attention_reference(qs[i], cache.fp8.kv, 0, seqs[i][0],
                                                 LENS[seqs[i][0]], 0.2, dtype=torch.float64,
                                                 kv_scale=cache.scale(0)) for i in rows])
    got = torch.cat([out[0:37], out[38:124]])
    check_close(got, deq, torch.bfloat16)
    assert bool(ws_launches) == config.warp_specialize


def _fp8_steps(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """How many e4m3 steps apart two FP8 tensors are, per element (NaN where both are)."""
    a, b = x.view(torch.uint8).to(torch.int32), ref.view(torch.uint8).to(torch.int32)
    # e4m3 bit patterns order like sign-magnitude integers
    sa = torch.where(a >= 128, -(a - 128), a)
    sb = torch.where(b >= 128, -(b - 128), b)
    return (sa - sb).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(7, 1, 32), (28, 4, 128)])
def test_rope_store_writes_fp8_as_write_kv(make_cache: MakeCache, dtype: torch.dtype, hq: int,
                                           hkv: int, d: int) -> None:
    """The fused RoPE + store writes each new token's k and v as `quantize_fp8` of the exact
    rotation (within one e4m3 step: the kernel rotates in float32) into exactly its cells,
    and rotates q as before."""
    lens = {0: 10, 2: 5}
    cache = _fp8_cache(make_cache, lens, num_slots=3, max_tokens=16, kv_heads=hkv,
                       head_dim=d)
    ref = _fp8_cache(make_cache, lens, num_slots=3, max_tokens=16, kv_heads=hkv, head_dim=d)
    meta = AttentionMetadata.build([2, 0], [2, 3], [7, 13])  # tokens 5..6 and 10..12
    assert meta.slot_index is not None and meta.token_index is not None
    q, k, v = fused_qkv(5, hq, hkv, d, dtype)
    k, v = k * 30, v * 0.02  # far from the scales' 1: the division matters
    cos, sin = rope_tables(meta.token_index.tolist(), d, dtype)
    got_q = rope_store_kv(q, k, v, cos, sin, cache.fp8.kv, 1, meta.slot_index,
                          meta.token_index, cache.scale(1))
    q64, k64 = rotary_qk(q.double(), k.double(), cos.double(), sin.double())
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_q.double(), q64, atol=atol, rtol=atol)
    write_kv(ref.fp8.kv, 1, k64, v, meta, cache.scale(1))
    steps = _fp8_steps(cache.fp8.backing, ref.fp8.backing)
    nan = cache.fp8.backing.float().isnan()
    assert torch.equal(nan, ref.fp8.backing.float().isnan())  # the same cells written
    assert int(steps[~nan].max()) <= 1
    assert float((steps[~nan] == 0).float().mean()) > 0.99


def test_rope_store_clamps_to_the_fp8_range(make_cache: MakeCache) -> None:
    """A value beyond 448 x its scale is stored as +-448, not as NaN."""
    cache = _fp8_cache(make_cache, {}, num_slots=1, max_tokens=4, kv_heads=1, head_dim=16)
    meta = AttentionMetadata.build([0], [1], [1])
    assert meta.slot_index is not None and meta.token_index is not None
    q, k, v = fused_qkv(1, 1, 1, 16, torch.float32)
    v = torch.full_like(v, 1e6)
    k = -v
    cos, sin = rope_tables([0], 16, torch.float32)  # position 0: no rotation
    rope_store_kv(q, k, v, cos, sin, cache.fp8.kv, 0, meta.slot_index, meta.token_index,
                  torch.ones(2, 1))
    stored = cache.fp8.kv[0, 0, 0].float()  # [2, 1, 16]
    assert (stored[0] == -FP8_MAX).all() and (stored[1] == FP8_MAX).all()


def test_kv_scale_is_checked(make_cache: MakeCache) -> None:
    cache = _fp8_cache(make_cache, {0: 5}, num_slots=1, max_tokens=8)
    q = torch.randn(1, 2, 32)
    ids = torch.tensor([0]), torch.tensor([5])
    with pytest.raises(KernelInputError, match="needs kv_scale"):
        decode_attention(q, cache.fp8.kv, 0, *ids, 0.2)
    with pytest.raises(KernelInputError, match="kv_scale must be"):
        decode_attention(q, cache.fp8.kv, 0, *ids, 0.2, kv_scale=torch.ones(2, 3))
    with pytest.raises(KernelInputError, match="kv_scale must be"):
        prefill_attention(q, cache.fp8.kv, 0, 0, 5, 1, 0.2,
                          kv_scale=torch.ones(2, 2, dtype=torch.float64))
    with pytest.raises(KernelInputError, match="must share"):
        decode_attention(q, cache.fp8.kv.view(torch.uint8), 0, *ids, 0.2)


# ---------------------------------------------------------------------------- the backends
SLOTS, BACKEND_TOKENS = 4, 64


def _model() -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(PRESETS["tiny"], max_positions=BACKEND_TOKENS).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.reset_buffers()
    cfg = model.cfg
    gen = torch.Generator().manual_seed(3)
    model.set_kv_scales(0.01 + torch.rand(cfg.num_layers, 2, cfg.num_kv_heads, generator=gen))
    return model


def _pass(model: CausalLM, backend: Any, cached: torch.Tensor, meta: AttentionMetadata,
          ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert meta.token_index is not None
    model.set_backend(backend)
    kv = cached.clone()
    with torch.inference_mode():
        return model(ids, meta.token_index, kv, meta), kv


@pytest.mark.parametrize("backend", ["triton", "fa4"])
@pytest.mark.parametrize("batch", [
    [(0, 20, 20), (1, 1, 9), (2, 5, 17)],  # prefill, decode, chunk
    [(1, 1, 9), (3, 1, 30)],  # decode only
])
def test_backends_over_fp8_match_sdpa(backend: str, batch: list[tuple[int, int, int]],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton backend (fused RoPE + FP8 store, decode, mixed batches) and the FA4 one
    over an FP8 cache against the reference SDPA backend over the same FP8 cache; the FA4
    backend never calls FA4 for FP8 KV (it takes the Triton prefill)."""
    def no_fa4(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("FA4 called with an FP8 cache")

    monkeypatch.setattr(edmm.kernels.fa4, "fa4_varlen_attention", no_fa4)
    configs: list[PrefillConfig] = []
    varlen = edmm.kernels.prefill_attention_varlen
    monkeypatch.setattr(edmm.kernels, "prefill_attention_varlen",
                        lambda *a, **k: (configs.append(k["config"]), varlen(*a, **k))[1])
    model = _model()
    cfg = model.cfg
    gen = torch.Generator().manual_seed(1)
    shape = (SLOTS, BACKEND_TOKENS, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    cached = torch.randn(shape, generator=gen).to(FP8_KV_DTYPE)
    slots, qlens, ctxs = ([b[i] for b in batch] for i in range(3))
    meta = AttentionMetadata.build(slots, qlens, ctxs)
    ids = torch.randint(0, cfg.vocab_size, (sum(qlens),), generator=gen)
    want = _pass(model, TorchSDPABackend(), cached, meta, ids)
    kernels = (FA4AttentionBackend(BACKEND_TOKENS) if backend == "fa4"
               else TritonAttentionBackend(BACKEND_TOKENS))
    got = _pass(model, kernels, cached, meta, ids)
    torch.testing.assert_close(got[0], want[0], atol=3e-2, rtol=3e-2)
    assert configs == ([PREFILL_FP8] * model.cfg.num_layers if 20 in meta.query_lens else [])
    # The new tokens' KV as write_kv stores it, within one e4m3 step (the reference rotates
    # in bf16, the kernel in float32: near-cancelling rotations round apart).
    torch.testing.assert_close(got[1].float(), want[1].float(), atol=2**-4, rtol=2**-3)
    assert float((_fp8_steps(got[1], want[1]) == 0).float().mean()) > 0.98


def test_sdpa_backend_reads_fp8_with_scales() -> None:
    """The reference backend over FP8 equals itself over the dequantised cache in the
    model's dtype (its write quantises, its read multiplies the scales back)."""
    model = _model()
    cfg = model.cfg
    assert model.kv_scales is not None
    gen = torch.Generator().manual_seed(2)
    shape = (2, BACKEND_TOKENS, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    cached = torch.randn(shape, generator=gen).to(FP8_KV_DTYPE)
    meta = AttentionMetadata.build([0, 1], [1, 4], [30, 12])
    ids = torch.randint(0, cfg.vocab_size, (5,), generator=gen)
    hidden, kv8 = _pass(model, TorchSDPABackend(), cached, meta, ids)
    scales = model.kv_scales
    plain = (kv8.float() * scales[None, None, :, :, :, None]).to(torch.bfloat16)
    model.set_kv_scales(None)  # a bf16 cache of the same values
    hidden16, _ = _pass(model, TorchSDPABackend(), plain, meta, ids)
    torch.testing.assert_close(hidden, hidden16, atol=3e-2, rtol=3e-2)
    written = kv8[1, 8:12].float()  # [4, L, 2, Hkv, D]: the new tokens, quantised
    assert written.isfinite().all() and written.abs().max() <= FP8_MAX
    assert not torch.equal(kv8[1, 8:12].view(torch.uint8), cached[1, 8:12].view(torch.uint8))
