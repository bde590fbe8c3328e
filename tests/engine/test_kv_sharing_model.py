"""Property test: sessions on shared prefixes, their eviction, offload and restore, against a
plain-Python model of the memory layer (the prefix index over the arena, with its host tier).

The model knows nothing of the index's code. It keeps each slot's tokens and a list of
abstract page identities (as `tests/memory/test_arena_model.py` does for the bare arena): a
branch at ``r`` tokens shares its source's first ``floor(r * token_bytes / page)`` pages and
gets fresh ones after; an adopted entry keeps its pages. It keeps the entries in LRU order with
their eviction class, and the host tier as a set of token prefixes (a block is named by every
token up to its end: content-addressed). From these it predicts, for every admission, how many
tokens have KV already (the longest common prefix with any slot, at least one block, then the
host's blocks after it under ``offload_all``), for every eviction the victim (lowest rank, then
priority, then LRU) and the pages it frees (tail-first: exactly those asked for; whole: its
pages no other slot maps), and for every restore the pages it shares. After every step the
index's and the arena's integrity checks must hold, every slot's KV must spell its tokens, the
physical sharing must equal the model's (one physical page per abstract page, reference counts
equal to the number of slots mapping it), the LRU order must be the model's, and the host must
hold exactly the model's blocks (each once).

`SmallHostMachine` runs the same rules with a host store of a few blocks, which fills: the
store's own eviction (least recently used unpinned blocks) is not modelled, so there the model's
host blocks are an upper bound: a hit reaches at least the GPU's prefix and at most the model's
host reach, a record restores what remains of it, the store never holds more than the model
saved or than fits, and the KV of every slot must still spell its tokens.

A spare of a hot prefix (`PrefixCache.make_spare`) is taken as the index makes it (which
prefix, when): the model adds an untagged entry sharing the full pages of the slot it
branched from, and every invariant above must hold after it (admissions adopting it, its
eviction, restores branching from it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_helpers import kv_values
from page_model import assert_sharing_matches, page_refcounts
from tiers import examples

from edmm.engine import PrefixCache
from edmm.engine.kv_policy import CACHE_POLICIES, CachePolicy
from edmm.engine.prefix_cache import EntryRank, common_prefix_len
from edmm.memory import KVArena, KVSpec, NoFreeSlotError, PagePool, PoolExhaustedError
from edmm.memory.host import HostVMM
from edmm.memory.offload import HostKVStore

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=80, dtype=torch.float32)  # 640 B/token
PAGE = 4096  # 6.4 tokens a page: page boundaries fall inside tokens
BLOCK = 4
NUM_SLOTS = 8
NUM_PAGES = 48
MAX_TOKENS = 64
PREFIXES = ([900 + i for i in range(30)], [700 + i for i in range(22)])


def pages_for(n: int) -> int:
    return -(-n * SPEC.token_bytes // PAGE)


def full_pages(n: int) -> int:
    return n * SPEC.token_bytes // PAGE


@dataclass
class MSlot:
    """The model of one slot: its tokens, abstract pages, and (an entry) its class."""

    tokens: list[int]
    pages: list[int]
    entry: bool = False
    rank: EntryRank = EntryRank.PLAIN
    priority: float = 0.0
    tag: str | None = None


class SharingMachine(RuleBasedStateMachine):
    policy: CachePolicy = CACHE_POLICIES["sessions"]
    host_bytes = 1 << 22  # never fills here: the model predicts the host exactly

    def __init__(self) -> None:
        super().__init__()
        self.backend = HostVMM(PAGE)
        self.pool = PagePool(self.backend, NUM_PAGES)
        self.arena = KVArena(self.pool, SPEC, NUM_SLOTS, MAX_TOKENS)
        store = HostKVStore(self.arena, self.host_bytes, block_tokens=BLOCK)
        self.cache = PrefixCache(self.arena, BLOCK, offload=store, cache_policy=self.policy)
        self.slots: dict[int, MSlot] = {}
        self.lru: list[int] = []  # entry slots, least recently used first
        self.host: set[tuple[int, ...]] = set()  # blocks: the tokens up to each block's end
        self.records: dict[str, tuple[list[int], float]] = {}  # tag -> tokens, priority
        self.fresh = itertools.count()
        self.tags = itertools.count()
        self.sessions = itertools.count(1)

    # ---------------------------------------------------------------- model helpers
    def counts(self) -> dict[int, int]:
        return page_refcounts(m.pages for m in self.slots.values())

    def gpu_match(self, tokens: list[int]) -> int:
        """The longest prefix of ``tokens`` some slot holds, if at least a block."""
        best = max((common_prefix_len(m.tokens, tokens) for m in self.slots.values()),
                   default=0)
        return best if best >= BLOCK else 0

    def host_reach(self, tokens: list[int], start: int) -> int:
        """How far the host's blocks extend a prefix of ``start`` tokens (the index's walk)."""
        i, end, limit = start // BLOCK, start, len(tokens)
        while i * BLOCK < limit:
            if (i + 1) * BLOCK <= len(tokens) and tuple(tokens[:(i + 1) * BLOCK]) in self.host:
                end, i = (i + 1) * BLOCK, i + 1
                continue
            for n in range(min(BLOCK - 1, len(tokens) - i * BLOCK), 0, -1):
                if tuple(tokens[:i * BLOCK + n]) in self.host:
                    end = i * BLOCK + n
                    break
            break
        return max(end, start)

    @property
    def host_exact(self) -> bool:
        """Whether the model's host blocks are the store's (they fit, and the store never had
        to make room), not only an upper bound on them."""
        store = self.cache.offload_store()
        return (store.evicted_blocks == 0
                and len(self.host) * store.block_bytes <= store.capacity_bytes)

    def reached(self, got: int, gpu: int, bound: int) -> int:
        """Check ``got`` tokens a hit or a record reaches, of which the GPU held ``gpu`` and
        the model's host blocks allow ``bound``; return it."""
        if self.host_exact:
            assert got == bound
        else:
            assert gpu <= got <= bound
        return got

    def to_host(self, tokens: list[int], first_block: int, partial: bool = True) -> None:
        full = len(tokens) // BLOCK
        for i in range(first_block, full):
            self.host.add(tuple(tokens[:(i + 1) * BLOCK]))
        if partial and full * BLOCK < len(tokens):
            self.host.add(tuple(tokens))

    def write(self, slot: int, tokens: list[int], start: int) -> None:
        vals = torch.tensor(tokens[start:], dtype=torch.float32).view(-1, 1, 1, 1, 1)
        self.arena.kv[slot, start:len(tokens)] = vals

    def victim(self, max_rank: EntryRank) -> int | None:
        keyed = [(int(self.slots[s].rank), self.slots[s].priority, i, s)
                 for i, s in enumerate(self.lru) if self.slots[s].rank <= max_rank]
        return min(keyed)[3] if keyed else None

    # ---------------------------------------------------------------- rules
    @rule(which=st.integers(0, len(PREFIXES) - 1), private=st.integers(0, 20),
          session=st.integers(0, 3))
    def admit(self, which: int, private: int, session: int) -> None:
        """A prompt on a shared prefix (a session's private tokens after it; sessions 1-3
        come back with the same tokens, a new one each time otherwise)."""
        sid = session if session else 1000 + next(self.sessions)
        tokens = [*PREFIXES[which], *(sid * 100 + i for i in range(private))]
        r = self.gpu_match(tokens)
        bound = self.host_reach(tokens, r) if self.policy.offload_all else r
        try:
            hit = self.cache.acquire(tokens, len(tokens))
        except (NoFreeSlotError, PoolExhaustedError):
            return  # nothing changed: the pool or the slots are short
        if hit is None:
            assert r == 0 and (bound == 0 or not self.host_exact)
            try:
                slot = self.arena.allocate()
            except NoFreeSlotError:
                return
            m = MSlot([], [])
        else:
            reach = self.reached(hit.num_tokens, r, bound)
            assert hit.host_tokens == reach - r
            slot = hit.slot
            m = self.adopt_or_branch(hit.slot, hit.source, r, reach, tokens)
        self.slots[slot] = m
        assert kv_values(self.arena, slot) == tokens[:len(m.tokens)]
        need = pages_for(len(tokens)) - len(m.pages)
        if need > self.pool.num_free:
            self.cache.release(slot, tokens, len(m.tokens))  # as the scheduler gives it back
            self.released(slot, len(m.tokens))
            return
        self.arena.grow(slot, len(tokens))
        self.write(slot, tokens, len(m.tokens))
        m.tokens, m.pages = list(tokens), m.pages + [next(self.fresh) for _ in range(need)]
        self.cache.track(slot, tokens, len(tokens))
        if self.policy.write_through:
            self.to_host(tokens, 0, partial=False)

    def adopt_or_branch(self, slot: int, source: int, r: int, reach: int,
                        tokens: list[int]) -> MSlot:
        """The model's slot of a hit of ``reach`` tokens whose first ``r`` the GPU held."""
        if slot == source:  # an untagged entry extended entirely: adopted as it is
            m = self.slots.pop(source)
            assert m.entry and m.tag is None and len(m.tokens) == r
            self.lru.remove(source)
            pages = m.pages
        elif source >= 0:  # a branch: the source's full pages, fresh ones after
            src = self.slots[source]
            assert common_prefix_len(src.tokens, tokens) >= r
            pages = src.pages[:full_pages(r)] + [next(self.fresh)
                                                 for _ in range(pages_for(r) - full_pages(r))]
            if src.entry:
                self.lru.remove(source)
                self.lru.append(source)
        else:  # nothing on the GPU: a fresh slot
            assert r == 0
            pages = []
        pages = pages + [next(self.fresh) for _ in range(pages_for(reach) - len(pages))]
        return MSlot(tokens[:reach], pages)

    def released(self, slot: int, n: int, rank: EntryRank = EntryRank.PLAIN,
                 priority: float = 0.0, tag: str | None = None) -> None:
        m = self.slots[slot]
        if n == 0:
            del self.slots[slot]
            return
        m.tokens, m.entry, m.rank, m.priority, m.tag = m.tokens[:n], True, rank, priority, tag
        self.lru.append(slot)

    @precondition(lambda self: any(not m.entry for m in self.slots.values()))
    @rule(data=st.data(), rank=st.sampled_from(list(EntryRank)), priority=st.integers(0, 2))
    def finish(self, data: st.DataObject, rank: EntryRank, priority: int) -> None:
        """A sequence ends: its slot becomes an entry (a paused session's, tagged, if
        ``RETAINED``)."""
        slot = data.draw(st.sampled_from(sorted(s for s, m in self.slots.items()
                                                if not m.entry)))
        m = self.slots[slot]
        tag = f"t{next(self.tags)}" if rank == EntryRank.RETAINED else None
        self.cache.release(slot, m.tokens, len(m.tokens), tag=tag, rank=rank,
                           priority=float(priority))
        self.released(slot, len(m.tokens), rank, float(priority), tag)

    @rule(pages=st.one_of(st.none(), st.integers(1, 6)),
          max_rank=st.sampled_from(list(EntryRank)))
    def evict(self, pages: int | None, max_rank: EntryRank) -> None:
        victim = self.victim(max_rank)
        free = self.pool.num_free
        assert self.cache.evict_one(max_rank, pages=pages) == (victim is not None)
        if victim is None:
            return
        m = self.slots[victim]
        counts = self.counts()
        trimmed = pages is not None and self.policy.tail_first and self.trim(m, pages, counts)
        if trimmed:
            assert pages is not None and self.pool.num_free - free == pages
            return
        assert self.pool.num_free - free == sum(counts[p] == 1 for p in m.pages)
        retained = m.tag is not None and m.rank == EntryRank.RETAINED
        if retained or self.policy.offload_all:
            self.to_host(m.tokens, 0)
        if retained and self.policy.session_records and (
                self.host_exact or m.tag in self.cache.tags()):  # a full host: none kept
            self.records[m.tag] = (m.tokens, m.priority)  # type: ignore[index]
        del self.slots[victim]
        self.lru.remove(victim)

    def trim(self, m: MSlot, pages: int, counts: dict[int, int]) -> bool:
        """The model of a tail-first eviction of ``pages`` pages; False: the entry goes whole."""
        if self.policy.session_records and m.tag is not None and m.rank == EntryRank.RETAINED:
            return False
        tail = next((i for i, p in enumerate(reversed(m.pages)) if counts[p] != 1),
                    len(m.pages))
        if not 0 < pages < tail:
            return False
        n = min((len(m.pages) - pages) * PAGE // SPEC.token_bytes, len(m.tokens))
        if n <= 0 or full_pages(n) < len(m.pages) - tail:
            return False
        if self.policy.offload_all:
            self.to_host(m.tokens, n // BLOCK)
        m.tokens, m.pages = m.tokens[:n], m.pages[:pages_for(n)]
        return True

    @precondition(lambda self: self.records)
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        """A paused session's KV back by its tag: a branch of the longest prefix the GPU
        holds, the rest loaded from the host (no eviction for it here)."""
        tag = data.draw(st.sampled_from(sorted(self.records)))
        tokens, priority = self.records[tag]
        r = self.gpu_match(tokens)
        bound = self.host_reach(tokens, r)
        got = self.cache.offloaded_tokens(tag)
        assert got == 0 or got > r  # 0: the host adds nothing to the GPU's prefix
        reach = self.reached(got or r, r, bound if bound > r else r)
        need = pages_for(reach) - full_pages(r)
        fits = reach > r and self.arena.free_slots() > 0 and need <= self.pool.num_free
        assert self.cache.restore(tag) == fits
        if not fits:
            return
        (slot,) = self.cache.tagged(tag)
        real = self.arena.slot_pages(slot)
        shared = full_pages(r)
        src = next((m.pages[:shared] for m in self.slots.values()  # the slot branched from
                    if common_prefix_len(m.tokens, tokens) >= r
                    and [self.real_of(p) for p in m.pages[:shared]] == real[:shared]), None)
        assert src is not None or r == 0
        self.slots[slot] = MSlot(tokens[:reach], (src or []) + [
            next(self.fresh) for _ in range(pages_for(reach) - shared)], True,
            EntryRank.RETAINED, priority, tag)
        self.lru.append(slot)
        del self.records[tag]

    @rule()
    def spare(self) -> None:
        """A spare of a hot prefix (`PrefixCache.make_spare`): when the index makes one, it
        is a new untagged entry whose KV spells a prefix another slot holds, sharing that
        slot's full pages below it (the model takes the index's choice of prefix, then checks
        everything after it)."""
        if not self.cache.make_spare(min_free_slots=0):
            return
        event("a spare made")
        (slot,) = set(self.cache.entry_slots()) - set(self.slots)
        tokens = kv_values(self.arena, slot)
        real = self.arena.slot_pages(slot)
        shared = full_pages(len(tokens))
        src = next(m for m in self.slots.values()
                   if m.tokens[:len(tokens)] == tokens
                   and [self.real_of(p) for p in m.pages[:shared]] == real[:shared])
        self.slots[slot] = MSlot(list(tokens), src.pages[:shared] + [
            next(self.fresh) for _ in range(pages_for(len(tokens)) - shared)], True)
        self.lru.append(slot)

    def real_of(self, abstract: int) -> int:
        for slot, m in self.slots.items():
            if abstract in m.pages:
                return self.arena.slot_pages(slot)[m.pages.index(abstract)]
        raise AssertionError(f"abstract page {abstract} is mapped nowhere")

    # ---------------------------------------------------------------- invariants
    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity()
        self.arena.check_integrity()

    @invariant()
    def contents_match(self) -> None:
        for slot, m in self.slots.items():
            assert self.arena.num_tokens(slot) == len(m.tokens)
            assert kv_values(self.arena, slot) == m.tokens

    @invariant()
    def sharing_matches(self) -> None:
        assert_sharing_matches(self.arena, ((slot, m.pages) for slot, m in self.slots.items()))
        assert self.pool.num_shared == sum(c > 1 for c in self.counts().values())

    @invariant()
    def lru_order_matches(self) -> None:
        assert self.cache.entry_slots() == self.lru

    @invariant()
    def host_holds_each_block_once(self) -> None:
        store = self.cache.offload_store()
        if self.host_exact:
            assert store.num_held == len(self.host)
        else:
            assert store.num_held <= min(len(self.host), self.host_bytes // store.block_bytes)
        assert self.cache.tags() == {m.tag for m in self.slots.values() if m.tag} | set(
            self.records)

    def teardown(self) -> None:
        self.cache.clear()
        for slot in list(self.slots):
            if not self.slots[slot].entry:
                self.arena.free(slot)
        self.arena.close()
        self.pool.close()
        self.backend.close()


class SmallHostMachine(SharingMachine):
    """The sessions policy with a host store of 6 blocks, fewer than a shared prefix's: saves
    make room, records are cut short (the thorough tier finds c039834's IndexError without
    that fix: a record's block keys ending before the prefix another slot holds)."""

    host_bytes = 6 * BLOCK * SPEC.token_bytes


class ApcMachine(SharingMachine):
    policy = CACHE_POLICIES["apc"]


class BlocksMachine(SharingMachine):
    policy = CACHE_POLICIES["blocks"]


class TieredMachine(SharingMachine):
    policy = CACHE_POLICIES["tiered"]


SETTINGS = settings(max_examples=examples(80), stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
# Marked as @given tests are (hypothesis's plugin marks those): .ci/run's thorough stage
# selects `-m hypothesis` to run every property at its thorough count.
TestSessionsSharing = pytest.mark.hypothesis(SharingMachine.TestCase)
TestSessionsSharing.settings = SETTINGS
TestSmallHostSharing = pytest.mark.hypothesis(SmallHostMachine.TestCase)
TestSmallHostSharing.settings = SETTINGS
TestApcSharing = pytest.mark.hypothesis(ApcMachine.TestCase)
TestApcSharing.settings = SETTINGS
TestBlocksSharing = pytest.mark.hypothesis(BlocksMachine.TestCase)
TestBlocksSharing.settings = SETTINGS
TestTieredSharing = pytest.mark.hypothesis(TieredMachine.TestCase)
TestTieredSharing.settings = SETTINGS
