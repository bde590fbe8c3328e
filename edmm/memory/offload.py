"""Host copies of slots' KV: the offload tier of paused sessions.

A paused session whose KV must leave the GPU under memory pressure can be copied to host memory
(pinned on CUDA) instead of being dropped, and copied back into a fresh slot before it resumes.
At the 51 GiB/s pinned copy bandwidth measured on an H200 (docs/design.md), the 0.94 GB of a
7B model's 16K-token context would take ~18 ms each way against ~0.5 s of recompute (an
estimate: these copies have not been timed here). `HostKVStore` owns the host copies and their
byte budget; the prefix cache decides what to offload and restore.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from edmm.memory.arena import KVArena
from edmm.memory.errors import KVMemoryError


@dataclass(frozen=True)
class HostKV:
    """The KV of a slot's first ``num_tokens`` tokens, as bytes in host memory."""

    data: torch.Tensor  # [num_tokens * token_bytes] uint8, host (pinned with a CUDA arena)
    num_tokens: int
    key: int  # the store's handle

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return int(self.data.numel())


@dataclass
class CopyCounters:
    """Bytes copied to and from the host over the store's life, and the seconds those copies
    took (synchronous copies, timed from the device's idle point to their end)."""

    saves: int = 0
    saved_bytes: int = 0
    save_s: float = 0.0
    loads: int = 0
    loaded_bytes: int = 0
    load_s: float = 0.0

    def saved(self, nbytes: int, seconds: float) -> None:
        """Count one copy to the host."""
        self.saves += 1
        self.saved_bytes += nbytes
        self.save_s += seconds

    def loaded(self, nbytes: int, seconds: float) -> None:
        """Count one copy back from the host."""
        self.loads += 1
        self.loaded_bytes += nbytes
        self.load_s += seconds


class HostKVStore:
    """Host copies of arena slots' KV within ``capacity_bytes``.

    Raises `KVMemoryError` for a copy it does not hold or one that does not fit the slot.
    """

    def __init__(self, arena: KVArena, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.arena = arena
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._pin = arena.kv.device.type == "cuda" and torch.cuda.is_available()
        self._held: set[int] = set()  # keys of the copies this store holds
        self._next_key = 0
        self.counters = CopyCounters()

    def save(self, slot: int, num_tokens: int, replacing: HostKV | None = None
             ) -> HostKV | None:
        """Copy the KV of ``slot``'s first ``num_tokens`` tokens to the host; None when it
        would exceed the budget (nothing is copied, ``replacing`` is kept).

        ``replacing``: a held copy the new one supersedes (an older, shorter copy of the same
        session); its bytes count as free, and it is released before the new copy is made.
        """
        nbytes = num_tokens * self.arena.spec.token_bytes
        freed = 0
        if replacing is not None:
            self._check(replacing)
            freed = replacing.nbytes
        if self.used_bytes - freed + nbytes > self.capacity_bytes:
            return None
        if replacing is not None:
            self.release(replacing)
        data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        t0 = self._start()
        data.copy_(self.arena.token_bytes_view(slot, 0, num_tokens))
        self.counters.saved(nbytes, self._stop(t0))
        self.used_bytes += nbytes
        self._next_key += 1
        self._held.add(self._next_key)
        return HostKV(data, num_tokens, self._next_key)

    def load(self, host: HostKV, slot: int) -> None:
        """Copy ``host`` back into ``slot``'s first tokens (the slot maps at least as many)."""
        self._check(host)
        t0 = self._start()
        self.arena.token_bytes_view(slot, 0, host.num_tokens).copy_(host.data)
        self.counters.loaded(host.nbytes, self._stop(t0))

    def release(self, host: HostKV) -> None:
        """Give ``host``'s bytes back to the budget."""
        self._check(host)
        self._held.discard(host.key)
        self.used_bytes -= host.nbytes

    @property
    def num_held(self) -> int:
        """Copies held."""
        return len(self._held)

    def _start(self) -> float:
        """Start timing a copy (after the device's queued work: the copies are synchronous)."""
        if self._pin:
            torch.cuda.synchronize(self.arena.kv.device)
        return time.perf_counter()

    def _stop(self, t0: float) -> float:
        if self._pin:
            torch.cuda.synchronize(self.arena.kv.device)
        return time.perf_counter() - t0

    def _check(self, host: HostKV) -> None:
        if host.key not in self._held:
            raise KVMemoryError("a host KV copy this store does not hold (released twice?)")
