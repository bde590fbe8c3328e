"""Typed errors of the engine: bad requests, bad configs, and a scheduler that cannot progress."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error raised by `edmm.engine` (sampling errors excepted)."""


class InvalidRequestError(EngineError, ValueError):
    """A request was rejected before anything was scheduled; the engine is unchanged."""


class ContextLengthError(InvalidRequestError):
    """A prompt longer than the engine's ``max_model_len`` (nothing was queued)."""

    def __init__(self, request_id: str, prompt_len: int, max_model_len: int) -> None:
        super().__init__(f"request {request_id!r}: prompt of {prompt_len} tokens exceeds "
                         f"max_model_len={max_model_len}")
        self.prompt_len = prompt_len
        self.max_model_len = max_model_len


class EngineConfigError(EngineError, ValueError):
    """An `EngineConfig` field is out of range or inconsistent with the model or the memory."""


class SchedulerStallError(EngineError):
    """Unfinished requests remain but the scheduler can schedule none of them (a bug)."""


class IntegrityError(EngineError):
    """An owner's invariant is broken (`check_integrity`): a bug, never bad input."""
