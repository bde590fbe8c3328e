"""The Triton attention backend inside the model (fused RoPE + KV write, decode, mixed
batches) against the reference SDPA backend, on the CPU through the Triton interpreter."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from edmm.kernels import prefill_attention_varlen
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


@pytest.mark.parametrize(("batch", "placeholder", "decode_launched"), [
    ([(0, 20, 20), (2, 12, 17)], False, False),  # eager, no single-query row: no decode launch
    ([(0, 20, 20), (2, 12, 17)], True, True),  # a graph's static lists: always launched
    ([(0, 20, 20), (1, 1, 9)], False, True),  # a decode row rides along
])
def test_decode_launch_only_where_rows_need_it(batch: list[tuple[int, int, int]],
                                               placeholder: bool, decode_launched: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed pass launches the split-K decode kernel only when a single-query row may be
    in it; skipping it leaves the hidden states and KV those of the reference."""
    kernels = sys.modules[attention_triton.__name__]
    launches: list[int] = []
    import edmm.kernels as kernel_pkg
    varlen = kernel_pkg.decode_attention_varlen
    monkeypatch.setattr(kernel_pkg, "decode_attention_varlen",
                        lambda *a, **k: (launches.append(1), varlen(*a, **k))[1])
    model, cfg = _model(), PRESETS["tiny"]
    gen = torch.Generator().manual_seed(2)
    shape = (SLOTS, MAX_TOKENS, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    cached = torch.randn(shape, generator=gen)
    slots, qlens, ctxs = ([b[i] for b in batch] for i in range(3))
    meta = dataclasses.replace(AttentionMetadata.build(slots, qlens, ctxs),
                               placeholder_lists=placeholder)
    assert meta.token_index is not None
    ids = torch.randint(0, cfg.vocab_size, (sum(qlens),), generator=gen)
    out = []
    for backend in (TorchSDPABackend(), kernels.TritonAttentionBackend(64)):
        model.set_backend(backend)
        kv = cached.clone()
        with torch.inference_mode():
            out.append((model(ids, meta.token_index, kv, meta), kv))  # [T, hidden], KV
    for got, want in zip(out[1], out[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert bool(launches) == decode_launched
