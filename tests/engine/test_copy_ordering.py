"""Side-stream host copies and the prefix index: no page is unmapped under a running copy, no
sequence gets a slot whose restore has not been waited for, and the KV that comes back is the
KV that left; checked against a plain model with a fake stream whose copies run only when the
test (or an ordering wait) lets them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import PAGE, SPEC, filled, kv_values
from tiers import examples

from edmm.engine import PrefixCache
from edmm.engine.prefix_cache import EntryRank
from edmm.memory import KVArena, PagePool
from edmm.memory.copies import CopyPair, CopyTicket, pairs_nbytes
from edmm.memory.host import HostVMM
from edmm.memory.offload import HostKVStore


@dataclass
class _Op:
    ticket: CopyTicket
    pairs: Sequence[CopyPair]

    def touches(self, start: int, end: int) -> bool:
        """True if the copy reads or writes arena bytes ``[start, end)``."""
        for dst, src in self.pairs:
            t = src if self.ticket.to_host else dst
            if t.data_ptr() < end and start < t.data_ptr() + t.numel():
                return True
        return False


class FakeStream:
    """An in-order copy stream whose copies run only on `progress`, `compute_wait` or `wait`
    (what the GPU would have done by then); records unmaps of pages under a queued copy."""

    asynchronous = True

    def __init__(self) -> None:
        self.queue: list[_Op] = []
        self.violations: list[str] = []

    def copy(self, pairs: Sequence[CopyPair], to_host: bool) -> CopyTicket:
        ticket = CopyTicket(pairs_nbytes(pairs), to_host)
        self.queue.append(_Op(ticket, pairs))
        return ticket

    def poll(self, ticket: CopyTicket) -> bool:
        return ticket.done

    def compute_wait(self, ticket: CopyTicket) -> None:
        self._run_through(ticket)

    def wait(self, ticket: CopyTicket) -> None:
        self._run_through(ticket)

    def progress(self, n: int) -> None:
        for _ in range(min(n, len(self.queue))):
            self._run(self.queue.pop(0))

    def queued_over(self, start: int, end: int) -> list[_Op]:
        """Queued copies touching arena bytes ``[start, end)``."""
        return [op for op in self.queue if op.touches(start, end)]

    def _run_through(self, ticket: CopyTicket) -> None:
        while not ticket.done and self.queue:
            self._run(self.queue.pop(0))

    def _run(self, op: _Op) -> None:
        for dst, src in op.pairs:
            dst.copy_(src)
        op.ticket.seconds = 0.0


class WatchedHost(HostVMM):
    """The host twin, refusing (recording) an unmap of a page a queued copy touches."""

    stream: FakeStream | None = None

    def unmap(self, va: int, size: int) -> None:
        if self.stream is not None:
            bad = self.stream.queued_over(va, va + size)
            if bad:
                self.stream.violations.append(f"unmap of {va:#x} under {len(bad)} copies")
                for op in bad:  # never run a copy over an unmapped page (it would fault)
                    self.stream.queue.remove(op)
                    op.ticket.seconds = 0.0
        super().unmap(va, size)


@contextmanager
def watched_cache(num_pages: int) -> Iterator[tuple[PrefixCache, FakeStream]]:
    backend = WatchedHost(PAGE)
    stream = FakeStream()
    backend.stream = stream
    pool = PagePool(backend, num_pages)
    arena = KVArena(pool, SPEC, num_slots=6, max_tokens=64)
    store = HostKVStore(arena, capacity_bytes=120 * SPEC.token_bytes, copier=stream,
                        block_tokens=4)
    cache = PrefixCache(arena, block_size=4, offload=store)
    try:
        yield cache, stream
    finally:
        stream.progress(len(stream.queue))
        cache.clear()
        arena.close()
        pool.close()
        backend.close()


def _tokens(tag: int, n: int) -> list[int]:
    return [tag * 100 + i + 1 for i in range(n)]


def test_restore_is_awaited_before_the_slot_is_handed_out() -> None:
    with watched_cache(num_pages=12) as (cache, stream):
        arena = cache.arena
        tokens = _tokens(1, 40)
        cache.release(filled(arena, tokens), tokens, 40, tag="s1", rank=EntryRank.RETAINED)
        assert cache.evict_one() and not stream.violations  # the unmap waited for the copy
        assert cache.restore("s1") and len(stream.queue) == 1  # the restore is still queued
        (slot,) = cache.tagged("s1")
        assert cache.pending_copies(slot) == 1
        hit = cache.acquire([*tokens, 7], 100, claim=("s1",))
        assert hit is not None and hit.num_tokens == 40 and not stream.queue
        assert kv_values(arena, hit.slot) == tokens and cache.pending_copies(slot) == 0
        cache.release(hit.slot, [], 0)
        cache.check_integrity()


def test_write_behind_copy_makes_the_eviction_copy_free() -> None:
    with watched_cache(num_pages=12) as (cache, stream):
        arena = cache.arena
        hog = filled(arena, _tokens(9, 48))  # 6 of the 12 pages
        tokens = _tokens(1, 40)  # 5 pages; then 1 page free: its eviction is near
        slot = filled(arena, tokens)
        cache.release(slot, tokens, 40, tag="s1", rank=EntryRank.RETAINED)
        assert cache.shadowed_total == 1 and len(stream.queue) == 1
        stream.progress(1)  # the copy runs beside the steps that follow
        assert cache.evict_one() and cache.shadow_hits == 1 and not stream.queue
        assert cache.offloaded_tokens("s1") == 40
        arena.free(hog)
        assert cache.restore("s1")
        hit = cache.acquire(tokens, 100, claim=("s1",))
        assert hit is not None and kv_values(arena, hit.slot) == tokens
        cache.release(hit.slot, [], 0)
        cache.check_integrity()


_OPS = st.lists(st.tuples(st.sampled_from(["pause", "evict", "restore", "resume", "progress"]),
                          st.integers(0, 2), st.integers(1, 30)), max_size=40)


@settings(max_examples=examples(60), deadline=None)
@given(_OPS)
def test_copies_against_a_plain_model(ops: list[tuple[str, int, int]]) -> None:
    """Random pauses, evictions, restores, resumes and copy progress: every resume sees the
    KV its session paused with (or recomputes), nothing is unmapped under a copy, and the
    host budget matches the cache's copies."""
    with watched_cache(num_pages=14) as (cache, stream):
        arena = cache.arena
        paused: dict[str, list[int]] = {}  # the model: tag -> tokens of its KV
        for op, who, n in ops:
            tag = f"s{who}"
            if op == "pause" and tag not in paused:
                tokens = _tokens(who, n)
                try:
                    slot = filled(arena, tokens)
                except Exception:
                    continue  # no room: the session stays away
                cache.release(slot, tokens, n, tag=tag, rank=EntryRank.RETAINED)
                paused[tag] = tokens
            elif op == "evict":
                cache.evict_one()
            elif op == "restore":
                cache.restore(tag, evict=EntryRank.PLAIN if n % 2 else None)
            elif op == "progress":
                stream.progress(n % 3)
            elif op == "resume" and tag in paused:
                tokens = paused.pop(tag)
                hit = cache.acquire([*tokens, 0], 100, claim=(tag,))
                cache.discard([tag])
                if hit is None:
                    continue  # evicted without a copy: recomputed
                lo = arena.slot_address(hit.slot)
                assert not stream.queued_over(lo, lo + arena.slot_stride)
                assert kv_values(arena, hit.slot)[: hit.num_tokens] == tokens[: hit.num_tokens]
                cache.release(hit.slot, [], 0)
            cache.check_integrity()
            assert not stream.violations
