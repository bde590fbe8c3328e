"""Build a :class:`CausalLM` from a local HF folder (safetensors) or a preset (random init)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from edmm.model.attention import AttentionBackend
from edmm.model.config import PRESETS, ModelConfig, parse_dtype, resolve_preset
from edmm.model.errors import (
    ConfigError,
    MissingTensorError,
    ModelNotFoundError,
    ShapeMismatchError,
    UnexpectedTensorError,
)
from edmm.model.transformer import CausalLM

logger = logging.getLogger(__name__)

_ROTARY_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# How weights load (vLLM's ``--load-format`` names): ``auto`` and ``safetensors`` read a
# folder's safetensors (a preset has random weights); ``dummy`` random-inits every model, a
# folder's too (its config.json is all it needs).
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass(frozen=True)
class TensorTarget:
    """Where an HF checkpoint tensor goes: rows [start, stop) of parameter ``param``."""

    param: str
    start: int
    stop: int
    shape: tuple[int, ...]  # the HF tensor's expected shape


def hf_tensor_targets(cfg: ModelConfig) -> dict[str, TensorTarget]:
    """Every HF tensor name the model needs, mapped to its (fused) parameter rows."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    out: dict[str, TensorTarget] = {}

    def add(name: str, param: str, start: int, rows: int, cols: int | None) -> None:
        shape = (rows,) if cols is None else (rows, cols)
        out[name] = TensorTarget(param, start, start + rows, shape)

    add("model.embed_tokens.weight", "model.embed_tokens.weight", 0, cfg.vocab_size, h)
    add("model.norm.weight", "model.norm.weight", 0, h, None)
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", "lm_head.weight", 0, cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}"
        attn, mlp = f"{pre}.self_attn", f"{pre}.mlp"
        add(f"{pre}.input_layernorm.weight", f"{pre}.input_layernorm.weight", 0, h, None)
        add(
            f"{pre}.post_attention_layernorm.weight",
            f"{pre}.post_attention_layernorm.weight",
            0,
            h,
            None,
        )
        kinds = ["weight", "bias"] if cfg.attention_bias else ["weight"]
        for kind in kinds:
            cols = h if kind == "weight" else None
            add(f"{attn}.q_proj.{kind}", f"{attn}.qkv_proj.{kind}", 0, q, cols)
            add(f"{attn}.k_proj.{kind}", f"{attn}.qkv_proj.{kind}", q, kv, cols)
            add(f"{attn}.v_proj.{kind}", f"{attn}.qkv_proj.{kind}", q + kv, kv, cols)
        add(f"{attn}.o_proj.weight", f"{attn}.o_proj.weight", 0, h, q)
        if cfg.o_proj_bias:
            add(f"{attn}.o_proj.bias", f"{attn}.o_proj.bias", 0, h, None)
        if cfg.qk_norm:
            add(f"{attn}.q_norm.weight", f"{attn}.q_norm.weight", 0, d, None)
            add(f"{attn}.k_norm.weight", f"{attn}.k_norm.weight", 0, d, None)
        add(f"{mlp}.gate_proj.weight", f"{mlp}.gate_up_proj.weight", 0, inter, h)
        add(f"{mlp}.up_proj.weight", f"{mlp}.gate_up_proj.weight", inter, inter, h)
        add(f"{mlp}.down_proj.weight", f"{mlp}.down_proj.weight", 0, h, inter)
        if cfg.mlp_bias:
            add(f"{mlp}.gate_proj.bias", f"{mlp}.gate_up_proj.bias", 0, inter, None)
            add(f"{mlp}.up_proj.bias", f"{mlp}.gate_up_proj.bias", inter, inter, None)
            add(f"{mlp}.down_proj.bias", f"{mlp}.down_proj.bias", 0, h, None)
    return out


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: from the shard index, else ``model.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
        for f in files:
            if not f.is_file():
                raise ModelNotFoundError(f"shard {f.name} listed in {index.name} is missing")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {folder}")
    return files


@torch.no_grad()
def load_weights(model: CausalLM, folder: Path, strict: bool = False) -> None:
    """Copy the HF checkpoint tensors of ``folder`` into ``model`` (converting dtype/device).

    Rotary caches and a tied model's ``lm_head.weight`` are skipped silently; other unknown
    tensors are skipped with a warning, or raise :class:`UnexpectedTensorError` if
    ``strict``.
    """
    targets = hf_tensor_targets(model.cfg)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                target = targets.get(name)
                if target is None:
                    tied_head = name == "lm_head.weight" and model.cfg.tie_word_embeddings
                    if not (tied_head or name.endswith(_ROTARY_SUFFIXES)):
                        unexpected.append(name)
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != target.shape:
                    raise ShapeMismatchError(name, target.shape, shape)
                params[target.param][target.start : target.stop].copy_(f.get_tensor(name))
                loaded.add(name)
    missing = [n for n in targets if n not in loaded]
    if missing:
        raise MissingTensorError(missing[0], str(folder))
    if unexpected:
        if strict:
            raise UnexpectedTensorError(unexpected)
        logger.warning("ignoring %d unexpected tensors: %s", len(unexpected), unexpected[:8])


def export_hf_state_dict(model: CausalLM) -> dict[str, Tensor]:
    """The model's weights under HF names (fused projections split), e.g. for save_file."""
    params = dict(model.named_parameters())
    return {
        name: params[t.param][t.start : t.stop].detach().contiguous()
        for name, t in hf_tensor_targets(model.cfg).items()
    }


@torch.no_grad()
def init_random(model: CausalLM, seed: int = 0, std: float | None = None) -> None:
    """Deterministic init on the model's own device: N(0, std) matrices, 1 norms, 0 biases.

    ``std`` defaults to ``max(0.02, hidden_size ** -0.5)``: 0.02 for real-size models, larger
    for tiny ones so that their greedy generations do not collapse into repetition.
    """
    if std is None:
        std = max(0.02, model.cfg.hidden_size**-0.5)
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


def build_empty(
    cfg: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    max_positions: int | None = None,
    backend: AttentionBackend | None = None,
) -> CausalLM:
    """A model with uninitialized weights allocated directly on ``device`` in ``dtype``."""
    with torch.device("meta"):
        model = CausalLM(cfg, backend=backend, max_positions=max_positions)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.reset_buffers()
    return model


def load_model(
    folder_or_preset: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    max_positions: int | None = None,
    backend: AttentionBackend | None = None,
    strict: bool = False,
    seed: int = 0,
    load_format: str = "auto",
) -> tuple[CausalLM, ModelConfig]:
    """Load a model from a local HF folder, or random-init a preset from ``PRESETS``.

    Args:
        folder_or_preset: folder with config.json + safetensors, or a preset name.
        device: target device; weights are allocated there directly.
        dtype: parameter dtype (default: the config's ``dtype``).
        max_positions: rotary cache length (default: see :class:`CausalLM`).
        backend: attention backend (default: reference SDPA).
        strict: raise on unexpected checkpoint tensors instead of ignoring them.
        seed: random-init seed for presets (and ``dummy`` loads).
        load_format: one of `LOAD_FORMATS`; ``dummy``: random weights, a folder's too.

    Returns:
        ``(model, config)``, the model in eval mode with ``requires_grad`` off.
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    path = Path(folder_or_preset)
    if path.is_dir():
        cfg = ModelConfig.from_folder(path)
    elif str(folder_or_preset).lower() in PRESETS:
        cfg = resolve_preset(str(folder_or_preset))
    else:
        raise ModelNotFoundError(
            f"{str(folder_or_preset)!r} is neither a model folder nor a preset "
            f"(presets: {', '.join(sorted(PRESETS))})"
        )
    model = build_empty(
        cfg,
        device,
        cfg.torch_dtype if dtype is None else parse_dtype(dtype),
        max_positions,
        backend,
    )
    if path.is_dir() and load_format != "dummy":
        load_weights(model, path, strict=strict)
    else:
        init_random(model, seed=seed)
    model.eval().requires_grad_(False)
    return model, cfg


def load_tokenizer(folder: str | Path) -> Any:
    """``AutoTokenizer`` of a local folder (never downloads)."""
    from transformers import AutoTokenizer

    path = Path(folder)
    if not path.is_dir():
        raise ModelNotFoundError(f"no tokenizer folder {folder}")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
