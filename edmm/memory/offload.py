"""Host copies of slots' KV: the offload tier of paused sessions.

A paused session whose KV must leave the GPU under memory pressure can be copied to host memory
(pinned on CUDA) instead of being dropped, and copied back into a fresh slot before it resumes.
At the 51 GiB/s pinned copy bandwidth measured on an H200 (docs/design.md), the 0.94 GB of a
7B model's 16K-token context takes ~18 ms each way against ~0.5 s of recompute (44-47 GiB/s
measured in the agent runs). `HostKVStore`
owns the host copies and their byte budget; the prefix cache decides what to offload and
restore and orders the slots' use after the copies (`edmm.memory.copies`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edmm.memory.arena import KVArena
from edmm.memory.copies import Copier, CopyPair, CopyTicket, SyncCopier
from edmm.memory.errors import KVMemoryError

Run = tuple[int, int]  # (first block, blocks): consecutive blocks of the host buffer


@dataclass(frozen=True)
class HostKV:
    """The KV of a slot's first ``num_tokens`` tokens, as bytes in the store's host buffer."""

    runs: tuple[Run, ...]  # the blocks holding the bytes, in byte order
    num_tokens: int
    nbytes: int  # bytes of KV held (num_tokens * token_bytes; the last block may be partial)
    key: int  # the store's handle
    ticket: CopyTicket  # the copy that filled the blocks (may still run: asynchronous copier)

    @property
    def num_blocks(self) -> int:
        """Blocks held."""
        return sum(n for _, n in self.runs)


class HostBlocks:
    """The free blocks of a host buffer of ``num_blocks`` blocks, as sorted, disjoint, maximal
    runs. `take` hands out one run when one is long enough (the shortest such: one copy per
    save, and long runs kept for long sessions), else the longest runs first (the fewest
    copies); `give` merges runs back with their free neighbours."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: list[Run] = [(0, num_blocks)] if num_blocks else []
        self.num_free = num_blocks

    def take(self, n: int) -> tuple[Run, ...] | None:
        """``n`` free blocks as runs in ascending order (None: fewer are free)."""
        if n <= 0 or n > self.num_free:
            return () if n <= 0 else None
        fits = [r for r in self.free if r[1] >= n]
        if fits:
            first, count = min(fits, key=lambda r: r[1])
            taken = [(first, n)]
        else:
            taken, left = [], n
            for first, count in sorted(self.free, key=lambda r: -r[1]):
                taken.append((first, min(count, left)))
                left -= taken[-1][1]
                if not left:
                    break
        for first, count in taken:
            i = next(i for i, r in enumerate(self.free) if r[0] == first)
            rest = self.free[i][1] - count
            self.free[i:i + 1] = [(first + count, rest)] if rest else []
        self.num_free -= n
        return tuple(sorted(taken))

    def give(self, runs: tuple[Run, ...]) -> None:
        """Return runs handed out by `take`."""
        merged: list[Run] = []
        for first, count in sorted([*self.free, *runs]):
            if merged and merged[-1][0] + merged[-1][1] == first:
                merged[-1] = (merged[-1][0], merged[-1][1] + count)
            elif merged and merged[-1][0] + merged[-1][1] > first:
                raise KVMemoryError(f"host blocks {first}..{first + count} given back twice")
            else:
                merged.append((first, count))
        self.free = merged
        self.num_free += sum(n for _, n in runs)


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

    The store allocates its whole host buffer once, at construction (pinned with a CUDA arena:
    pinning runs at ~1.4 GiB/s on the H200's host, so a buffer pinned per copy would cost a
    paused session more host time than its copy takes), and hands it out in blocks of
    ``block_bytes`` (default: the arena's page size) through `HostBlocks`. A copy whose blocks
    are not consecutive is one copy per run, under one ticket.

    Copies go through ``copier`` (`edmm.memory.copies`): synchronous by default; on a CUDA
    side stream with `StreamCopier`, in which case `save` and `load` return before the bytes
    have moved and the caller orders later work after ``HostKV.ticket`` / the returned ticket.
    Released blocks may be handed to the next `save` while a copy on them still runs: every
    copy goes through the one in-order copier, so the new copy runs after it.
    Raises `KVMemoryError` for a copy it does not hold or one that does not fit the slot.
    """

    def __init__(self, arena: KVArena, capacity_bytes: int,
                 copier: Copier | None = None, block_bytes: int | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.arena = arena
        self.block_bytes = block_bytes if block_bytes is not None else arena.page_size
        if self.block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {self.block_bytes}")
        self.capacity_bytes = capacity_bytes
        self.copier: Copier = copier if copier is not None else SyncCopier()
        self.blocks = HostBlocks(capacity_bytes // self.block_bytes)
        pin = arena.kv.device.type == "cuda" and torch.cuda.is_available()
        self.buffer = torch.empty(self.blocks.num_blocks * self.block_bytes,  # [bytes] uint8
                                  dtype=torch.uint8, pin_memory=pin)
        self._held: set[int] = set()  # keys of the copies this store holds
        self._next_key = 0
        self._untimed: list[CopyTicket] = []  # issued, not yet counted
        self.counters = CopyCounters()

    @property
    def used_bytes(self) -> int:
        """Bytes of the buffer held by copies (whole blocks)."""
        return (self.blocks.num_blocks - self.blocks.num_free) * self.block_bytes

    def _blocks_for(self, nbytes: int) -> int:
        return -(-nbytes // self.block_bytes)

    def fits(self, nbytes: int, freed: int = 0) -> bool:
        """True if a copy of ``nbytes`` fits once a held copy of ``freed`` bytes is released."""
        return self._blocks_for(nbytes) <= self.blocks.num_free + self._blocks_for(freed)

    def save(self, slot: int, num_tokens: int, replacing: HostKV | None = None
             ) -> HostKV | None:
        """Copy the KV of ``slot``'s first ``num_tokens`` tokens to the host; None when it
        would exceed the budget (nothing is copied, ``replacing`` is kept). With an
        asynchronous copier the copy may still be running: see ``HostKV.ticket``.

        ``replacing``: a held copy the new one supersedes (an older, shorter copy of the same
        session); its blocks count as free, and it is released before the new copy is made.
        """
        nbytes = num_tokens * self.arena.spec.token_bytes
        if replacing is not None:
            self._check(replacing)
        if not self.fits(nbytes, replacing.nbytes if replacing is not None else 0):
            return None
        if replacing is not None:
            self.release(replacing)
        runs = self.blocks.take(self._blocks_for(nbytes))
        assert runs is not None  # `fits` said so
        ticket = self.copier.copy(self._pairs(runs, slot, num_tokens, True), True)
        self._issued(ticket)
        self._next_key += 1
        self._held.add(self._next_key)
        return HostKV(runs, num_tokens, nbytes, self._next_key, ticket)

    def load(self, host: HostKV, slot: int) -> CopyTicket:
        """Copy ``host`` back into ``slot``'s first tokens (the slot maps at least as many);
        the returned ticket says when the slot's KV is there (an asynchronous copier)."""
        self._check(host)  # after its save on the same in-order stream, if that still runs
        ticket = self.copier.copy(self.copy_pairs(host, slot, to_host=False), False)
        self._issued(ticket)
        return ticket

    def copy_pairs(self, host: HostKV, slot: int, to_host: bool) -> list[CopyPair]:
        """``(dst, src)`` byte views of a copy between ``host``'s blocks and ``slot``'s first
        ``host.num_tokens`` tokens, one per run (``to_host``: the slot is the source)."""
        return self._pairs(host.runs, slot, host.num_tokens, to_host)

    def _pairs(self, runs: tuple[Run, ...], slot: int, num_tokens: int,
               to_host: bool) -> list[CopyPair]:
        device = self.arena.token_bytes_view(slot, 0, num_tokens)  # [nbytes] uint8
        pairs, offset = [], 0
        for buf in self._host_views(runs, device.numel()):
            dev = device[offset: offset + buf.numel()]
            pairs.append((buf, dev) if to_host else (dev, buf))
            offset += buf.numel()
        return pairs

    def _host_views(self, runs: tuple[Run, ...], nbytes: int) -> list[torch.Tensor]:
        """The buffer's bytes holding ``nbytes`` bytes in ``runs``, one view per run."""
        views, left = [], nbytes
        for first, count in runs:
            n = min(count * self.block_bytes, left)
            views.append(self.buffer[first * self.block_bytes: first * self.block_bytes + n])
            left -= n
        return views

    def host_bytes(self, host: HostKV) -> torch.Tensor:
        """A gathered copy of ``host``'s bytes ([nbytes] uint8; tests and benches)."""
        self._check(host)
        return torch.cat(self._host_views(host.runs, host.nbytes))

    def release(self, host: HostKV) -> None:
        """Give ``host``'s blocks back to the budget (a copy still running on them goes
        first: the copier is in order)."""
        self._check(host)
        self._held.discard(host.key)
        self.blocks.give(host.runs)

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
