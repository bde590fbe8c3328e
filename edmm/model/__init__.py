"""Model definitions (Llama / Qwen2 / Qwen3 / Mistral), weight loading and the tiny model."""

from edmm.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataError,
    TorchSDPABackend,
)
from edmm.model.config import PRESETS, SUPPORTED_ARCHITECTURES, ModelConfig, resolve_preset
from edmm.model.errors import (
    ConfigError,
    ContextTooLongError,
    KVCacheError,
    MissingTensorError,
    ModelError,
    ModelNotFoundError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnknownPresetError,
    UnsupportedArchitectureError,
    WeightsError,
)
from edmm.model.loader import load_model, load_tokenizer
from edmm.model.tiny import ensure_tiny_model
from edmm.model.transformer import CausalLM

__all__ = [
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionMetadataError",
    "CausalLM",
    "ConfigError",
    "ContextTooLongError",
    "KVCacheError",
    "MissingTensorError",
    "ModelConfig",
    "ModelError",
    "ModelNotFoundError",
    "ShapeMismatchError",
    "TorchSDPABackend",
    "UnexpectedTensorError",
    "UnknownPresetError",
    "UnsupportedArchitectureError",
    "WeightsError",
    "ensure_tiny_model",
    "load_model",
    "load_tokenizer",
    "resolve_preset",
]
