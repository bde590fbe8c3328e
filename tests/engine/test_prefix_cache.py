"""The prefix cache on a bare arena: longest-prefix lookup, shared pages, LRU eviction."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kv_helpers import filled, host_arena, kv_values

import edmm.engine.prefix_cache as prefix_cache_module
from edmm.engine import PrefixCache
from edmm.memory import KVArena

BLOCK = 4


@pytest.fixture
def arena() -> Iterator[KVArena]:
    with host_arena(num_pages=32) as a:
        yield a


def test_lookup_finds_the_longest_prefix_to_the_token(arena: KVArena) -> None:
    cache = PrefixCache(arena, block_size=BLOCK)
    a = list(range(1, 21))  # 20 tokens
    b = [*a[:9], 99, 98, 97]  # shares 9 with a
    sa, sb = filled(arena, a), filled(arena, b)
    cache.release(sa, a, 20)
    cache.release(sb, b, 12)

    assert cache.lookup([*a[:13], 50], max_tokens=100) == (sa, 13)
    assert cache.lookup([*b, 5], max_tokens=100) == (sb, 12)
    assert cache.lookup([*a[:9], 99, 98, 1], max_tokens=100) == (sb, 11)
    assert cache.lookup(a, max_tokens=len(a) - 1) == (sa, 19)  # capped: last token computed
    assert cache.lookup([*a[:3], 0], max_tokens=100) is None  # under one block
    assert cache.lookup([0, *a], max_tokens=100) is None
    cache.check_integrity()


def test_branch_shares_full_pages_and_copies_the_boundary(arena: KVArena) -> None:
    cache = PrefixCache(arena, block_size=BLOCK)
    tokens = list(range(100, 130))  # 30 tokens: pages 0-2 full, page 3 partial
    src = filled(arena, tokens)
    cache.release(src, tokens, 30)

    hit = cache.acquire([*tokens[:20], 1, 2], max_tokens=21)
    assert hit is not None and (hit.source, hit.num_tokens) == (src, 20)
    src_pages, new_pages = arena.slot_pages(src), arena.slot_pages(hit.slot)
    assert new_pages[:2] == src_pages[:2] and new_pages[2] not in src_pages
    assert kv_values(arena, hit.slot) == tokens[:20]
    arena.free(hit.slot)
    cache.check_integrity()


def test_an_entry_extended_entirely_is_adopted(arena: KVArena) -> None:
    cache = PrefixCache(arena, block_size=BLOCK)
    turn1 = list(range(1, 11))
    slot = filled(arena, turn1)
    cache.release(slot, turn1, 10)
    pages = arena.slot_pages(slot)

    hit = cache.acquire([*turn1, 11, 12], max_tokens=11)
    assert hit is not None and (hit.slot, hit.num_tokens) == (slot, 10)
    assert arena.slot_pages(slot) == pages and cache.num_entries == 0
    assert cache.lookup([*turn1, 0], 100) == (slot, 10)  # still indexed, now as a live source
    cache.check_integrity()


def test_live_source_is_tracked_as_it_grows(arena: KVArena) -> None:
    cache = PrefixCache(arena, block_size=BLOCK)
    tokens = list(range(1, 11))
    slot = filled(arena, tokens)
    cache.track(slot, tokens, 6)
    assert cache.lookup(tokens, 100) == (slot, 6)  # only computed tokens count
    tokens.append(11)  # the live sequence sampled a token: its list grows in place
    cache.track(slot, tokens, 10)
    assert cache.lookup(tokens, 100) == (slot, 10)
    assert cache.num_entries == 0 and not cache.evict_one()  # live sources are not evictable
    cache.release(slot, tokens, 10)
    tokens[0] = -1  # the entry keeps its own copy
    assert cache.lookup(list(range(1, 12)), 100) == (slot, 10)
    cache.check_integrity()


def test_lru_eviction_frees_slots_and_pages(arena: KVArena) -> None:
    cache = PrefixCache(arena, block_size=BLOCK)
    slots = []
    for base in (0, 100, 200):
        tokens = list(range(base, base + 16))
        slots.append(filled(arena, tokens))
        cache.release(slots[-1], tokens, 16)
    hit = cache.acquire([*range(0, 12), 5], 12)  # makes the first entry the most recent
    assert hit is not None and hit.source == slots[0]
    arena.free(hit.slot)

    assert cache.entry_slots() == [slots[1], slots[2], slots[0]]
    assert cache.evict_one()
    assert cache.lookup(list(range(100, 116)), 100) is None
    assert cache.clear() == 2
    assert arena.pool.num_free == arena.pool.capacity
    cache.check_integrity()


def test_disabled_cache_frees_at_release(arena: KVArena) -> None:
    cache = PrefixCache(arena, block_size=BLOCK, enabled=False)
    tokens = list(range(16))
    slot = filled(arena, tokens)
    cache.track(slot, tokens, 16)
    cache.release(slot, tokens, 16)
    assert cache.num_entries == 0 and arena.free_slots() == arena.num_slots
    assert cache.lookup(tokens, 100) is None


def test_hash_collisions_never_reuse_wrong_kv(arena: KVArena,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache_module, "_chain", lambda prev, block: 7)
    cache = PrefixCache(arena, block_size=BLOCK)
    a, b = list(range(16)), list(range(50, 66))
    sa, sb = filled(arena, a), filled(arena, b)
    cache.release(sa, a, 16)
    cache.release(sb, b, 16)
    for query in ([*a[:10], 0], [*b[:12], 0], list(range(200, 220))):
        found = cache.lookup(query, 100)
        if found is not None:
            slot, n = found
            src = a if slot == sa else b
            assert src[:n] == query[:n]
    assert cache.lookup(list(range(200, 220)), 100) is None


@pytest.mark.parametrize("collide", [False, True], ids=["hashes", "colliding-hashes"])
def test_entries_of_another_cache_salt_never_match(arena: KVArena, collide: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tokens under different salts (tenants) share nothing, even when every block
    hash collides; the same salt shares as before."""
    if collide:
        monkeypatch.setattr(prefix_cache_module, "_chain", lambda prev, block: 7)
    cache = PrefixCache(arena, block_size=BLOCK)
    a = list(range(1, 17))
    sa, sb = filled(arena, a), filled(arena, a)
    cache.release(sa, a, 16, salt="tenant-a")
    cache.release(sb, a, 16)  # unsalted
    assert cache.lookup([*a, 0], 100, salt="tenant-a") == (sa, 16)
    assert cache.lookup([*a, 0], 100) == (sb, 16)
    assert cache.lookup([*a, 0], 100, salt="tenant-b") is None
    hit = cache.acquire([*a, 0], 100, salt="tenant-b")
    assert hit is None
    cache.check_integrity()


def test_common_prefix_len_of_equal_and_changed_lists() -> None:
    """The one-pass comparison of lists equal over the range, and the fall-back: a token
    changed anywhere before the end (the last one equal) is found where it is."""
    from edmm.engine.prefix_cache import common_prefix_len
    from edmm.model.prompt_encoder import TokenIds

    base = [(i * 7919) % 150000 for i in range(4099)]
    assert common_prefix_len(base, list(base)) == 4099
    assert common_prefix_len(base, [*base, 5, 6]) == 4099
    assert common_prefix_len([*base, 5], [*base, 6]) == 4099
    assert common_prefix_len(base, list(base), 1000) == 1000
    assert common_prefix_len([], base) == 0
    packed = TokenIds(base, __import__("array").array("q", base))
    for i in (0, 1, 255, 256, 2048, 4097):
        changed = list(base)
        changed[i] += 1
        assert common_prefix_len(changed, base) == i
        assert common_prefix_len(packed, changed, 4099) == i


def test_a_lent_entry_is_extended_in_place_and_its_tail_evicted_first(arena: KVArena) -> None:
    """`lend`: the session's own slot for a speculation that continues its KV (no page mapped
    but the new tokens'); it comes back as the same entry with a speculative tail, which an
    eviction cuts off before any entry of a higher rank (the session's KV stays)."""
    from edmm.engine import EntryRank
    from edmm.memory import KVMemoryError

    cache = PrefixCache(arena, block_size=BLOCK)
    own = list(range(1, 11))  # the session's KV: 10 tokens, pages 0-1 (8 tokens a page)
    slot = filled(arena, own)
    cache.release(slot, own, 10, tag="s", rank=EntryRank.RETAINED, priority=5.0)
    other = list(range(200, 220))
    plain = filled(arena, other)
    cache.release(plain, other, 20)
    fork = [*own[:6], 77, 78]
    assert not cache.lendable("s", fork, keep=6)  # forks before the session's KV ends
    with pytest.raises(KVMemoryError):
        cache.lend("s", fork, keep=6)
    spec = [*own, *range(50, 60)]
    maps = arena.driver.map_pages
    hit = cache.lend("s", spec, keep=10)
    assert (hit.slot, hit.num_tokens, hit.claimed, hit.rank) == (slot, 10, "s", EntryRank.RETAINED)
    assert cache.tagged("s") == [] and "s" in cache.tags()
    cache.set_retention("s", EntryRank.RETAINED, 9.0)  # while lent: kept for its return
    with pytest.raises(KVMemoryError):
        cache.discard(["s"])
    arena.grow(slot, 20)
    arena.kv[slot, 10:20] = torch.arange(50, 60, dtype=torch.float32).view(-1, 1, 1, 1, 1)
    assert arena.driver.map_pages - maps == 1  # page 2 only: no page of the prefix again
    cache.release(slot, spec, 20, tag="ignored", rank=EntryRank.SPECULATIVE)
    assert cache.tagged("s") == [slot] and cache.tail_pages() == 1
    assert cache._lru[slot].own == 10 and cache._lru[slot].priority == 9.0
    cache.check_integrity()
    # A second speculation of the same session continues the tail or cuts it back (never
    # below the session's KV).
    again = [*own, 50, 51, 99]
    hit = cache.lend("s", again, keep=10)
    assert hit.num_tokens == 12 and kv_values(arena, slot) == [*own, 50, 51]
    cache.release(slot, [], 0)  # dropped: given back cut to the session's KV
    assert kv_values(arena, slot) == own and cache._lru[slot].own is None
    hit = cache.lend("s", spec, keep=10)
    arena.grow(slot, 20)
    cache.release(slot, spec, 20)
    # The plain entry ranks below the retained one, but the tail ranks below both.
    assert cache.evict_one(EntryRank.RETAINED)
    assert kv_values(arena, slot) == own and cache.tagged("s") == [slot]
    assert plain in cache.entry_slots()
    cache.check_integrity()


def test_a_tail_that_cannot_be_cut_stays_as_the_owners() -> None:
    """The cut's copy-on-write needs a page: without one the tail stays (valid KV), counted
    as the owner's, and the eviction goes on to other entries."""
    with host_arena(num_pages=11) as arena:
        _tail_that_cannot_be_cut(arena)


def _tail_that_cannot_be_cut(arena: KVArena) -> None:
    from edmm.engine import EntryRank

    cache = PrefixCache(arena, block_size=BLOCK)
    own = list(range(1, 13))  # 12 tokens: the frontier page (page 1) is partly the tail's
    slot = filled(arena, own)
    cache.release(slot, own, 12, tag="s", rank=EntryRank.RETAINED)
    spec = [*own, *range(50, 54)]
    cache.lend("s", spec, keep=12)
    arena.grow(slot, 16)  # pages 0-1, the tail in page 1
    cache.release(slot, spec, 16)
    shared = arena.branch(slot, 16)  # maps pages 0-1: the cut at 12 must copy page 1
    fillers = [arena.allocate(), arena.allocate()]
    arena.grow(fillers[0], 64)  # 8 pages
    arena.grow(fillers[1], 8)  # the last one
    assert arena.pool.num_free == 0
    assert cache.evict_one(EntryRank.SPECULATIVE)  # tried, could not cut
    assert arena.num_tokens(slot) == 16 and cache._lru[slot].own is None
    cache.check_integrity()
    for s in (shared, *fillers):
        arena.free(s)
