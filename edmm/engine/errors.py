"""Typed errors of the engine: bad requests, bad configs, and a scheduler that cannot progress."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error raised by `edmm.engine` (sampling errors excepted)."""


class InvalidRequestError(EngineError, ValueError):
    """A request was rejected before anything was scheduled; the engine is unchanged."""


class EngineConfigError(EngineError, ValueError):
    """An `EngineConfig` field is out of range or inconsistent with the model or the memory."""


class SchedulerStallError(EngineError):
    """Unfinished requests remain but the scheduler can schedule none of them (a bug)."""
