"""Typed errors of the memory layer. Every failure names what failed; none is a silent remap."""

from __future__ import annotations


class KVMemoryError(Exception):
    """Base class of every error raised by `edmm.memory`."""


class VMMError(KVMemoryError):
    """A driver or OS call of a VMM backend failed.

    Attributes:
        call: the name of the failing call (e.g. ``cuMemMap``, ``mmap``).
        code: the driver error name or the errno name.
    """

    def __init__(self, call: str, code: str, detail: str = "") -> None:
        self.call = call
        self.code = code
        msg = f"{call} failed: {code}"
        super().__init__(f"{msg} ({detail})" if detail else msg)


class BackendUnavailableError(KVMemoryError):
    """A backend cannot be used on this machine; the message says why."""


class PoolExhaustedError(KVMemoryError):
    """The page pool has fewer free pages than asked for. The caller may evict or queue."""

    def __init__(self, wanted: int, free: int) -> None:
        self.wanted = wanted
        self.free = free
        super().__init__(f"page pool exhausted: {wanted} page(s) wanted, {free} free")

    @property
    def shortfall(self) -> int:
        """Pages that would have to be freed for the request to succeed."""
        return max(self.wanted - self.free, 1)


def pages_short(error: KVMemoryError) -> int | None:
    """The shortfall of a `PoolExhaustedError`; None for any other error (a `NoFreeSlotError`:
    a slot, not pages, was short)."""
    return error.shortfall if isinstance(error, PoolExhaustedError) else None


class NoFreeSlotError(KVMemoryError):
    """Every slot of the arena is in use."""


class SlotStateError(KVMemoryError):
    """An operation on a slot that is not in a state that allows it (e.g. freeing twice)."""


class SlotOverflowError(KVMemoryError):
    """A slot was asked to hold more tokens than the arena's ``max_tokens``."""


class InvalidBranchError(KVMemoryError):
    """A branch or truncation that does not fit its source (e.g. longer than the source)."""


class ArenaDesyncError(KVMemoryError):
    """A replayed arena operation gave another result than it did on the arena it came from."""
