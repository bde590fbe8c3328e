"""The Triton attention kernels on CUDA at Qwen2.5-7B sizes, reading a real VMM-backed arena.

Every slot maps pages only as far as its tokens reach, so a read past a context length beyond
the last mapped page is an illegal-address error; inside the last page, the tokens past each
context are NaN-poisoned, so a read there shows as NaN in the output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from edmm.kernels import (
    DecodeConfig,
    KernelInputError,
    PrefillConfig,
    decode_attention,
    decode_attention_varlen,
    prefill_attention,
    prefill_attention_varlen,
    silu_mul,
    triton_available,
)
from edmm.kernels._common import CounterWorkspace, decode_tma_usable
from edmm.kernels._cuda_decode import cuda_decode_usable
from edmm.kernels.fused_sdpa import (
    AttendLSE,
    cudnn_attend,
    cudnn_expanded_attend,
    end_aligned_by_parts,
)
from edmm.kernels.reference import decode_attention_reference, prefill_attention_reference
from edmm.memory import KVArena, KVSpec, PagePool
from edmm.memory.backends import open_backend
from edmm.model.attention_triton import PREFILL
from edmm.model.fusion import silu_mul as eager_silu_mul

# No triton import here: collecting this module must not import triton before
# tests/kernels/conftest.py sets TRITON_INTERPRET for the CPU kernel tests.
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled_kernels"),
              pytest.mark.skipif(not triton_available(), reason="the kernels need triton")]

SPEC = KVSpec(num_layers=28, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
NUM_HEADS = 28
SCALE = 128**-0.5
MAX_TOKENS = 16384
LENS = {0: 16384, 1: 4096, 2: 1, 3: 3001}  # slot -> tokens
LAYERS = (0, 13, 27)
REL_ERR = 1e-2  # bf16: error norm / reference norm, per output row (vs a float32 reference)


@pytest.fixture(scope="module")
def arena() -> Iterator[KVArena]:
    """A CUDA arena with slots of LENS tokens; random KV, NaN past each length in its last page.

    ``arena.kv`` is [slots, MAX_TOKENS, 28, 2, 4, 128], mapped only up to each slot's length.
    """
    backend = open_backend("cuda")
    pool = PagePool(backend, 700)  # LENS need 644 pages of 2 MiB
    arena = KVArena(pool, SPEC, num_slots=len(LENS), max_tokens=MAX_TOKENS)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for slot, n in LENS.items():
        assert arena.allocate() == slot
        arena.grow(slot, n)
        arena.kv[slot, :n].normal_(generator=gen)
        mapped = min(MAX_TOKENS, arena.pages_for(n) * arena.page_size // SPEC.token_bytes)
        arena.kv[slot, n:mapped].fill_(float("nan"))
    yield arena
    torch.cuda.synchronize()
    arena.close()
    pool.close()
    backend.close()


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def _capture(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of ``step`` (compiled and warmed up on a side stream first) and the
    output tensor its replays write."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def _assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 tolerance: no NaN, and each row's error norm within REL_ERR of its norm."""
    assert not got.isnan().any(), "NaN in the output: a read past a context length"
    err = (got.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-6)
    assert err.max().item() <= REL_ERR, f"relative row error {err.max().item():.2e}"


@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_matches_reference(arena: KVArena, num_splits: int | None) -> None:
    slots = [0, 1, 2, 3]
    lens = [LENS[s] for s in slots]
    q = torch.randn(len(slots), NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    for layer in LAYERS:
        out = decode_attention(q, arena.kv, layer, _ids(slots), _ids(lens), SCALE,
                               num_splits=num_splits, max_context=MAX_TOKENS)
        ref = decode_attention_reference(q, arena.kv, layer, slots, lens, SCALE, torch.float32)
        _assert_close(out, ref)


def test_decode_batch_of_one_long_context(arena: KVArena) -> None:
    q = torch.randn(1, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    out = decode_attention(q, arena.kv, 5, _ids([0]), _ids([LENS[0]]), SCALE)
    ref = decode_attention_reference(q, arena.kv, 5, [0], [LENS[0]], SCALE, torch.float32)
    _assert_close(out, ref)


def test_decode_cuda_graph_replays_with_new_lengths(arena: KVArena) -> None:
    """Captured once with static max_context; replays follow the lengths written in place."""
    slots, lens = _ids([0, 1, 3, 2]), _ids([16384, 4096, 3001, 1])
    q = torch.randn(4, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        return decode_attention(q, arena.kv, 13, slots, lens, SCALE, max_context=MAX_TOKENS)

    graph, out = _capture(step)
    for new_lens in ([16384, 4096, 3001, 1], [9000, 17, 3001, 1], [1, 4095, 2000, 1]):
        lens.copy_(_ids(new_lens))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())
        ref = decode_attention_reference(q, arena.kv, 13, [0, 1, 3, 2], new_lens, SCALE,
                                         torch.float32)
        _assert_close(out, ref)


# The split kernel merging its splits itself (over 256 splits too), with and without
# programmatic dependent launch and the L2 prefetch, and the two-launch kernel with them.
FUSED_DECODE = [(96, DecodeConfig(64, 2, 3, fused=True, pdl=True)),
                (300, DecodeConfig(32, 2, 3, fused=True)),
                (64, DecodeConfig(32, 2, 3, pdl=True)),
                (16, DecodeConfig(128, 8, 3, fused=True, pdl=True)),
                (64, DecodeConfig(64, 2, 3, pdl=True, prefetch=True)),
                (7, DecodeConfig(64, 4, 3, prefetch=True)),
                (16, DecodeConfig(128, 8, 3, fused=True, pdl=True, prefetch=True)),
                # the fused merge over many splits with few threads, and first-tiles prefetch
                (64, DecodeConfig(64, 2, 3, fused=True, pdl=True)),
                (33, DecodeConfig(64, 4, 3, fused=True, pdl=True, prefetch=True,
                                  prefetch_tiles=1)),
                (64, DecodeConfig(64, 2, 3, pdl=True, prefetch=True, prefetch_tiles=2)),
                (132, DecodeConfig(32, 4, 3, fused=True, pdl=True, prefetch=True,
                                   prefetch_tiles=2)),
                # early launch: the next kernel launches as soon as this one starts
                (64, DecodeConfig(64, 2, 4, pdl=True, early_launch=True)),
                (64, DecodeConfig(64, 2, 4, pdl=True, early_launch=True, prefetch=True,
                                  prefetch_tiles=1)),
                (32, DecodeConfig(64, 4, 4, fused=True, pdl=True, early_launch=True,
                                  prefetch=True, prefetch_tiles=2)),
                # balanced splits (multiples of 132 SMs over 4 KV heads), TMA full tiles
                (66, DecodeConfig(64, 2, 3, pdl=True, balanced=True)),
                (66, DecodeConfig(64, 2, 3, pdl=True, balanced=True, tma=True)),
                (33, DecodeConfig(32, 2, 4, pdl=True, tma=True)),
                (64, DecodeConfig(64, 2, 3, tma=True)),
                (132, DecodeConfig(64, 4, 3, fused=True, pdl=True, balanced=True, tma=True)),
                (99, DecodeConfig(32, 2, 5, pdl=True, prefetch=True, prefetch_tiles=1,
                                  balanced=True, tma=True)),
                # the merge over head-dim slices (4 of 32 columns at 64 splits, 8 of 16 at 128)
                (64, DecodeConfig(64, 2, 3, pdl=True, sliced_reduce=True)),
                (128, DecodeConfig(32, 2, 3, sliced_reduce=True)),
                # the CUDA C++ split kernel (one split: it writes the output itself)
                (64, DecodeConfig(64, 4, 3, pdl=True, sliced_reduce=True, cuda=True)),
                (1, DecodeConfig(32, 2, 4, cuda=True)),
                (7, DecodeConfig(128, 8, 2, pdl=True, cuda=True)),
                (200, DecodeConfig(16, 1, 5, cuda=True)),
                # ... merging its splits in a thread-block cluster (16: a non-portable size)
                (16, DecodeConfig(64, 4, 2, pdl=True, cuda=True, cluster=True)),
                (8, DecodeConfig(64, 4, 3, cuda=True, cluster=True)),
                (5, DecodeConfig(32, 2, 3, pdl=True, cuda=True, cluster=True))]


def test_arena_layers_take_tma_loads(arena: KVArena) -> None:
    """The arena's layer views meet TMA's rules on the GPU: the ``tma`` configs above really
    load through a descriptor (a view with a gap between heads does not)."""
    assert all(decode_tma_usable(arena.kv[:, :, layer]) for layer in LAYERS)
    assert not decode_tma_usable(arena.kv[:, :, 0, :, ::2])


def test_cuda_decode_kernel_runs_here(arena: KVArena) -> None:
    """The ``cuda`` configs above really run the CUDA C++ kernel on this machine (a config it
    cannot take falls back to the Triton kernel of the same tile)."""
    q = torch.empty(1, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    assert cuda_decode_usable(q, arena.kv[:, :, LAYERS[0]]) is None


def test_cuda_decode_refuses_rings_past_shared_memory(arena: KVArena) -> None:
    """8 warps x 4 stages of 8 KB rings exceed what a CTA may have: a typed error, not a
    failed launch (and nothing falls back silently)."""
    q = torch.randn(1, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="shared memory"):
        decode_attention(q, arena.kv, 0, _ids([0]), _ids([LENS[0]]), SCALE, num_splits=8,
                         config=DecodeConfig(128, 8, 4, cuda=True))
    with pytest.raises(KernelInputError, match="cluster"):  # more splits than a cluster
        decode_attention(q, arena.kv, 0, _ids([0]), _ids([LENS[0]]), SCALE, num_splits=17,
                         config=DecodeConfig(64, 4, 2, cuda=True, cluster=True))


@pytest.mark.parametrize("cluster", [False, True])
def test_cuda_decode_varlen_int64_ids(arena: KVArena, cluster: bool) -> None:
    """A packed batch through the CUDA kernel, int64 metadata: the single-query rows are
    attended, the rows of a four-query sequence are left as they were."""
    cu = torch.tensor([0, 1, 5, 6], dtype=torch.int64, device="cuda")
    slots, lens = [0, 1, 3], [16384, 4096, 3001]
    q = torch.randn(6, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, 7.0)
    decode_attention_varlen(q, arena.kv, 27, cu, torch.tensor(slots, device="cuda"),
                            torch.tensor(lens, device="cuda"), out, SCALE,
                            num_splits=16 if cluster else 32,
                            config=DecodeConfig(64, 4, 3, pdl=True, cuda=True, cluster=cluster))
    ref = decode_attention_reference(q[[0, 5]], arena.kv, 27, [0, 3], [16384, 3001], SCALE,
                                     torch.float32)
    _assert_close(out[[0, 5]], ref)
    assert bool((out[1:5] == 7.0).all())


@pytest.mark.parametrize(("dtype", "heads", "dim"), [(torch.float16, 32, 64),
                                                      (torch.bfloat16, 64, 128)])
def test_cuda_decode_other_shapes(dtype: torch.dtype, heads: int, dim: int) -> None:
    """fp16, head dim 64 and 8 or 16 query heads per KV head (a full mma tile), against the
    float32 reference, on a plain (not arena) cache."""
    kv = torch.randn(2, 5000, 2, 2, 4, dim, device="cuda", dtype=dtype)  # [S, M, L, 2, Hkv, D]
    q = torch.randn(2, heads, dim, device="cuda", dtype=dtype)
    assert cuda_decode_usable(q, kv[:, :, 1]) is None
    lens = [4999, 77]
    for splits in (1, 16):
        out = decode_attention(q, kv, 1, _ids([1, 0]), _ids(lens), dim**-0.5, num_splits=splits,
                               config=DecodeConfig(64, 4, 3, cuda=True))
        ref = decode_attention_reference(q, kv, 1, [1, 0], lens, dim**-0.5, torch.float32)
        _assert_close(out, ref)


@pytest.mark.parametrize(("num_splits", "config"), FUSED_DECODE)
def test_fused_and_pdl_decode_in_cuda_graph(arena: KVArena, num_splits: int,
                                             config: DecodeConfig) -> None:
    """A graph of three layers' decode, one workspace, replayed with new lengths and
    queries: every replay matches the reference (the counters end each launch at zero, the
    early-launched programs read q and KV only after the kernel before them)."""
    slots, lens = _ids([0, 1, 3, 2]), _ids([16384, 4096, 3001, 1])
    q = torch.randn(4, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    ws = CounterWorkspace()

    def step() -> torch.Tensor:
        outs = [decode_attention(q, arena.kv, layer, slots, lens, SCALE, num_splits=num_splits,
                                 config=config, workspace=ws) for layer in LAYERS]
        return torch.stack(outs)  # [layers, B, Hq, D]

    graph, out = _capture(step)
    for new_lens in ([16384, 4096, 3001, 1], [9000, 17, 3001, 1], [1, 4095, 2000, 0]):
        lens.copy_(_ids(new_lens))
        q.copy_(torch.randn_like(q))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert not ws.counters(1, q.device).any()
        first = out.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)  # the merge adds in a fixed order: bitwise repeatable
        for i, layer in enumerate(LAYERS):
            ref = decode_attention_reference(q, arena.kv, layer, [0, 1, 3, 2], new_lens, SCALE,
                                             torch.float32)
            _assert_close(out[i, :3], ref[:3])
            if new_lens[3]:
                _assert_close(out[i, 3:], ref[3:])
            else:
                assert not out[i, 3].any()  # empty context: zeros


CONFIGS = [None, PrefillConfig(reverse=True),
           PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
           PREFILL,
           PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=2,
                         warp_specialize=True)]
CONFIG_IDS = ["default", "reverse", "64x64", "backend", "warp-spec-64"]
WS_CONFIGS = 3  # CONFIGS[3:] are warp-specialized


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize(("slot", "query_len"), [(0, 512), (1, 512), (1, 4096), (3, 1000),
                                                 (2, 1)])
def test_prefill_matches_reference(arena: KVArena, slot: int, query_len: int,
                                   config: PrefillConfig | None) -> None:
    """No key at or past the context is read: one past the mapped pages would fault, one in
    the NaN-poisoned rows would show."""
    q = torch.randn(query_len, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    for layer in (0, 27):
        out = prefill_attention(q, arena.kv, layer, slot, LENS[slot], query_len, SCALE,
                                config=config)
        ref = prefill_attention_reference(q, arena.kv, layer, slot, LENS[slot], SCALE,
                                          torch.float32)
        _assert_close(out, ref)


@pytest.mark.parametrize("attend", [cudnn_attend, cudnn_expanded_attend],
                         ids=["cudnn-gqa", "cudnn-expanded"])
@pytest.mark.parametrize(("slot", "query_len"), [(0, 512), (0, 16384), (1, 4096), (3, 1000)])
def test_cudnn_by_parts_on_the_arena(arena: KVArena, slot: int, query_len: int,
                                     attend: AttendLSE) -> None:
    """cuDNN's attention on the arena's strided views, end-aligned by parts, reads no key at
    or past the context (NaN-poisoned rows would show) and matches the reference."""
    q = torch.randn(query_len, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    n = LENS[slot]
    for layer in (0, 27):
        kv = arena.kv[slot, :n, layer]  # [n, 2, Hkv, D] view
        k, v = (kv[:, i].transpose(0, 1)[None] for i in (0, 1))  # [1, Hkv, n, D]
        out = end_aligned_by_parts(q.transpose(0, 1)[None], k, v, SCALE, attend)
        ref = prefill_attention_reference(q, arena.kv, layer, slot, n, SCALE, torch.float32)
        _assert_close(out[0].transpose(0, 1), ref)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_prefill_varlen_matches_reference(arena: KVArena, config: PrefillConfig | None) -> None:
    seqs = [(0, 512), (2, 1), (3, 1000), (1, 77)]  # (slot, query_len)
    qs = [torch.randn(n, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16) for _, n in seqs]
    cu = [0]
    for _, n in seqs:
        cu.append(cu[-1] + n)
    out = prefill_attention_varlen(
        torch.cat(qs), arena.kv, 7, _ids(cu), _ids([s for s, _ in seqs]),
        _ids([LENS[s] for s, _ in seqs]), scale=SCALE, config=config)
    ref = torch.cat([prefill_attention_reference(q, arena.kv, 7, s, LENS[s], SCALE, torch.float32)
                     for q, (s, _) in zip(qs, seqs, strict=True)])
    _assert_close(out, ref)


@pytest.mark.parametrize("config", CONFIGS[WS_CONFIGS:], ids=CONFIG_IDS[WS_CONFIGS:])
def test_warp_specialized_prefill_random_batches(arena: KVArena, config: PrefillConfig) -> None:
    """Twenty varlen batches of random query and context lengths (single queries skipped, as
    the backend runs them) against the reference, every row of every batch."""
    gen = torch.Generator().manual_seed(0)
    bad = []
    for trial in range(20):
        seqs = []
        for slot in torch.randperm(4, generator=gen)[:3].tolist():
            ctx = int(torch.randint(1, LENS[slot] + 1, (1,), generator=gen))
            seqs.append((slot, ctx, int(torch.randint(1, min(ctx, 1500) + 1, (1,), generator=gen))))
        cu = [0]
        for _, _, n in seqs:
            cu.append(cu[-1] + n)
        q = torch.randn(cu[-1], NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
        out = prefill_attention_varlen(q, arena.kv, trial % 28, _ids(cu),
                                       _ids([s for s, _, _ in seqs]),
                                       _ids([c for _, c, _ in seqs]), scale=SCALE,
                                       config=config, skip_single=True)
        for (slot, ctx, n), a in zip(seqs, cu, strict=False):
            if n == 1:
                continue
            ref = prefill_attention_reference(q[a:a + n], arena.kv, trial % 28, slot, ctx, SCALE,
                                              torch.float32)
            got = out[a:a + n].float()
            err = (got - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-6)
            if got.isnan().any() or err.max().item() > REL_ERR:
                bad.append((trial, slot, ctx, n, got.isnan().sum().item(), err.max().item()))
    assert not bad, f"(trial, slot, context, queries, NaNs, max row error): {bad}"


def test_warp_specialized_prefill_in_cuda_graph(arena: KVArena) -> None:
    """The kernel makes its descriptors on the device in scratch the capture allocates; replays
    with new lengths (a new key bound for every descriptor) match the reference."""
    qlens = [512, 77]
    q = torch.randn(sum(qlens), NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    cu, slots, lens = _ids([0, 512, 589]), _ids([0, 3]), _ids([16384, 3001])

    def step() -> torch.Tensor:
        return prefill_attention_varlen(q, arena.kv, 27, cu, slots, lens, scale=SCALE,
                                        config=PREFILL)

    graph, out = _capture(step)
    for new_lens in ([16384, 3001], [600, 1000], [9000, 78]):
        lens.copy_(_ids(new_lens))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.cat([prefill_attention_reference(q[a:b], arena.kv, 27, s, n, SCALE,
                                                     torch.float32)
                         for (a, b), s, n in zip([(0, 512), (512, 589)], [0, 3], new_lens,
                                                 strict=True)])
        _assert_close(out, ref)


def test_padded_strided_tensor_cache() -> None:
    """A plain tensor sliced from a NaN-padded one: storage offset and padded strides."""
    backing = torch.full((3, 4200, 29, 2, 4, 128), float("nan"), dtype=torch.bfloat16,
                         device="cuda")
    kv = backing[1:, :4096, 1:]  # [2, 4096, 28, 2, 4, 128]
    lens = [4096, 2500]
    for slot, n in enumerate(lens):
        kv[slot, :n].normal_()
    q = torch.randn(2, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    out = decode_attention(q, kv, 3, _ids([1, 0]), _ids(lens[::-1]), SCALE)
    _assert_close(out, decode_attention_reference(q, kv, 3, [1, 0], lens[::-1], SCALE,
                                                  torch.float32))
    qp = torch.randn(512, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    out = prefill_attention(qp, kv, 3, 1, 2500, 512, SCALE)
    _assert_close(out, prefill_attention_reference(qp, kv, 3, 1, 2500, SCALE, torch.float32))


def test_silu_mul_rounds_as_eager() -> None:
    """bf16 at Qwen2.5-7B's width: the kernel's roundings are eager PyTorch's."""
    x = torch.randn(300, 2 * 18944, device="cuda", dtype=torch.bfloat16) * 3
    out, ref = silu_mul(x), eager_silu_mul(x)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    assert (out == ref).float().mean().item() > 0.999
