"""Copies of KV between the arena and host memory, synchronous or on a CUDA side stream.

The offload tier (`HostKVStore`) moves a paused session's KV to host memory and back. On the
CPU (host twin) and with streams off, a copy is done when `Copier.copy` returns
(`SyncCopier`). On CUDA, `StreamCopier` issues every copy on one dedicated side stream into or
out of pinned host memory, after the work already queued on the compute stream, and returns at
once: a `CopyTicket` tells when the copy is done (a CUDA event). The rules the prefix index
keeps with tickets (one owner: `PrefixCache`):

- a slot whose KV a pending copy reads (offload) or writes (restore) is neither unmapped nor
  handed to a sequence before ``Copier.compute_wait(ticket)``: the compute stream waits for the
  copy on the GPU (no host sync), and the unmap fence (`CudaVMM.fence`) waits for the compute
  stream; so nothing reads a restored slot too early and no page is reused under a copy;
- host bytes are reused only by a later copy through the same copier (`HostKVStore`): copies
  run in the order they were issued (one side stream), so a buffer is never overwritten under
  a copy still reading or writing it; the tensors a copy touches stay referenced by its ticket
  until it is done.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class CopyTicket:
    """One copy in flight or done: ``nbytes`` bytes, to the host or back.

    ``seconds`` is set once the copy is known to be done (`Copier.poll`): its duration on the
    copy stream (CUDA events), or on the host clock for a synchronous copy.
    """

    nbytes: int
    to_host: bool
    seconds: float | None = None
    _start: Any = None  # torch.cuda.Event, or None for a synchronous copy
    _end: Any = None
    _keep: tuple[torch.Tensor, ...] = field(default=(), repr=False)  # alive until done

    @property
    def done(self) -> bool:
        """True once the copy has finished (timed)."""
        return self.seconds is not None


CopyPair = tuple[torch.Tensor, torch.Tensor]  # (dst, src): byte views of equal size


def pairs_nbytes(pairs: Sequence[CopyPair]) -> int:
    """Bytes a list of copies moves."""
    return sum(int(dst.numel() * dst.element_size()) for dst, _ in pairs)


class Copier(Protocol):
    """Issues host <-> arena copies and orders the compute stream after them."""

    asynchronous: bool  # True: `copy` returns before the bytes have moved

    def copy(self, pairs: Sequence[CopyPair], to_host: bool) -> CopyTicket:
        """Copy each pair's ``src`` into its ``dst`` (same number of bytes, one of the two on
        the host), in order; one ticket for them all."""
        ...

    def poll(self, ticket: CopyTicket) -> bool:
        """True (and ``ticket.seconds`` set) if the copy is done; never blocks."""
        ...

    def compute_wait(self, ticket: CopyTicket) -> None:
        """Make work queued on the compute stream from now on wait for the copy (on the
        device; the host does not wait)."""
        ...

    def wait(self, ticket: CopyTicket) -> None:
        """Block the host until the copy is done (tests, benches, shutdown)."""
        ...


class SyncCopier:
    """Copies done before `copy` returns: the CPU path, and CUDA with side streams off (the
    device is synchronised before and after, so the time is the copy's alone)."""

    asynchronous = False

    def copy(self, pairs: Sequence[CopyPair], to_host: bool) -> CopyTicket:
        """Copy now; the ticket is done."""
        cuda = next((d for pair in pairs for d in (t.device for t in pair)
                     if d.type == "cuda"), None)
        if cuda is not None:
            torch.cuda.synchronize(cuda)
        t0 = time.perf_counter()
        for dst, src in pairs:
            dst.copy_(src)
        if cuda is not None:
            torch.cuda.synchronize(cuda)
        return CopyTicket(pairs_nbytes(pairs), to_host, time.perf_counter() - t0)

    def poll(self, ticket: CopyTicket) -> bool:
        """Always done."""
        return True

    def compute_wait(self, ticket: CopyTicket) -> None:
        """Nothing to wait for."""

    def wait(self, ticket: CopyTicket) -> None:
        """Nothing to wait for."""


class StreamCopier:
    """Copies on one CUDA side stream, ordered after the compute stream's queued work."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, pairs: Sequence[CopyPair], to_host: bool) -> CopyTicket:
        """Queue the copies on the side stream after the compute stream's current work."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            end.record(self.stream)
        return CopyTicket(pairs_nbytes(pairs), to_host, None, start, end,
                          tuple(t for pair in pairs for t in pair))

    def poll(self, ticket: CopyTicket) -> bool:
        """Done when its end event has completed (then timed from the stream's events)."""
        if ticket.seconds is None and ticket._end is not None and ticket._end.query():
            ticket.seconds = ticket._start.elapsed_time(ticket._end) / 1e3
            ticket._keep = ()
        return ticket.seconds is not None

    def compute_wait(self, ticket: CopyTicket) -> None:
        """The compute stream waits for the copy's end event."""
        if ticket._end is not None and ticket.seconds is None:
            torch.cuda.current_stream(self.device).wait_event(ticket._end)

    def wait(self, ticket: CopyTicket) -> None:
        """Host wait on the copy's end event."""
        if ticket._end is not None:
            ticket._end.synchronize()
        self.poll(ticket)


def make_copier(device: torch.device, side_stream: bool) -> Copier:
    """`StreamCopier` for a CUDA device with ``side_stream``, else `SyncCopier`."""
    if side_stream and device.type == "cuda" and torch.cuda.is_available():
        return StreamCopier(device)
    return SyncCopier()
