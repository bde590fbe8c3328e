"""Host copies of slots' KV: the offload tier of paused sessions.

A paused session whose KV must leave the GPU under memory pressure can be copied to host memory
(pinned on CUDA) instead of being dropped, and copied back into a fresh slot before it resumes.
At the 51 GiB/s pinned copy bandwidth measured on an H200 (docs/design.md), the 0.94 GB of a
7B model's 16K-token context takes ~18 ms each way against ~0.5 s of recompute (44-47 GiB/s
measured in the agent runs, `benchmarks/results/2026-12-01-h200-agents-2/`). `HostKVStore`
owns the host copies and their byte budget; the prefix cache decides what to offload and
restore and orders the slots' use after the copies (`edmm.memory.copies`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edmm.memory.arena import KVArena
from edmm.memory.copies import Copier, CopyTicket, SyncCopier
from edmm.memory.errors import KVMemoryError


@dataclass(frozen=True)
class HostKV:
    """The KV of a slot's first ``num_tokens`` tokens, as bytes in host memory."""

    data: torch.Tensor  # [num_tokens * token_bytes] uint8, host (pinned with a CUDA arena)
    num_tokens: int
    key: int  # the store's handle
    ticket: CopyTicket  # the copy that filled ``data`` (may still run: asynchronous copier)

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return int(self.data.numel())


@dataclass
class CopyCounters:
    """Bytes copied to and from the host over the store's life, and the seconds those copies
    took (synchronous copies: from the device's idle point to their end; side-stream copies:
    between CUDA events around each copy on its stream). A side-stream copy is counted once
    it is seen done (`HostKVStore.poll`)."""

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

    Copies go through ``copier`` (`edmm.memory.copies`): synchronous by default; on a CUDA
    side stream with `StreamCopier`, in which case `save` and `load` return before the bytes
    have moved and the caller orders later work after ``HostKV.ticket`` / the returned ticket.
    Raises `KVMemoryError` for a copy it does not hold or one that does not fit the slot.
    """

    def __init__(self, arena: KVArena, capacity_bytes: int,
                 copier: Copier | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.arena = arena
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.copier: Copier = copier if copier is not None else SyncCopier()
        self._pin = arena.kv.device.type == "cuda" and torch.cuda.is_available()
        self._held: set[int] = set()  # keys of the copies this store holds
        self._next_key = 0
        self._untimed: list[CopyTicket] = []  # issued, not yet counted
        self.counters = CopyCounters()

    def fits(self, nbytes: int, freed: int = 0) -> bool:
        """True if a copy of ``nbytes`` fits the budget once ``freed`` bytes are released."""
        return self.used_bytes - freed + nbytes <= self.capacity_bytes

    def save(self, slot: int, num_tokens: int, replacing: HostKV | None = None
             ) -> HostKV | None:
        """Copy the KV of ``slot``'s first ``num_tokens`` tokens to the host; None when it
        would exceed the budget (nothing is copied, ``replacing`` is kept). With an
        asynchronous copier the copy may still be running: see ``HostKV.ticket``.

        ``replacing``: a held copy the new one supersedes (an older, shorter copy of the same
        session); its bytes count as free, and it is released before the new copy is made.
        """
        nbytes = num_tokens * self.arena.spec.token_bytes
        freed = 0
        if replacing is not None:
            self._check(replacing)
            freed = replacing.nbytes
        if not self.fits(nbytes, freed):
            return None
        if replacing is not None:
            self.release(replacing)
        data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        ticket = self.copier.copy(data, self.arena.token_bytes_view(slot, 0, num_tokens), True)
        self._issued(ticket)
        self.used_bytes += nbytes
        self._next_key += 1
        self._held.add(self._next_key)
        return HostKV(data, num_tokens, self._next_key, ticket)

    def load(self, host: HostKV, slot: int) -> CopyTicket:
        """Copy ``host`` back into ``slot``'s first tokens (the slot maps at least as many);
        the returned ticket says when the slot's KV is there (an asynchronous copier)."""
        self._check(host)  # after its save on the same in-order stream, if that still runs
        ticket = self.copier.copy(self.arena.token_bytes_view(slot, 0, host.num_tokens),
                                  host.data, False)
        self._issued(ticket)
        return ticket

    def release(self, host: HostKV) -> None:
        """Give ``host``'s bytes back to the budget (a copy still running keeps its buffer
        alive through its ticket)."""
        self._check(host)
        self._held.discard(host.key)
        self.used_bytes -= host.nbytes

    @property
    def num_held(self) -> int:
        """Copies held."""
        return len(self._held)

    def poll(self) -> int:
        """Count the copies found done since the last call (bytes and seconds into
        ``counters``); return how many are still running."""
        running = []
        for ticket in self._untimed:
            if self.copier.poll(ticket):
                self._count(ticket)
            else:
                running.append(ticket)
        self._untimed = running
        return len(running)

    def drain(self) -> None:
        """Wait for every copy issued (host wait) and count them."""
        for ticket in self._untimed:
            self.copier.wait(ticket)
        self.poll()

    def _issued(self, ticket: CopyTicket) -> None:
        if ticket.done:
            self._count(ticket)
        else:
            self._untimed.append(ticket)

    def _count(self, ticket: CopyTicket) -> None:
        assert ticket.seconds is not None
        if ticket.to_host:
            self.counters.saved(ticket.nbytes, ticket.seconds)
        else:
            self.counters.loaded(ticket.nbytes, ticket.seconds)

    def _check(self, host: HostKV) -> None:
        if host.key not in self._held:
            raise KVMemoryError("a host KV copy this store does not hold (released twice?)")
