"""KV memory: VMM backends (CUDA driver, host twin), the physical page pool and the KV arena."""

from edmm.memory.arena import KVArena, KVSpec
from edmm.memory.backends import open_backend
from edmm.memory.errors import (
    InvalidBranchError,
    KVMemoryError,
    NoFreeSlotError,
    PoolExhaustedError,
    SlotOverflowError,
    SlotStateError,
    VMMError,
)
from edmm.memory.pool import PagePool

__all__ = [
    "InvalidBranchError",
    "KVArena",
    "KVMemoryError",
    "KVSpec",
    "NoFreeSlotError",
    "PagePool",
    "PoolExhaustedError",
    "SlotOverflowError",
    "SlotStateError",
    "VMMError",
    "open_backend",
]
