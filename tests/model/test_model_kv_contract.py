"""The kv_cache contract: strided views, untouched memory, metadata validation."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples
from torch import Tensor

from edmm.model import (
    AttentionMetadata,
    AttentionMetadataError,
    CausalLM,
    ContextTooLongError,
    KVCacheError,
    ModelConfig,
    ModelError,
    load_model,
)

SLOTS, MAX_TOKENS = 4, 48
# (slot, prompt length, decode steps); slots 0 stays unused
SEQS = [(2, 13, 6), (1, 5, 6), (3, 20, 6)]


@pytest.fixture(scope="module")
def tiny() -> tuple[CausalLM, ModelConfig]:
    return load_model("tiny", "cpu", torch.float32, max_positions=256)


def contract_shape(cfg: ModelConfig) -> tuple[int, ...]:
    return (SLOTS, MAX_TOKENS, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)


def plain(cfg: ModelConfig) -> Tensor:
    return torch.full(contract_shape(cfg), float("nan"))


def layer_major(cfg: ModelConfig) -> Tensor:
    """Storage [L, 2, S, M, H, D] (vLLM-like) permuted to the contract's order."""
    s, m, layers, two, h, d = contract_shape(cfg)
    return torch.full((layers, two, s, m, h, d), float("nan")).permute(2, 3, 0, 1, 4, 5)


def padded(cfg: ModelConfig) -> Tensor:
    """Slice of a bigger tensor: 7 spare tokens per slot, 3 spare values per head."""
    s, m, layers, two, h, d = contract_shape(cfg)
    return torch.full((s, m + 7, layers, two, h, d + 3), float("nan"))[:, :m, :, :, :, :d]


def as_strided_gappy(cfg: ModelConfig) -> Tensor:
    """``as_strided`` over a flat buffer with a gap between slots (like the VMM arena)."""
    s, m, layers, two, h, d = contract_shape(cfg)
    token = layers * two * h * d
    slot_stride = m * token + 1000
    flat = torch.full((s * slot_stride,), float("nan"))
    strides = (slot_stride, token, two * h * d, h * d, d, 1)
    return torch.as_strided(flat, contract_shape(cfg), strides)


def generate(model: CausalLM, kv: Tensor) -> list[Tensor]:
    """Batched prefill of all SEQS, then batched greedy decode steps; logits per step."""
    prompts = {
        s: torch.randint(9, 1024, (n,), generator=torch.Generator().manual_seed(s))
        for s, n, _ in SEQS
    }
    ctx = {s: 0 for s, _, _ in SEQS}
    new = {s: prompts[s] for s, _, _ in SEQS}
    history: list[Tensor] = []
    for _ in range(SEQS[0][2] + 1):
        slots = [s for s, _, _ in SEQS]
        ids = torch.cat([new[s] for s in slots])
        pos = torch.cat([torch.arange(ctx[s], ctx[s] + len(new[s])) for s in slots])
        meta = AttentionMetadata.build(
            slots, [len(new[s]) for s in slots], [ctx[s] + len(new[s]) for s in slots]
        )
        hidden = model(ids, pos, kv, meta)
        assert meta.last_token_index is not None
        logits = model.compute_logits(hidden[meta.last_token_index])  # [B, V]
        history.append(logits)
        for i, s in enumerate(slots):
            ctx[s] += len(new[s])
            new[s] = logits[i].argmax().view(1)
    return history


@pytest.mark.parametrize("make", [layer_major, padded, as_strided_gappy])
def test_strided_views_match_plain_and_leave_the_rest_untouched(
    tiny: tuple[CausalLM, ModelConfig], make: Callable[[ModelConfig], Tensor]
) -> None:
    model, cfg = tiny
    ref_kv, kv = plain(cfg), make(cfg)
    assert not kv.is_contiguous()
    base = kv._base if kv._base is not None else kv
    ref = generate(model, ref_kv)
    got = generate(model, kv)
    for a, b in zip(ref, got, strict=True):
        assert not b.isnan().any()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    written = torch.zeros(SLOTS, MAX_TOKENS, dtype=torch.bool)
    for s, n, steps in SEQS:
        written[s, : n + steps] = True
    assert not kv[written].isnan().any()
    assert kv[~written].isnan().all()  # never written, and NaN never leaked into outputs
    torch.testing.assert_close(kv[written], ref_kv[written], atol=1e-5, rtol=1e-5)
    # memory outside the view (padding / gaps) is untouched too
    assert base.isnan().sum() == base.numel() - written.sum() * kv[0, 0].numel()


def test_deterministic_mode_uses_slice_writes(tiny: tuple[CausalLM, ModelConfig]) -> None:
    model, cfg = tiny
    ref = generate(model, plain(cfg))
    torch.use_deterministic_algorithms(True)
    try:
        got = generate(model, padded(cfg))
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


_UNMAPPED_SCRIPT = textwrap.dedent(
    """
    import ctypes, mmap, torch
    from edmm.model import AttentionMetadata, load_model

    PAGE = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    model, cfg = load_model("tiny", "cpu", torch.float32, max_positions=256)
    S, M = 4, 64
    token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim  # floats per token
    slot_bytes = -(-M * token * 4 // PAGE) * PAGE
    buf = mmap.mmap(-1, S * slot_bytes)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    flat = torch.frombuffer(buf, dtype=torch.float32)
    kv = torch.as_strided(flat, (S, M, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim),
                          (slot_bytes // 4, token, token // cfg.num_layers,
                           cfg.num_kv_heads * cfg.head_dim, cfg.head_dim, 1))

    def protect(slot, first_token, prot):
        lo = slot * slot_bytes + -(-first_token * token * 4 // PAGE) * PAGE
        hi = (slot + 1) * slot_bytes
        if hi > lo:
            assert libc.mprotect(addr + lo, hi - lo, prot) == 0

    for s in range(S):
        protect(s, 0, 0)  # PROT_NONE: any access segfaults

    def backed(slot, ctx):  # map exactly the pages holding tokens < ctx
        protect(slot, 0, mmap.PROT_READ | mmap.PROT_WRITE)
        protect(slot, ctx, 0)

    ids = {1: list(range(30, 47)), 3: list(range(100, 105))}
    ctx = {1: 0, 3: 0}
    for step in range(8):
        slots = [1, 3]
        new = {s: ids[s][ctx[s]:] for s in slots}
        for s in slots:
            backed(s, ctx[s] + len(new[s]))
        meta = AttentionMetadata.build(slots, [len(new[s]) for s in slots],
                                       [ctx[s] + len(new[s]) for s in slots])
        inp = torch.tensor([t for s in slots for t in new[s]])
        pos = torch.cat([torch.arange(ctx[s], ctx[s] + len(new[s])) for s in slots])
        logits = model.compute_logits(model(inp, pos, kv, meta)[meta.last_token_index])
        for i, s in enumerate(slots):
            ctx[s] += len(new[s])
            ids[s].append(int(logits[i].argmax()))
    print("OK", ids[1][-8:], ids[3][-8:])
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="mprotect test is Linux-only")
@pytest.mark.slow  # a subprocess; fast tier: the NaN-poisoned views above
def test_never_touches_unmapped_memory() -> None:
    """Runs on a kv_cache whose unbacked tokens are PROT_NONE pages (segfault on access)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _UNMAPPED_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert proc.stdout.startswith("OK")


def test_metadata_validation() -> None:
    with pytest.raises(AttentionMetadataError):
        AttentionMetadata([0, 1], [1], [1, 2])
    with pytest.raises(AttentionMetadataError):
        AttentionMetadata([0], [3], [2])  # more new tokens than context
    with pytest.raises(AttentionMetadataError):
        AttentionMetadata([0], [0], [2])
    with pytest.raises(AttentionMetadataError):
        AttentionMetadata([1, 1], [1, 1], [1, 1])
    meta = AttentionMetadata.build([5, 2], [3, 1], [3, 9])
    assert meta.num_tokens == 4 and meta.num_seqs == 2
    assert meta.slot_index is not None and meta.token_index is not None
    assert meta.slot_index.tolist() == [5, 5, 5, 2]
    assert meta.token_index.tolist() == [0, 1, 2, 8]
    assert meta.last_token_index is not None and meta.last_token_index.tolist() == [2, 3]
    assert meta.slot_ids_t is not None and meta.slot_ids_t.tolist() == [5, 2]
    assert meta.context_lens_t is not None and meta.context_lens_t.tolist() == [3, 9]
    assert meta.query_start_loc is not None and meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.to("cpu") is meta
    assert issubclass(AttentionMetadataError, ModelError)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=8),
       st.randoms(use_true_random=False))
def test_metadata_index_tensors_match_a_plain_python_model(
        seqs: list[tuple[int, int]], rnd: random.Random) -> None:
    """Each token's slot and index, each sequence's last row and query offsets, for random
    batches (query length q, cached tokens before it c - q), against per-token loops."""
    query_lens = [q for q, _ in seqs]
    context_lens = [q + cached for q, cached in seqs]
    slot_ids = rnd.sample(range(100), len(seqs))
    meta = AttentionMetadata.build(slot_ids, query_lens, context_lens)
    slots, tokens, starts = [], [], [0]
    for s, q, c in zip(slot_ids, query_lens, context_lens, strict=True):
        for j in range(q):
            slots.append(s)
            tokens.append(c - q + j)
        starts.append(starts[-1] + q)
    got = {name: getattr(meta, name).tolist() for name in (
        "slot_index", "token_index", "last_token_index", "slot_ids_t", "context_lens_t",
        "query_start_loc")}
    assert got == {"slot_index": slots, "token_index": tokens,
                   "last_token_index": [x - 1 for x in starts[1:]], "slot_ids_t": slot_ids,
                   "context_lens_t": context_lens, "query_start_loc": starts}
    assert all(getattr(meta, name).dtype == torch.int64 for name in got)


def test_forward_input_checks(tiny: tuple[CausalLM, ModelConfig]) -> None:
    model, cfg = tiny
    ids, pos = torch.tensor([1, 2]), torch.tensor([0, 1])
    meta = AttentionMetadata.build([0], [2], [2])
    s, m, layers, two, h, d = contract_shape(cfg)
    with pytest.raises(KVCacheError):
        model(ids, pos, torch.zeros(s, m, layers + 1, two, h, d), meta)
    with pytest.raises(KVCacheError):
        model(ids, pos, torch.zeros(s, m, layers, two, h, d, dtype=torch.float16), meta)
    with pytest.raises(KVCacheError):
        model(ids, pos, plain(cfg), AttentionMetadata.build([SLOTS], [2], [2]))
    with pytest.raises(KVCacheError):
        model(ids, pos, plain(cfg), AttentionMetadata.build([0], [2], [MAX_TOKENS + 1]))
    big = torch.zeros(1, 300, layers, two, h, d)
    with pytest.raises(ContextTooLongError):
        model(ids, pos, big, AttentionMetadata.build([0], [2], [257]))
    with pytest.raises(ValueError):
        model(ids, pos, plain(cfg), AttentionMetadata.build([0], [3], [3]))
