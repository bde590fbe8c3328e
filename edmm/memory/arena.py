"""The KV arena: one reserved virtual range of ``slots x max_tokens x per-token KV`` bytes.

A slot holds one sequence's KV, virtually contiguous, so ordinary attention kernels read it
through a strided tensor view with no page table. Physical pages from the `PagePool` are mapped
into a slot only as far as its tokens reach: a slot of ``n`` tokens maps exactly
``ceil(backed(n) * token_bytes / page_size)`` pages, ``backed(n)`` being ``n`` rounded up to
``read_align`` tokens (at most ``max_tokens``). With the default ``read_align=1`` a slot never
holds a page beyond its tokens' last one; a kernel that loads whole tiles of keys past a
context (FlashAttention-4 loads 128 at a time) needs ``read_align`` = its tile, so every address
it touches is mapped.

Per-token layout: **token-major across layers**, ``[slot, token, layer, K|V, kv_head, head_dim]``.
Measured on an H200 (docs/design.md): SDPA reads a token-major strided view as fast as
per-layer contiguous KV (decode 48-52 us per layer at 4K-32K; a 512-token prefill on a 16K
cache 0.51 vs 0.52 ms per layer). With per-layer ranges each of the ``layers x 2`` ranges
wastes up to a page (56 MiB of waste per slot for a 28-layer model on 2 MiB pages) and a branch
would have to copy ``layers x 2`` boundary pages; token-major wastes under one page and copies
one. So token-major.

Branch and commit (the zero-copy path):
- `branch` maps the *same* physical pages as the source's full pages below the branch point,
  and copies only the page that holds the boundary;
- `commit` makes the session adopt its branch's slot: an index swap, no copy and no driver call.
  The session's old slot is retired and its pages go back to the pool in `reclaim`, off the
  critical path.

Invariants (checked by `check_integrity`): a slot maps exactly the pages its tokens need; each
page's refcount equals the number of slots mapping it; the page holding a slot's write frontier
(its partially filled last page) and every page after it (the read margin) are private to that
slot, so appending never writes a shared page.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from edmm.memory.errors import (
    InvalidBranchError,
    KVMemoryError,
    NoFreeSlotError,
    PoolExhaustedError,
    SlotOverflowError,
    SlotStateError,
)
from edmm.memory.pool import PagePool


@dataclass(frozen=True)
class KVSpec:
    """The shape of one token's KV across all layers of a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def token_elems(self) -> int:
        """Elements of one token's KV: layers x {K, V} x kv_heads x head_dim."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's KV."""
        return self.token_elems * self.dtype.itemsize


@dataclass
class _Slot:
    in_use: bool = False
    retired: bool = False
    num_tokens: int = 0
    pages: list[int] = field(default_factory=list)  # page id mapped at each page index


@dataclass
class DriverTime:
    """Host seconds of the arena's page maps (map + set access) and unmaps (the fence before
    them excluded), and the pages they moved: the driver cost per page on this machine."""

    map_pages: int = 0
    map_s: float = 0.0
    unmap_pages: int = 0
    unmap_s: float = 0.0

    def mapped(self, pages: int, seconds: float) -> None:
        """Count one mapping call of ``pages`` pages."""
        self.map_pages += pages
        self.map_s += seconds

    def unmapped(self, pages: int, seconds: float) -> None:
        """Count one unmapping of ``pages`` pages."""
        self.unmap_pages += pages
        self.unmap_s += seconds

    def per_page_s(self) -> tuple[float, float] | None:
        """Mean seconds to map and to unmap one page; None until both were seen."""
        if not self.map_pages or not self.unmap_pages:
            return None
        return self.map_s / self.map_pages, self.unmap_s / self.unmap_pages


@dataclass(frozen=True)
class ArenaStats:
    """A snapshot of arena and pool occupancy."""

    slots_in_use: int
    slots_retired: int
    pages_used: int
    pages_free: int
    pages_shared: int
    tokens: int


class KVArena:
    """Slots of virtually contiguous KV over a shared physical page pool; see module docstring."""

    def __init__(self, pool: PagePool, spec: KVSpec, num_slots: int, max_tokens: int,
                 read_align: int = 1) -> None:
        if num_slots < 1 or max_tokens < 1 or read_align < 1:
            raise ValueError("num_slots, max_tokens and read_align must be >= 1")
        self.read_align = read_align
        self.pool = pool
        self.backend = pool.backend
        self.spec = spec
        self.num_slots = num_slots
        self.max_tokens = max_tokens
        self.page_size = pool.page_size
        self.slot_stride = _round_up(max_tokens * spec.token_bytes, self.page_size)
        total = num_slots * self.slot_stride + self.page_size  # + one scratch page for COW
        self._va = self.backend.reserve(total)
        self._reserved = total
        self._scratch_va = self._va + num_slots * self.slot_stride
        self._slots = [_Slot() for _ in range(num_slots)]
        self._retired: list[int] = []
        self._bytes = self.backend.byte_view(self._va, total)  # [total] uint8, zero-copy
        self.kv = self._make_kv_view()
        self.driver = DriverTime()

    # ------------------------------------------------------------------ views
    def _make_kv_view(self) -> torch.Tensor:
        s = self.spec
        item = s.dtype.itemsize
        flat = self._bytes.view(s.dtype)
        shape = (self.num_slots, self.max_tokens, s.num_layers, 2, s.num_kv_heads, s.head_dim)
        h_d = s.num_kv_heads * s.head_dim
        stride = (self.slot_stride // item, s.token_elems, 2 * h_d, h_d, s.head_dim, 1)
        # [slots, max_tokens, layers, 2, kv_heads, head_dim], strided; unmapped beyond tokens.
        return flat.as_strided(shape, stride)

    def layer_kv(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy K and V of one slot and layer, each ``[num_tokens, kv_heads, head_dim]``."""
        n = self._live(slot).num_tokens
        kv = self.kv[slot, :n, layer]  # [n, 2, kv_heads, head_dim]
        return kv[:, 0], kv[:, 1]

    def slot_address(self, slot: int) -> int:
        """Virtual address of a slot's first byte."""
        return self._va + slot * self.slot_stride

    def token_bytes_view(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Zero-copy uint8 view of tokens ``[start, end)`` of a slot (for tests and copies)."""
        if not 0 <= start <= end <= self._live(slot).num_tokens:
            raise SlotOverflowError(f"tokens [{start}, {end}) outside slot {slot}")
        tb = self.spec.token_bytes
        base = slot * self.slot_stride
        return self._bytes[base + start * tb: base + end * tb]

    # ------------------------------------------------------------------ queries
    def num_tokens(self, slot: int) -> int:
        """Tokens a live slot holds."""
        return self._live(slot).num_tokens

    def slot_pages(self, slot: int) -> list[int]:
        """Page ids mapped into a slot, in order (a copy)."""
        return list(self._live(slot).pages)

    def pages_for(self, num_tokens: int) -> int:
        """Pages a slot of ``num_tokens`` tokens maps (its tokens rounded up to
        ``read_align``, at most ``max_tokens``)."""
        backed = num_tokens
        if num_tokens <= self.max_tokens:
            backed = min(_round_up(num_tokens, self.read_align), self.max_tokens)
        return -(-backed * self.spec.token_bytes // self.page_size)

    def _frontier_page(self, num_tokens: int) -> int:
        """Index of the first page a slot of ``num_tokens`` tokens may still write: the page
        holding its frontier (partially filled), or the next one (frontier on a boundary)."""
        return num_tokens * self.spec.token_bytes // self.page_size

    def layout(self) -> list[tuple[int, bool, int, tuple[int, ...]]]:
        """``(slot, retired, tokens, page ids)`` of every slot in use, by slot index: two arenas
        with equal layouts hold the same sequences on the same pages."""
        return [(i, s.retired, s.num_tokens, tuple(s.pages))
                for i, s in enumerate(self._slots) if s.in_use]

    def free_slots(self) -> int:
        """Slots not in use."""
        return sum(not s.in_use for s in self._slots)

    def stats(self) -> ArenaStats:
        """Occupancy snapshot."""
        live = [s for s in self._slots if s.in_use]
        return ArenaStats(
            slots_in_use=len(live), slots_retired=len(self._retired),
            pages_used=self.pool.num_used, pages_free=self.pool.num_free,
            pages_shared=self.pool.num_shared,
            tokens=sum(s.num_tokens for s in live))

    # ------------------------------------------------------------------ lifecycle
    def allocate(self) -> int:
        """Take a free slot (lowest index first) holding zero tokens."""
        for i, s in enumerate(self._slots):
            if not s.in_use:
                s.in_use, s.retired, s.num_tokens, s.pages = True, False, 0, []
                return i
        raise NoFreeSlotError(f"all {self.num_slots} slots are in use")

    def grow(self, slot: int, num_tokens: int) -> None:
        """Map pages so the slot holds ``num_tokens`` tokens (never creates pages).

        Raises `SlotOverflowError` past ``max_tokens`` and `PoolExhaustedError` when the pool is
        short; in both cases the slot is unchanged.
        """
        s = self._writable(slot)
        if num_tokens > self.max_tokens:
            raise SlotOverflowError(
                f"slot {slot}: {num_tokens} tokens exceed max_tokens={self.max_tokens}")
        if num_tokens < s.num_tokens:
            raise SlotStateError(f"slot {slot}: grow to {num_tokens} < {s.num_tokens}; truncate")
        first = len(s.pages)
        new = self.pool.alloc(self.pages_for(num_tokens) - first)
        self._map_pages(slot, first, new)
        s.pages.extend(new)
        s.num_tokens = num_tokens

    def branch(self, src: int, num_tokens: int) -> int:
        """A new slot whose first ``num_tokens`` tokens are those of ``src``.

        Full pages below the branch point are the source's own physical pages (refcount + 1);
        only the page holding the boundary is copied. Returns the new slot.
        """
        s = self._live(src)
        if not 0 <= num_tokens <= s.num_tokens:
            raise InvalidBranchError(
                f"branch of {num_tokens} tokens from slot {src} holding {s.num_tokens}")
        nbytes = num_tokens * self.spec.token_bytes
        full = nbytes // self.page_size
        dst = self.allocate()
        try:
            boundary = self.pool.alloc(self.pages_for(num_tokens) - full)  # + read margin
            pages = s.pages[:full] + boundary
            self._map_pages(dst, 0, pages, fresh=boundary)
        except BaseException:
            self._slots[dst].in_use = False
            raise
        for p in s.pages[:full]:
            self.pool.incref(p)
        d = self._slots[dst]
        d.pages, d.num_tokens = pages, num_tokens
        if nbytes % self.page_size:
            self._copy_bytes(self.slot_address(dst) + full * self.page_size,
                             self.slot_address(src) + full * self.page_size,
                             nbytes - full * self.page_size)
        return dst

    def commit(self, session: int, branch: int) -> int:
        """The session adopts ``branch``'s slot: returns ``branch``; no copy, no driver call.

        The session's old slot is retired: it stays mapped until `reclaim` releases it, so the
        resume pays for no unmap.
        """
        if session == branch:
            raise SlotStateError(f"commit of slot {session} onto itself")
        old = self._writable(session)
        self._writable(branch)
        old.retired = True
        self._retired.append(session)
        return branch

    def truncate(self, slot: int, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens; unmap pages past them.

        If the new frontier page (partly filled) or a page after it is shared (mapped by another
        slot too), it is replaced by a private copy, so later appends never write into another
        slot's tokens. Raises `PoolExhaustedError` with the slot unchanged when the pool cannot
        give those copies (counting the pages the truncation itself frees).
        """
        s = self._writable(slot)
        if not 0 <= num_tokens <= s.num_tokens:
            raise InvalidBranchError(f"truncate slot {slot} of {s.num_tokens} to {num_tokens}")
        keep = self.pages_for(num_tokens)
        frontier = self._frontier_page(num_tokens)
        shared = [i for i in range(frontier, min(keep, len(s.pages)))
                  if self.pool.refcount(s.pages[i]) > 1]
        freed = sum(self.pool.refcount(p) == 1 for p in s.pages[keep:])
        if len(shared) > self.pool.num_free + freed:
            raise PoolExhaustedError(len(shared), self.pool.num_free + freed)
        if keep < len(s.pages):
            self._unmap_pages(slot, keep)
        s.num_tokens = num_tokens
        partial = (num_tokens * self.spec.token_bytes) % self.page_size
        for index in shared:  # the margin's bytes need no copy
            self._make_private(slot, index, partial if index == frontier else 0)

    def free(self, slot: int) -> None:
        """Unmap every page of a slot and give the slot back (retired slots too)."""
        s = self._live(slot)
        self._unmap_pages(slot, 0)
        if s.retired:
            self._retired.remove(slot)
        s.in_use, s.retired, s.num_tokens = False, False, 0

    def reclaim(self) -> int:
        """Free every retired slot (off the critical path); return how many."""
        retired = list(self._retired)
        for slot in retired:
            self.free(slot)
        return len(retired)

    def close(self) -> None:
        """Free all slots and give the virtual range back. Drop every view before calling."""
        for i, s in enumerate(self._slots):
            if s.in_use:
                self.free(i)
        del self.kv, self._bytes
        self.backend.free_range(self._va, self._reserved)

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Raise `KVMemoryError` if any invariant of the arena or pool is broken."""
        self.pool.check_integrity()
        mapped: Counter[int] = Counter()
        for i, s in enumerate(self._slots):
            if not s.in_use:
                if s.pages or s.retired:
                    raise KVMemoryError(f"slot {i}: free slot holds pages or is retired")
                continue
            if len(s.pages) != self.pages_for(s.num_tokens):
                raise KVMemoryError(f"slot {i}: {len(s.pages)} pages for {s.num_tokens} tokens")
            if len(set(s.pages)) != len(s.pages):
                raise KVMemoryError(f"slot {i}: a page is mapped twice")
            for p in s.pages[self._frontier_page(s.num_tokens):]:
                if self.pool.refcount(p) != 1:
                    raise KVMemoryError(f"slot {i}: page {p} at or past the frontier is shared")
            mapped.update(s.pages)
        for p in range(self.pool.capacity):
            if self.pool.refcount(p) != mapped[p]:
                raise KVMemoryError(
                    f"page {p}: refcount {self.pool.refcount(p)} != {mapped[p]} mappings")
        if sorted(self._retired) != sorted(i for i, s in enumerate(self._slots) if s.retired):
            raise KVMemoryError("retired list out of sync with slots")

    # ------------------------------------------------------------------ internals
    def _live(self, slot: int) -> _Slot:
        if not 0 <= slot < self.num_slots:
            raise SlotStateError(f"slot {slot} out of range [0, {self.num_slots})")
        s = self._slots[slot]
        if not s.in_use:
            raise SlotStateError(f"slot {slot} is not in use")
        return s

    def _writable(self, slot: int) -> _Slot:
        s = self._live(slot)
        if s.retired:
            raise SlotStateError(f"slot {slot} is retired (committed away)")
        return s

    def _map_pages(self, slot: int, first: int, pages: list[int],
                   fresh: list[int] | None = None) -> None:
        """Map ``pages`` at page indices ``first..`` of a slot and grant access in one call.

        On failure, undo the mappings made and return the pages in ``fresh`` (default: all of
        ``pages``, which the caller allocated) to the pool.
        """
        fresh = pages if fresh is None else fresh
        base = self.slot_address(slot) + first * self.page_size
        done = 0
        t0 = time.perf_counter()
        try:
            for i, p in enumerate(pages):
                self.backend.map(base + i * self.page_size, self.pool.handle(p))
                done += 1
            if pages:
                self.backend.set_access(base, len(pages) * self.page_size)
            self.driver.mapped(len(pages), time.perf_counter() - t0)
        except BaseException:
            if done:
                self.backend.unmap(base, done * self.page_size)
            for p in fresh:
                self.pool.decref(p)
            raise

    def _unmap_pages(self, slot: int, keep: int) -> None:
        """Unmap a slot's pages from index ``keep`` on (one driver call) and drop their
        references."""
        s = self._slots[slot]
        if keep >= len(s.pages):
            return
        self.backend.fence()
        n = len(s.pages) - keep
        t0 = time.perf_counter()
        self.backend.unmap(self.slot_address(slot) + keep * self.page_size, n * self.page_size)
        self.driver.unmapped(n, time.perf_counter() - t0)
        for p in reversed(s.pages[keep:]):  # last page first, as the pool has always seen
            self.pool.decref(p)
        del s.pages[keep:]

    def _make_private(self, slot: int, index: int, nbytes: int) -> None:
        """Copy-on-write: replace page ``index`` of a slot by a private copy of its first bytes."""
        s = self._slots[slot]
        (new,) = self.pool.alloc(1)
        va = self.slot_address(slot) + index * self.page_size
        scratch = self._scratch_va
        try:
            self.backend.map(scratch, self.pool.handle(new))
            self.backend.set_access(scratch, self.page_size)
        except BaseException:
            self.pool.decref(new)
            raise
        self._copy_bytes(scratch, va, nbytes)
        self.backend.fence()
        self.backend.unmap(scratch, self.page_size)
        self.backend.unmap(va, self.page_size)
        self.backend.map(va, self.pool.handle(new))
        self.backend.set_access(va, self.page_size)
        self.pool.decref(s.pages[index])
        s.pages[index] = new

    def _copy_bytes(self, dst_va: int, src_va: int, nbytes: int) -> None:
        """Device copy of ``nbytes`` between two mapped addresses of this arena."""
        d, s = dst_va - self._va, src_va - self._va
        self._bytes[d: d + nbytes].copy_(self._bytes[s: s + nbytes])


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m
