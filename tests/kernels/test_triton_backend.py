"""The Triton attention backend inside the model (fused RoPE + KV write, decode, mixed
batches) against the reference SDPA backend, on the CPU through the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("long_from", [4096, 16], ids=["default-config", "long-config"])
@pytest.mark.parametrize("batch", [
    [(0, 20, 20), (1, 1, 9), (2, 5, 17)],  # (slot, new tokens, context): prefill, decode, chunk
    [(1, 1, 9), (3, 1, 30)],  # decode only
])
def test_triton_backend_matches_sdpa(batch: list[tuple[int, int, int]], long_from: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """long-config: the batch takes the long-prefill launch config (packed GQA, TMA)."""
    monkeypatch.setattr(attention_triton, "LONG_PREFILL_TOKENS", long_from)
    model, cfg = _model(), PRESETS["tiny"]
    gen = torch.Generator().manual_seed(1)
    shape = (SLOTS, MAX_TOKENS, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    cached = torch.randn(shape, generator=gen)  # the prefixes' KV, as earlier steps left it
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
    torch.testing.assert_close(out["triton"][0], out["sdpa"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["triton"][1], out["sdpa"][1], atol=1e-5, rtol=1e-5)
