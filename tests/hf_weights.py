"""Random weights for tiny HF test models (shared by the model and engine tests)."""

from __future__ import annotations

import torch


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, std: float = 0.2,
               emb_std: float = 0.05) -> None:
    """Random weights everywhere (HF init leaves biases at 0 and norms at 1). Layers are
    strong relative to the embeddings so that greedy decoding does not just repeat tokens."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(1.0 + 0.2 * noise)
        elif "embed_tokens" in name or "lm_head" in name:
            p.copy_(emb_std * noise)
        else:
            p.copy_(std * noise)
