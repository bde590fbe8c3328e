"""Helpers of the model tests: tiny random HF checkpoints saved with transformers itself."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hf_weights import randomize_

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

MakeHFFolder = Callable[..., Path]  # make_hf_folder with the tokenizer folder bound


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


def make_hf_folder(
    tmp_path: Path,
    arch: str,
    *,
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Save a tiny random HF model of ``arch`` (llama | qwen2 | qwen3 | mistral) with
    ``save_pretrained`` (safetensors; sharded if ``max_shard_size``), copy the tokenizer files
    of ``tokenizer_dir`` next to it, and return the folder."""
    model = build_hf_model(arch, seed=seed, **overrides)
    folder = tmp_path / f"{arch}-{seed}"
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, folder / name)
    return folder
