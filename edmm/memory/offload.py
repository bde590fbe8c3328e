"""Host copies of KV blocks: the offload tier, content-addressed.

KV that must leave the GPU under memory pressure can be copied to host memory (pinned on CUDA)
instead of being dropped, and copied back later. At the 51 GiB/s pinned copy bandwidth measured
on an H200 (docs/design.md), the 0.94 GB of a 7B model's 16K-token context takes ~18 ms each way
against ~0.5 s of recompute.

`HostKVStore` holds the KV of token *blocks* (``block_tokens`` tokens each; a sequence's last
block may hold fewer), each under a key its caller chooses, at most once per key. The prefix
index keys a block by its chain hash (the block and every token before it), so KV that many
sequences share (a common system prompt) is held once, a block already held is never copied
again, and a restore copies back only the blocks the GPU lacks. Blocks stay held after they
are loaded back; they leave only when a save needs their room: the least recently used blocks
no caller pins go first (`pin`: the prefix index pins the blocks of the paused sessions it
means to restore), and a save touches its blocks from the last to the first, so within a
sequence the tail leaves before the prefix (a tail without its prefix is of no use).

The store owns the host buffer, the blocks held and the byte counters; the prefix index decides
what to save and load and orders the slots' use after the copies (`edmm.memory.copies`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass

import torch

from edmm.memory.arena import KVArena
from edmm.memory.copies import Copier, CopyPair, CopyTicket, SyncCopier
from edmm.memory.errors import KVMemoryError

Run = tuple[int, int]  # (first block, blocks): consecutive blocks of the host buffer


@dataclass(frozen=True)
class BlockSave:
    """One block to save: the KV of a slot's tokens ``[start, start + num_tokens)`` under
    ``key``, with ``meta`` (what a later reader checks the block against)."""

    key: Hashable
    start: int
    num_tokens: int
    meta: object = None


@dataclass
class _Held:
    block: int  # index of the buffer block holding the bytes
    num_tokens: int
    meta: object
    pins: int = 0


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
    """KV blocks of arena slots in host memory, within ``capacity_bytes``; see the module
    docstring.

    The store allocates its whole host buffer once, at construction (pinned with a CUDA arena:
    pinning runs at ~1.4 GiB/s on the H200's host, so a buffer pinned per copy would cost a
    paused session more host time than its copy takes), in blocks of ``block_tokens`` tokens'
    KV, handed out through `HostBlocks`. The blocks of one save or load whose bytes are
    consecutive on both sides are one copy; all of them go under one ticket.

    Copies go through ``copier`` (`edmm.memory.copies`): synchronous by default; on a CUDA
    side stream with `StreamCopier`, in which case `save` and `load` return before the bytes
    have moved and the caller orders later work after the returned ticket. A block that leaves
    may be handed to the next save while a copy on it still runs: every copy goes through the
    one in-order copier, so the new copy runs after it.
    Raises `KVMemoryError` for a block it does not hold or a copy outside the slot.
    """

    def __init__(self, arena: KVArena, capacity_bytes: int,
                 copier: Copier | None = None, block_tokens: int = 16) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.arena = arena
        self.block_tokens = block_tokens
        self.token_bytes = arena.spec.token_bytes
        self.block_bytes = block_tokens * self.token_bytes
        self.capacity_bytes = capacity_bytes
        self.copier: Copier = copier if copier is not None else SyncCopier()
        self.blocks = HostBlocks(capacity_bytes // self.block_bytes)
        pin = arena.kv.device.type == "cuda" and torch.cuda.is_available()
        self.buffer = torch.empty(self.blocks.num_blocks * self.block_bytes,  # [bytes] uint8
                                  dtype=torch.uint8, pin_memory=pin)
        self._held: OrderedDict[Hashable, _Held] = OrderedDict()  # least recently used first
        self._untimed: list[CopyTicket] = []  # issued, not yet counted
        self.counters = CopyCounters()
        self.evicted_blocks = 0  # blocks that left to make room, over the store's life

    @property
    def used_bytes(self) -> int:
        """Bytes of the buffer held by blocks (whole blocks)."""
        return len(self._held) * self.block_bytes

    @property
    def num_held(self) -> int:
        """Blocks held."""
        return len(self._held)

    def held(self, key: Hashable) -> tuple[int, object] | None:
        """``(tokens, meta)`` of the block held under ``key``; None if none is."""
        h = self._held.get(key)
        return None if h is None else (h.num_tokens, h.meta)

    def pin(self, keys: Collection[Hashable]) -> None:
        """Keep the held blocks among ``keys`` from leaving to make room (once per call, until
        a matching `unpin`)."""
        for key in keys:
            h = self._held.get(key)
            if h is not None:
                h.pins += 1

    def unpin(self, keys: Collection[Hashable]) -> None:
        """Undo one `pin` of the held blocks among ``keys``."""
        for key in keys:
            h = self._held.get(key)
            if h is None:
                continue
            if h.pins <= 0:
                raise KVMemoryError(f"host block {key!r} unpinned more than pinned")
            h.pins -= 1

    def pins(self, key: Hashable) -> int:
        """How many pins keep the block held under ``key`` (0: none, or not held)."""
        h = self._held.get(key)
        return 0 if h is None else h.pins

    def demote(self, keys: Collection[Hashable]) -> None:
        """Make the held, unpinned blocks among ``keys`` the first to leave (the last of them
        first)."""
        for key in keys:
            h = self._held.get(key)
            if h is not None and not h.pins:
                self._held.move_to_end(key, last=False)

    def save(self, slot: int, blocks: Sequence[BlockSave]) -> tuple[CopyTicket | None, int]:
        """Copy to the host the listed blocks of ``slot`` not held yet, in order, making room
        from the least recently used blocks that are unpinned and not listed; stop at the
        first that does not fit. Return the copy's ticket (None: nothing copied) and how many
        of the listed blocks, from the first, are held now. Every listed block held is used
        now, the last one first."""
        fresh: list[BlockSave] = []
        listed = {b.key for b in blocks}
        if len(listed) != len(blocks):
            raise KVMemoryError("a host block listed twice in one save")
        held = 0
        for b in blocks:
            if not 0 < b.num_tokens <= self.block_tokens:
                raise KVMemoryError(f"a host block of {b.num_tokens} tokens "
                                    f"(blocks hold {self.block_tokens})")
            if b.key not in self._held:
                if not self._make_room(len(fresh) + 1, listed):
                    break
                fresh.append(b)
            held += 1
        runs = self.blocks.take(len(fresh))
        assert runs is not None  # `_make_room` said so
        places = [first + i for first, count in runs for i in range(count)]
        for b, place in zip(fresh, places, strict=True):
            self._held[b.key] = _Held(place, b.num_tokens, b.meta)
        for b in reversed(blocks[:held]):
            self._held.move_to_end(b.key)
        if not fresh:
            return None, held
        spans = [(place * self.block_bytes, b.start, b.start + b.num_tokens)
                 for b, place in zip(fresh, places, strict=True)]
        ticket = self.copier.copy(self._pairs(slot, spans, to_host=True), True)
        self._issued(ticket)
        return ticket, held

    def load(self, slot: int, blocks: Sequence[tuple[Hashable, int]], begin: int,
             end: int) -> CopyTicket:
        """Copy the KV of ``slot``'s tokens ``[begin, end)`` from held blocks: ``blocks`` are
        ``(key, start)`` pairs, the token of the slot where each block begins, covering the
        range (the slot maps it). The blocks are used now."""
        ticket = self.copier.copy(self.load_pairs(slot, blocks, begin, end), False)
        self._issued(ticket)
        return ticket

    def load_pairs(self, slot: int, blocks: Sequence[tuple[Hashable, int]], begin: int,
                   end: int) -> list[CopyPair]:
        """The ``(dst, src)`` byte views `load` copies (benches time them with another
        copier); the blocks are used now."""
        spans = []
        for key, start in blocks:
            h = self._held.get(key)
            if h is None:
                raise KVMemoryError(f"no host block {key!r} to load")
            lo, hi = max(begin, start), min(end, start + h.num_tokens)
            if lo < hi:
                spans.append((h.block * self.block_bytes + (lo - start) * self.token_bytes,
                              lo, hi))
        for key, _ in reversed(blocks):
            self._held.move_to_end(key)
        covered = sum(hi - lo for _, lo, hi in spans)
        if covered != end - begin:
            raise KVMemoryError(f"host blocks cover {covered} of tokens [{begin}, {end})")
        return self._pairs(slot, spans, to_host=False)

    def host_bytes(self, key: Hashable) -> torch.Tensor:
        """The bytes of the block held under ``key`` ([tokens x token_bytes] uint8 view;
        tests and benches)."""
        h = self._held.get(key)
        if h is None:
            raise KVMemoryError(f"no host block {key!r}")
        first = h.block * self.block_bytes
        return self.buffer[first: first + h.num_tokens * self.token_bytes]

    def clear(self) -> None:
        """Let every block go (copies still running on them go first: the copier is in
        order)."""
        for h in self._held.values():
            self.blocks.give(((h.block, 1),))
        self._held.clear()

    def _make_room(self, n: int, keep: Collection[Hashable]) -> bool:
        """Free blocks until ``n`` are free, the least recently used unpinned ones not in
        ``keep`` first; False (nothing freed) if that cannot be done."""
        if n <= self.blocks.num_free:
            return True
        victims: list[Hashable] = []
        for key, h in self._held.items():
            if self.blocks.num_free + len(victims) >= n:
                break
            if not h.pins and key not in keep:
                victims.append(key)
        if self.blocks.num_free + len(victims) < n:
            return False
        for key in victims:
            self.blocks.give(((self._held.pop(key).block, 1),))
        self.evicted_blocks += len(victims)
        return True

    def _pairs(self, slot: int, spans: list[tuple[int, int, int]],
               to_host: bool) -> list[CopyPair]:
        """``(dst, src)`` byte views for host offsets and slot token ranges ``(host byte,
        begin, end)``, the runs consecutive on both sides merged into one copy."""
        merged: list[list[int]] = []
        tb = self.token_bytes
        for host, lo, hi in spans:
            last = merged[-1] if merged else None
            if last is not None and last[0] + (last[2] - last[1]) * tb == host and last[2] == lo:
                last[2] = hi
            else:
                merged.append([host, lo, hi])
        pairs = []
        for host, lo, hi in merged:
            dev = self.arena.token_bytes_view(slot, lo, hi)  # [bytes] uint8
            buf = self.buffer[host: host + (hi - lo) * tb]
            pairs.append((buf, dev) if to_host else (dev, buf))
        return pairs

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

    def check_integrity(self) -> None:
        """Raise `KVMemoryError` if the blocks held and the free blocks disagree."""
        places = [h.block for h in self._held.values()]
        if len(set(places)) != len(places):
            raise KVMemoryError("host store: a buffer block holds two keys")
        if len(places) + self.blocks.num_free != self.blocks.num_blocks:
            raise KVMemoryError(f"host store: {len(places)} blocks held + "
                                f"{self.blocks.num_free} free != {self.blocks.num_blocks}")
        free = {first + i for first, count in self.blocks.free for i in range(count)}
        if free & set(places):
            raise KVMemoryError("host store: a held block is on the free list")
        if any(h.pins < 0 for h in self._held.values()):
            raise KVMemoryError("host store: a negative pin count")

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
