"""Fixtures for the model tests: the tiny model folder and tiny random HF checkpoints."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from edmm.model.tiny import ensure_tiny_model

HF_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mistral": "MistralConfig",
}
BASE_SHAPE: dict[str, Any] = dict(
    vocab_size=1024,  # the tiny tokenizer's vocabulary
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

MakeHFFolder = Callable[..., Path]


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, std: float, emb_std: float) -> None:
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


def build_hf_model(
    arch: str, seed: int = 0, std: float = 0.2, emb_std: float = 0.05, **overrides: Any
) -> Any:
    """A tiny random transformers model (float32, eval) of ``arch`` with config overrides."""
    import transformers

    cfg_cls = getattr(transformers, HF_CONFIG_CLASSES[arch])
    cfg = cfg_cls(**{**BASE_SHAPE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation="eager"
    )
    randomize_(model, seed, std, emb_std)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model, built once per session in a temp cache dir."""
    return ensure_tiny_model(tmp_path_factory.mktemp("edmm-cache"))


@pytest.fixture(scope="session")
def make_hf_folder(tiny_dir: Path) -> MakeHFFolder:
    """``make_hf_folder(tmp_path, arch, *, seed=0, max_shard_size=None, **overrides)``
    saves a tiny random HF model (``save_pretrained``, safetensors) plus the tiny tokenizer
    and returns the folder."""

    def make(
        tmp_path: Path,
        arch: str,
        *,
        seed: int = 0,
        max_shard_size: str | None = None,
        **overrides: Any,
    ) -> Path:
        model = build_hf_model(arch, seed=seed, **overrides)
        folder = tmp_path / f"{arch}-{seed}"
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(str(folder), **kwargs)
        for name in TOKENIZER_FILES:
            if (tiny_dir / name).is_file():
                shutil.copy(tiny_dir / name, folder / name)
        return folder

    return make
