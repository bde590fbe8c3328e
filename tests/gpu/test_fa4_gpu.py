"""FlashAttention-4 over a real VMM arena at Qwen2.5-7B head sizes, against SDPA (float32).

The arena maps each slot up to its length rounded up to FA4's key tile (``read_align``), the
margin past each length holds finite values (FA4 loads whole tiles: P = 0 times a NaN row would
still be NaN), and past the margin, inside the last mapped page, NaN: a read beyond the tile FA4
is allowed to load shows as NaN in the output, one beyond the mapped pages as an illegal
address. Skipped where FA4 does not import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from edmm.kernels import triton_available
from edmm.kernels.fa4 import FA4_KV_TILE, fa4_usable, fa4_varlen_args, fa4_varlen_attention
from edmm.kernels.reference import prefill_attention_reference
from edmm.memory import KVArena, KVSpec, PagePool
from edmm.memory.backends import open_backend
from edmm.model.attention import AttentionMetadata, TorchSDPABackend

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled_kernels"),
              pytest.mark.skipif(not torch.cuda.is_available() or not fa4_usable("cuda"),
                                 reason="FA4 (flash_attn.cute) not importable on this GPU")]

SPEC = KVSpec(num_layers=28, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
NUM_HEADS = 28
SCALE = 128**-0.5
MAX_TOKENS = 8192
LENS = {0: 8192, 1: 3001, 2: 1, 3: 700, 4: 129, 5: 2048}  # slot -> tokens
REL_ERR = 1e-2  # bf16: error norm / reference norm, per output row


@pytest.fixture(scope="module")
def arena() -> Iterator[KVArena]:
    """Slots of LENS tokens (random KV), zeros up to FA4's tile, NaN after it in the mapped
    pages. ``arena.kv`` is [slots, MAX_TOKENS, 28, 2, 4, 128]."""
    backend = open_backend("cuda")
    pool = PagePool(backend, 500)
    arena = KVArena(pool, SPEC, num_slots=len(LENS), max_tokens=MAX_TOKENS,
                    read_align=FA4_KV_TILE)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for slot, n in LENS.items():
        assert arena.allocate() == slot
        arena.grow(slot, n)
        arena.kv[slot, :n].normal_(generator=gen)
        tile_end = min(MAX_TOKENS, -(-n // FA4_KV_TILE) * FA4_KV_TILE)
        mapped = min(MAX_TOKENS, arena.pages_for(n) * arena.page_size // SPEC.token_bytes)
        arena.kv[slot, n:tile_end].zero_()
        arena.kv[slot, tile_end:mapped].fill_(float("nan"))
    yield arena
    torch.cuda.synchronize()
    arena.close()
    pool.close()
    backend.close()


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device="cuda")


def _capture(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of ``step`` (run twice on a side stream first: FA4 compiles there)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def _row_errors(out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, layer: int,
                seqs: list[tuple[int, int, int]], skip_single: bool) -> list[tuple]:
    """(slot, context, queries, NaNs, max row error) of each sequence (slot, context,
    queries) of the packed ``q`` whose rows miss the reference."""
    bad = []
    start = 0
    for slot, ctx, n in seqs:
        rows = slice(start, start + n)
        start += n
        if n == 0 or (skip_single and n == 1):
            continue
        ref = prefill_attention_reference(q[rows], kv, layer, slot, ctx, SCALE, torch.float32)
        got = out[rows].float()
        err = (got - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1).clamp_min(1e-6)
        if got.isnan().any() or err.max().item() > REL_ERR:
            bad.append((slot, ctx, n, int(got.isnan().sum()), err.max().item()))
    return bad


def _packed(seqs: list[tuple[int, int, int]], pad_rows: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T + pad_rows, Hq, D] and the varlen tensors (query starts, slots, contexts)."""
    cu = [0]
    for _, _, n in seqs:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1] + pad_rows, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    return q, _ids(cu), _ids([s for s, _, _ in seqs]), _ids([c for _, c, _ in seqs])


@pytest.mark.parametrize("skip_single", [False, True])
def test_fa4_varlen_batches_match_sdpa(arena: KVArena, skip_single: bool) -> None:
    """Random batches (several sequences, mixed query lengths, single-query rows, lengths off
    the tile) against the reference, every computed row."""
    gen = torch.Generator().manual_seed(0)
    bad = []
    for trial in range(12):
        seqs = []
        for slot in torch.randperm(len(LENS), generator=gen)[:4].tolist():
            ctx = int(torch.randint(1, LENS[slot] + 1, (1,), generator=gen))
            n = 1 if trial % 3 == 0 and slot % 2 else int(
                torch.randint(1, min(ctx, 1200) + 1, (1,), generator=gen))
            seqs.append((slot, ctx, n))
        q, cu, slots, ctxs = _packed(seqs)
        args = fa4_varlen_args(cu, slots, ctxs, len(LENS), skip_single=skip_single)
        out = fa4_varlen_attention(q, arena.kv, trial % 28, args, SCALE)
        bad += [(trial, *b) for b in _row_errors(out, q, arena.kv, trial % 28, seqs,
                                                 skip_single)]
    assert not bad, f"(trial, slot, context, queries, NaNs, max row error): {bad}"


def test_fa4_padding_sequences_and_rows(arena: KVArena) -> None:
    """A CUDA graph's padding: sequences with no queries on a shared pad slot (slot 2, one
    token), and rows past the last sequence: the real rows still match."""
    seqs = [(0, 8192, 512), (3, 700, 33), (2, 1, 0), (2, 1, 0)]
    q, cu, slots, ctxs = _packed(seqs, pad_rows=40)
    args = fa4_varlen_args(cu, slots, ctxs, len(LENS), skip_single=True)
    out = fa4_varlen_attention(q, arena.kv, 5, args, SCALE)
    assert out.shape == q.shape
    assert not _row_errors(out, q, arena.kv, 5, seqs, skip_single=True)


def test_fa4_in_cuda_graph_replays_new_lengths(arena: KVArena) -> None:
    """Captured once at 600 tokens and 4 sequences (the argument build inside the graph),
    replayed with other query splits, contexts and single-query rows."""
    tokens, batch = 600, 4
    q = torch.zeros(tokens, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    cu, slots, ctxs = _ids([0] * (batch + 1)), _ids([2] * batch), _ids([1] * batch)

    def step() -> torch.Tensor:
        args = fa4_varlen_args(cu, slots, ctxs, len(LENS), skip_single=True)
        return fa4_varlen_attention(q, arena.kv, 11, args, SCALE)

    loads = [[(0, 8192, 500), (1, 3001, 1), (3, 700, 99)],
             [(5, 2048, 129), (4, 129, 129), (1, 2000, 300), (0, 4000, 42)],
             [(3, 650, 600)]]
    for i, seqs in enumerate(loads):
        new_q, new_cu, new_slots, new_ctxs = _packed(seqs)
        t, b = new_q.shape[0], len(seqs)
        q[:t].copy_(new_q)
        cu[:b + 1].copy_(new_cu)
        cu[b + 1:].fill_(t)
        slots[:b].copy_(new_slots)
        slots[b:].fill_(2)
        ctxs[:b].copy_(new_ctxs)
        ctxs[b:].fill_(1)
        if i == 0:
            graph, out = _capture(step)
        graph.replay()
        torch.cuda.synchronize()
        assert not _row_errors(out[:t], q[:t], arena.kv, 11, seqs, skip_single=True), seqs


@pytest.mark.skipif(not triton_available(), reason="decode rows need triton")
@pytest.mark.parametrize("captured", [False, True])
def test_fa4_backend_mixed_batch_matches_sdpa_backend(arena: KVArena, captured: bool) -> None:
    """The backend on a mixed batch (prefill chunks and decode rows), eager and in a CUDA
    graph with placeholder lists, against the reference backend: every row (the decode rows
    come from the Triton kernel)."""
    from edmm.model.attention_fa4 import FA4AttentionBackend

    seqs = [(0, 8192, 256), (1, 3001, 1), (3, 700, 77), (5, 2048, 1)]
    slots, qlens = [s for s, _, _ in seqs], [n for _, _, n in seqs]
    ctxs = [c for _, c, _ in seqs]
    meta = AttentionMetadata.build(slots, qlens, ctxs, "cuda")
    t = sum(qlens)
    q = torch.randn(t, NUM_HEADS, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, 4, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, 4, 128, device="cuda", dtype=torch.bfloat16)
    layer = 20
    ref = TorchSDPABackend().forward(q.float(), k.float(), v.float(),
                                     _float_copy(arena, meta, layer), 0, meta, SCALE, None)
    backend = FA4AttentionBackend(MAX_TOKENS)
    if captured:
        static = AttentionMetadata(slots, qlens, ctxs, slot_index=meta.slot_index,
                                   token_index=meta.token_index, slot_ids_t=meta.slot_ids_t,
                                   context_lens_t=meta.context_lens_t,
                                   query_start_loc=meta.query_start_loc,
                                   placeholder_lists=True)
        graph, out = _capture(lambda: backend.forward(q, k, v, arena.kv, layer, static, SCALE,
                                                      None))
        graph.replay()
        torch.cuda.synchronize()
    else:
        out = backend.forward(q, k, v, arena.kv, layer, meta, SCALE, None)
    err = (out.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)
    assert not out.isnan().any()
    assert err.max().item() <= REL_ERR, err.max().item()


def _float_copy(arena: KVArena, meta: AttentionMetadata, layer: int) -> torch.Tensor:
    """A float32 copy of ``layer`` of the tokens ``meta`` reads, as a one-layer cache
    [slots, MAX_TOKENS, 1, 2, 4, 128] (zeros elsewhere), for the reference backend to write
    into (it must not write the arena the FA4 call reads after it)."""
    shape = (arena.num_slots, MAX_TOKENS, 1, 2, SPEC.num_kv_heads, SPEC.head_dim)
    kv = torch.zeros(shape, dtype=torch.float32, device="cuda")
    for slot, ctx in zip(meta.slot_ids, meta.context_lens, strict=True):
        kv[slot, :ctx, 0] = arena.kv[slot, :ctx, layer].float()
    return kv
