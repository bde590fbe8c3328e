"""The Triton attention backend inside the model (fused RoPE + KV write, decode, mixed
batches) against the reference SDPA backend, on the CPU through the Triton interpreter."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from edmm.kernels import prefill_attention_varlen
from edmm.kernels.fused_sdpa import AttendLSE, LongPrefill
from edmm.model import PRESETS, AttentionMetadata, attention_triton
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [
    [(0, 20, 20), (1, 1, 9), (2, 5, 17)],  # (slot, new tokens, context): prefill, decode, chunk
    [(1, 1, 9), (3, 1, 30)],  # decode only
])
def test_triton_backend_matches_sdpa(batch: list[tuple[int, int, int]], dtype: torch.dtype,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 batches with a prefill take the warp-specialized prefill kernel; fp32 the
    default one."""
    kernels = sys.modules[prefill_attention_varlen.__module__]
    ws_launches = []
    launch = kernels._launch_ws
    monkeypatch.setattr(kernels, "_launch_ws",
                        lambda *a, **k: (ws_launches.append(1), launch(*a, **k)))
    model, cfg = _model().to(dtype), PRESETS["tiny"]
    gen = torch.Generator().manual_seed(1)
    shape = (SLOTS, MAX_TOKENS, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    cached = torch.randn(shape, generator=gen).to(dtype)  # the prefixes' KV, as steps left it
    slots, qlens, ctxs = ([b[i] for b in batch] for i in range(3))
    meta = AttentionMetadata.build(slots, qlens, ctxs)
    assert meta.token_index is not None
    ids = torch.randint(0, cfg.vocab_size, (sum(qlens),), generator=gen)
    out = {}
    for name, backend in (("sdpa", TorchSDPABackend()), ("triton", TritonAttentionBackend(64))):
        model.set_backend(backend)
        kv = cached.clone()
        with torch.inference_mode():
            hidden = model(ids, meta.token_index, kv, meta)  # [T, hidden]
        out[name] = (hidden, kv)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out["triton"][0], out["sdpa"][0], atol=tol, rtol=tol)
    torch.testing.assert_close(out["triton"][1], out["sdpa"][1], atol=tol / 10, rtol=tol / 10)
    prefill = any(n > 1 for n in qlens)
    assert bool(ws_launches) == (prefill and dtype == torch.bfloat16)


@pytest.mark.parametrize(("batch", "routed"), [
    ([(0, 20, 20), (1, 1, 9), (2, 12, 17)], True),  # every multi-query sequence long: routed
    ([(0, 20, 20), (2, 5, 17)], False),  # one short prefill: all in the Triton kernel
])
def test_long_prefill_route_matches_sdpa(batch: list[tuple[int, int, int]], routed: bool,
                                         cpu_attend: AttendLSE,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A `LongPrefill` route (here ATen's CPU flash kernel, as cuDNN's on the GPU) takes eager
    passes whose multi-query sequences all have ``min_queries`` or more, never a pass being
    captured, and gives the reference's hidden states and KV."""
    model, cfg = _model(), PRESETS["tiny"]
    gen = torch.Generator().manual_seed(2)
    shape = (SLOTS, MAX_TOKENS, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    cached = torch.randn(shape, generator=gen)
    slots, qlens, ctxs = ([b[i] for b in batch] for i in range(3))
    meta = AttentionMetadata.build(slots, qlens, ctxs)
    assert meta.token_index is not None
    ids = torch.randint(0, cfg.vocab_size, (sum(qlens),), generator=gen)
    calls: list[bool] = []

    def attend(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(True)
        return cpu_attend(*args)

    route = LongPrefill(attend, usable=lambda q: True, min_queries=8)

    def run(backend: TorchSDPABackend | TritonAttentionBackend) -> tuple[torch.Tensor, ...]:
        model.set_backend(backend)
        kv = cached.clone()
        with torch.inference_mode():
            return model(ids, meta.token_index, kv, meta), kv  # [T, hidden], KV

    ref = run(TorchSDPABackend())
    got = run(TritonAttentionBackend(64, long_prefill=route))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert bool(calls) == routed
    calls.clear()
    monkeypatch.setattr(attention_triton, "_capturing", lambda q: True)
    got = run(TritonAttentionBackend(64, long_prefill=route))
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
    assert not calls, "the long route ran inside a capture"
    monkeypatch.undo()
    meta = dataclasses.replace(meta, placeholder_lists=True)  # a graph runner's static inputs
    got = run(TritonAttentionBackend(64, long_prefill=route))
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
    assert not calls, "the long route ran on placeholder lengths"
