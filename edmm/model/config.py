"""Model shape/config for the Llama / Qwen2 / Qwen3 / Mistral family, parsed from HF config.json."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from edmm.model.errors import (
    ConfigError,
    ModelNotFoundError,
    UnknownPresetError,
    UnsupportedArchitectureError,
)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to build a :class:`~edmm.model.transformer.CausalLM`.

    ``rope_scaling`` is ``None`` for plain RoPE, else a dict with ``rope_type`` in
    ``linear | dynamic | llama3 | yarn`` plus that type's HF parameters.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: always)
    o_proj_bias: bool = False  # bias on o_proj (Llama/Qwen3 ``attention_bias``)
    mlp_bias: bool = False  # Llama ``mlp_bias``
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None  # None: window (if any) on every layer
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(self.architecture, SUPPORTED_ARCHITECTURES)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"unsupported dtype {self.dtype!r}; known: {', '.join(_DTYPES)}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ConfigError("sliding_layers must have one entry per layer")
        rope_type = self.rope_type
        if rope_type not in ROPE_TYPES:
            raise UnsupportedArchitectureError(
                self.architecture, SUPPORTED_ARCHITECTURES, f"rope_type {rope_type!r}"
            )

    @property
    def rope_type(self) -> str:
        """``default`` or the scaling type from ``rope_scaling``."""
        return str((self.rope_scaling or {}).get("rope_type", "default"))

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        return _DTYPES[self.dtype]

    def window_for_layer(self, layer: int) -> int | None:
        """Sliding-window size of ``layer`` (None: full attention)."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is None or self.sliding_layers[layer]:
            return self.sliding_window
        return None

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse an HF ``config.json`` dict (transformers 4.x or 5.x layout)."""
        arch = _architecture(d)
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            layers = int(d["num_hidden_layers"])
            vocab = int(d["vocab_size"])
            inter = int(d["intermediate_size"])
        except KeyError as e:
            raise ConfigError(f"config.json lacks required field {e.args[0]!r}") from e
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(
                arch, SUPPORTED_ARCHITECTURES, f"hidden_act {d.get('hidden_act')!r}"
            )
        if float(d.get("partial_rotary_factor") or 1.0) != 1.0:
            raise UnsupportedArchitectureError(arch, SUPPORTED_ARCHITECTURES, "partial rotary")
        max_pos = int(d.get("max_position_embeddings") or 4096)
        theta, scaling = _parse_rope(d, max_pos)
        bias = bool(d.get("attention_bias", False))
        window, sliding_layers = _parse_sliding(d, arch, layers)
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=_head_dim(d, arch, hidden, heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "Qwen2ForCausalLM" else bias,
            o_proj_bias=bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            mlp_bias=bool(d.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
            sliding_layers=sliding_layers,
            dtype=_dtype_name(d),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_ids(d.get("eos_token_id")),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``."""
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ModelNotFoundError(f"no config.json in {path}")
        try:
            d = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from e
        return cls.from_hf_dict(d)

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF config.json dict (readable by transformers 4.45+ and 5.x)."""
        model_type = {v: k for k, v in _MODEL_TYPES.items()}[self.architecture]
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_proj_bias or (self.attention_bias and model_type != "qwen2"),
            "mlp_bias": self.mlp_bias,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _ids_out(self.eos_token_ids),
        }
        if model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            if self.sliding_layers is not None:
                d["layer_types"] = [
                    "sliding_attention" if s else "full_attention" for s in self.sliding_layers
                ]
        else:
            d["sliding_window"] = self.sliding_window
        return d


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if archs:
        arch = str(archs[0])
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(arch, SUPPORTED_ARCHITECTURES)
        return arch
    model_type = d.get("model_type")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise UnsupportedArchitectureError(str(model_type), SUPPORTED_ARCHITECTURES)


def _head_dim(d: dict[str, Any], arch: str, hidden: int, heads: int) -> int:
    if arch == "Qwen3ForCausalLM":
        return int(d.get("head_dim", 128))  # Qwen3Config's default, not hidden / heads
    return int(d.get("head_dim") or hidden // heads)


def _parse_rope(d: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized rope_scaling) from ``rope_scaling``/``rope_theta`` or 5.x
    ``rope_parameters`` (rope_scaling wins, as in transformers)."""
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError("per-layer-type rope_parameters are not supported")
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.get("type") or "default"
    params.pop("type", None)
    if float(params.pop("partial_rotary_factor", None) or 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", max_pos)
    if rope_type not in ROPE_TYPES:
        return theta, {"rope_type": rope_type, **params}  # rejected by ModelConfig
    if "factor" not in params or params["factor"] is None:
        raise ConfigError(f"rope_scaling of type {rope_type!r} needs a 'factor'")
    return theta, {"rope_type": rope_type, **params}


def _parse_sliding(
    d: dict[str, Any], arch: str, num_layers: int
) -> tuple[int | None, tuple[bool, ...] | None]:
    window = d.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not d.get("use_sliding_window", False) or window is None:
            return None, None
        types = d.get("layer_types")
        if types:
            return int(window), tuple(t == "sliding_attention" for t in types)
        first = int(d.get("max_window_layers", 28))
        return int(window), tuple(i >= first for i in range(num_layers))
    if arch == "MistralForCausalLM" and window is not None:
        return int(window), None
    return None, None


def _dtype_name(d: dict[str, Any]) -> str:
    name = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
    name = str(name).removeprefix("torch.")
    return {"float": "float32", "half": "float16"}.get(name, name)


def _as_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v)
    return (int(v),)


def _ids_out(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


# Meta-Llama-3-8B(-Instruct): 8k context, plain RoPE.
_LLAMA3_8B = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    bos_token_id=128000,
    eos_token_ids=(128001, 128009),
)

PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-7b": ModelConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        attention_bias=True,
        bos_token_id=151643,
        eos_token_ids=(151645, 151643),
    ),
    # Qwen2.5-32B(-Instruct) shapes: 64 GB of bf16 weights, served with tensor parallelism.
    "qwen2.5-32b": ModelConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        attention_bias=True,
        bos_token_id=151643,
        eos_token_ids=(151645, 151643),
    ),
    "llama3-8b": _LLAMA3_8B,
    # Llama-3.1-8B(-Instruct): 128k context through llama3 RoPE scaling.
    "llama3.1-8b": _LLAMA3_8B.replace(
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        eos_token_ids=(128001, 128008, 128009),
    ),
    "qwen3-8b": ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        qk_norm=True,
        bos_token_id=151643,
        eos_token_ids=(151645, 151643),
    ),
    # The embedded CPU model (see edmm.model.tiny); ids match its tokenizer's special tokens.
    "tiny": ModelConfig(
        architecture="Qwen2ForCausalLM",
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attention_bias=True,
        dtype="float32",
        bos_token_id=None,
        eos_token_ids=(2, 0),  # <|im_end|>, <|endoftext|>
    ),
}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16``/``"bfloat16"``/``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in _DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; known: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def resolve_preset(name: str) -> ModelConfig:
    """The :data:`PRESETS` entry called ``name`` (case-insensitive)."""
    cfg = PRESETS.get(name.lower())
    if cfg is None:
        raise UnknownPresetError(name, sorted(PRESETS))
    return cfg
