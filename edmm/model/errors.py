"""Typed errors raised by ``edmm.model``; every one derives from :class:`ModelError`."""

from __future__ import annotations

from collections.abc import Sequence


class ModelError(Exception):
    """Base class of every error raised by the model package."""


class UnsupportedArchitectureError(ModelError):
    """The HF ``architectures`` / ``model_type`` (or a feature of it) is not implemented."""

    def __init__(self, architecture: str, supported: Sequence[str], detail: str = "") -> None:
        self.architecture = architecture
        self.supported = tuple(supported)
        msg = f"unsupported architecture {architecture!r}"
        if detail:
            msg += f" ({detail})"
        msg += f"; supported: {', '.join(self.supported)}"
        super().__init__(msg)


class ConfigError(ModelError):
    """A config.json (or a preset) is malformed or lacks a required field."""


class ModelNotFoundError(ModelError):
    """Neither a local model folder nor a preset of that name exists."""


class UnknownPresetError(ModelNotFoundError):
    """``resolve_preset`` got a name that is not in ``PRESETS``."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        self.name = name
        super().__init__(f"unknown model preset {name!r}; known presets: {', '.join(known)}")


class WeightsError(ModelError):
    """Base class of checkpoint-content errors."""


class MissingTensorError(WeightsError):
    """A parameter the model needs is absent from the checkpoint."""

    def __init__(self, tensor_name: str, folder: str = "") -> None:
        self.tensor_name = tensor_name
        where = f" in {folder}" if folder else ""
        super().__init__(f"missing tensor {tensor_name!r}{where}")


class ShapeMismatchError(WeightsError):
    """A checkpoint tensor has a different shape than the config implies."""

    def __init__(self, tensor_name: str, expected: Sequence[int], got: Sequence[int]) -> None:
        self.tensor_name = tensor_name
        self.expected = tuple(expected)
        self.got = tuple(got)
        super().__init__(
            f"tensor {tensor_name!r} has shape {list(self.got)}, expected {list(self.expected)}"
        )


class UnexpectedTensorError(WeightsError):
    """The checkpoint holds tensors the model does not use (only raised with ``strict=True``)."""

    def __init__(self, tensor_names: Sequence[str]) -> None:
        self.tensor_names = tuple(tensor_names)
        shown = ", ".join(self.tensor_names[:8])
        more = f" (+{len(self.tensor_names) - 8} more)" if len(self.tensor_names) > 8 else ""
        super().__init__(f"unexpected tensors in checkpoint: {shown}{more}")


class KVCacheError(ModelError):
    """The kv_cache tensor passed to ``forward`` does not match the model."""


class ContextTooLongError(ModelError):
    """A sequence's context exceeds the positions the rotary cache was built for."""


class PromptTooLongError(ModelError):
    """A prompt has more tokens than the caller allows (found before all of it was encoded).

    Attributes:
        limit: the most tokens allowed.
        at_least: a lower bound of the prompt's token count (over ``limit``).
    """

    def __init__(self, limit: int, at_least: int) -> None:
        self.limit = limit
        self.at_least = at_least
        super().__init__(f"the prompt has at least {at_least} tokens, over the limit of {limit}")


class ShardingError(ModelError):
    """A model shape cannot be split over the requested tensor-parallel ranks."""
