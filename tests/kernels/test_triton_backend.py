"""The Triton attention backend inside the model (fused RoPE + KV write, decode, mixed
batches) against the reference SDPA backend, on the CPU through the Triton interpreter."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from tiers import grid

import edmm.kernels
from edmm.kernels import prefill_attention_varlen
from edmm.model import PRESETS, AttentionMetadata
from edmm.model.attention import TorchSDPABackend
from edmm.model.attention_triton import TritonAttentionBackend
from edmm.model.transformer import CausalLM

pytestmark = pytest.mark.usefixtures("interpreted")

SLOTS, MAX_TOKENS = 4, 64


def _model() -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(PRESETS["tiny"], max_positions=MAX_TOKENS).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.reset_buffers()
    return model


Batch = list[tuple[int, int, int]]  # (slot, new tokens, context) per sequence


def _batch(batch: Batch, seed: int, dtype: torch.dtype = torch.float32
           ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """The prefixes' KV as earlier steps left it [S, M, L, 2, Hkv, D], the batch's metadata
    and its token ids [T]."""
    cfg = PRESETS["tiny"]
    gen = torch.Generator().manual_seed(seed)
    shape = (SLOTS, MAX_TOKENS, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    cached = torch.randn(shape, generator=gen).to(dtype)
    slots, qlens, ctxs = ([b[i] for b in batch] for i in range(3))
    meta = AttentionMetadata.build(slots, qlens, ctxs)
    ids = torch.randint(0, cfg.vocab_size, (sum(qlens),), generator=gen)
    return cached, meta, ids


def _run(model: CausalLM, backend: TorchSDPABackend | TritonAttentionBackend,
         cached: torch.Tensor, meta: AttentionMetadata, ids: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [T, hidden] and the KV after one forward pass through ``backend``."""
    assert meta.token_index is not None
    model.set_backend(backend)
    kv = cached.clone()
    with torch.inference_mode():
        return model(ids, meta.token_index, kv, meta), kv


MIXED = [(0, 20, 20), (1, 1, 9), (2, 5, 17)]  # prefill, decode, chunk
DECODES = [(1, 1, 9), (3, 1, 30)]  # decode only


# Fast tier: the warp-specialized prefill of bf16 batches in test_prefill_attention.py
@grid({"dtype": [torch.float32, torch.bfloat16], "batch": {"mixed": MIXED, "decodes": DECODES}},
      fast=[(torch.float32, MIXED), (torch.bfloat16, DECODES)])
def test_triton_backend_matches_sdpa(batch: Batch, dtype: torch.dtype,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 batches with a prefill take the warp-specialized prefill kernel; fp32 the
    default one."""
    kernels = sys.modules[prefill_attention_varlen.__module__]
    ws_launches = []
    launch = kernels._launch_ws
    monkeypatch.setattr(kernels, "_launch_ws",
                        lambda *a, **k: (ws_launches.append(1), launch(*a, **k)))
    model = _model().to(dtype)
    cached, meta, ids = _batch(batch, seed=1, dtype=dtype)
    want = _run(model, TorchSDPABackend(), cached, meta, ids)
    backend = TritonAttentionBackend(64)
    got = _run(model, backend, cached, meta, ids)
    assert not backend.decode_workspace.counters(1, torch.device("cpu")).any()  # fused: reset
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[0], want[0], atol=tol, rtol=tol)
    torch.testing.assert_close(got[1], want[1], atol=tol / 10, rtol=tol / 10)
    prefill = any(n > 1 for n in meta.query_lens)
    assert bool(ws_launches) == (prefill and dtype == torch.bfloat16)


@pytest.mark.parametrize(("batch", "placeholder", "decode_launched"), [
    ([(0, 20, 20), (2, 12, 17)], False, False),  # eager, no single-query row: no decode launch
    ([(0, 20, 20), (2, 12, 17)], True, True),  # a graph's static lists: always launched
    ([(0, 20, 20), (1, 1, 9)], False, True),  # a decode row rides along
])
def test_decode_launch_only_where_rows_need_it(batch: Batch, placeholder: bool,
                                               decode_launched: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed pass launches the split-K decode kernel only when a single-query row may be
    in it; skipping it leaves the hidden states and KV those of the reference."""
    launches: list[int] = []
    varlen = edmm.kernels.decode_attention_varlen
    monkeypatch.setattr(edmm.kernels, "decode_attention_varlen",
                        lambda *a, **k: (launches.append(1), varlen(*a, **k))[1])
    model = _model()
    cached, meta, ids = _batch(batch, seed=2)
    meta = dataclasses.replace(meta, placeholder_lists=placeholder)
    want = _run(model, TorchSDPABackend(), cached, meta, ids)
    got = _run(model, TritonAttentionBackend(64), cached, meta, ids)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert bool(launches) == decode_launched
