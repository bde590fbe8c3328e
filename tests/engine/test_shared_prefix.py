"""One physical copy of a shared prefix, with exact page counts on the host twin.

Sessions whose prompts share a prefix map the same pages for its full pages (a branch of
whichever slot holds it), also after an offload and restore (the restore branches from the
prefix the GPU still holds and loads only the rest from the host), after a zero-copy commit
and after tail-first eviction; no eviction frees a page another slot maps.

The page arithmetic: 640 B of KV per token on 4 KiB pages is 6.4 tokens a page, so page
boundaries fall inside tokens (as on CUDA, where a 7B model's 56 KiB tokens put ~36.6 on a
2 MiB page). A prefix of ``p`` tokens shares ``floor(p * 640 / 4096)`` full pages; the page
holding its boundary is copied by each session that branches from it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kv_helpers import filled, kv_values

from edmm.engine import KVCacheManager, PrefixCache
from edmm.engine.kv_policy import CACHE_POLICIES
from edmm.engine.prefix_cache import EntryRank
from edmm.memory import KVArena, KVSpec, PagePool, open_backend
from edmm.memory.offload import HostKVStore

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=80, dtype=torch.float32)  # 640 B/token
PAGE = 4096
BLOCK = 4


def full_pages(n: int) -> int:
    """Pages that the first ``n`` tokens fill entirely (shared by a branch at ``n``)."""
    return n * SPEC.token_bytes // PAGE


def pages_for(n: int) -> int:
    return -(-n * SPEC.token_bytes // PAGE)


@pytest.fixture
def arena() -> Iterator[KVArena]:
    backend = open_backend("host", host_page_size=PAGE)
    pool = PagePool(backend, 400)
    a = KVArena(pool, SPEC, num_slots=16, max_tokens=1024)
    yield a
    a.check_integrity()
    a.close()
    pool.close()
    backend.close()


def _cache(arena: KVArena, policy: str = "sessions", host: bool = True) -> PrefixCache:
    store = HostKVStore(arena, 1 << 22, block_tokens=BLOCK) if host else None
    return PrefixCache(arena, BLOCK, offload=store, cache_policy=CACHE_POLICIES[policy])


PREFIX = [1000 + i for i in range(250)]  # 250 tokens: 39 full pages (39.06), boundary in page 40


def _prompt(session: int, private: int) -> list[int]:
    return [*PREFIX, *(session * 10_000 + i for i in range(private))]


def _admit(cache: PrefixCache, tokens: list[int]) -> int:
    """A sequence of ``tokens`` admitted as the scheduler does: the longest cached prefix
    (branched or loaded), the rest computed (written) into its slot, then tracked."""
    arena = cache.arena
    hit = cache.acquire(tokens, len(tokens))
    slot = arena.allocate() if hit is None else hit.slot
    start = 0 if hit is None else hit.num_tokens
    assert kv_values(arena, slot)[:start] == tokens[:start]  # the reused KV is the prompt's
    arena.grow(slot, len(tokens))
    arena.kv[slot, start:len(tokens)] = torch.tensor(
        tokens[start:], dtype=torch.float32).view(-1, 1, 1, 1, 1)
    cache.track(slot, tokens, len(tokens))
    return slot


TAILS = (30, 7, 64, 1, 45)  # private tokens of each session


def _fleet_pages(tails: tuple[int, ...]) -> int:
    """The prefix's full pages once, plus each session's pages past them."""
    return full_pages(len(PREFIX)) + sum(pages_for(len(PREFIX) + t) - full_pages(len(PREFIX))
                                         for t in tails)


def test_a_fleet_maps_its_shared_prefix_once(arena: KVArena) -> None:
    """Five sessions on a 250-token prefix: 39 shared pages once, then each session's own
    pages; the shared pages have one reference per session."""
    cache = _cache(arena)
    slots = [_admit(cache, _prompt(s, t)) for s, t in enumerate(TAILS)]
    assert arena.pool.num_used == _fleet_pages(TAILS) == 39 + 5 + 2 + 11 + 1 + 8
    shared = arena.slot_pages(slots[0])[:full_pages(len(PREFIX))]
    for slot in slots:
        assert arena.slot_pages(slot)[:39] == shared
    assert {arena.pool.refcount(p) for p in shared} == {5}
    assert arena.pool.num_shared == 39 and arena.stats().pages_shared == 39
    for s, (slot, t) in enumerate(zip(slots, TAILS, strict=True)):
        assert kv_values(arena, slot) == _prompt(s, t)
    cache.check_integrity()


@pytest.mark.parametrize("policy", ["sessions", "blocks"])
def test_offload_and_restore_keep_the_shared_count(arena: KVArena, policy: str) -> None:
    """Two of the five sessions paused, evicted to the host and brought back: the pool goes
    down by their private pages only (the prefix stays, mapped by the others) and back up to
    the fleet's count, not by a second copy of the prefix; only their private tokens come back
    over the copy (the prefix's boundary page is copied on the GPU, from the slot that holds
    it)."""
    cache = _cache(arena, policy)
    kv = KVCacheManager(arena, cache)
    prompts = [_prompt(s, t) for s, t in enumerate(TAILS)]
    slots = [_admit(cache, p) for p in prompts]
    for s in (1, 3):  # paused: their turns ended, their KV an entry of their session
        cache.release(slots[s], prompts[s], len(prompts[s]), tag=f"s{s}",
                      rank=EntryRank.RETAINED)
    assert kv.make_room() and kv.make_room() and cache.num_entries == 0
    private = sum(pages_for(len(prompts[s])) - full_pages(len(PREFIX)) for s in (1, 3))
    assert arena.pool.num_used == _fleet_pages(TAILS) - private
    store = cache.offload_store()
    loaded = store.counters.loaded_bytes
    if policy == "sessions":
        assert kv.restore_claimed({"s1", "s3"})
        back = [cache.tagged(f"s{s}")[0] for s in (1, 3)]
    else:  # the resumes' admissions load what the GPU lacks
        back = [_admit(cache, prompts[s]) for s in (1, 3)]
    assert arena.pool.num_used == _fleet_pages(TAILS)
    for slot, s in zip(back, (1, 3), strict=True):
        assert arena.slot_pages(slot)[:39] == arena.slot_pages(slots[0])[:39]
        assert kv_values(arena, slot) == prompts[s]
    want = sum(len(prompts[s]) - len(PREFIX) for s in (1, 3)) * SPEC.token_bytes
    assert store.counters.loaded_bytes - loaded == want
    kv.check_integrity()


def test_two_sessions_sharing_62_pages_stay_at_83_after_one_is_restored(arena: KVArena) -> None:
    """Two sessions sharing 62 pages of a common prefix, 83 pages in all; one is offloaded
    and restored: still 83 (a restore into a fresh slot would map 72 more)."""
    cache = _cache(arena)
    kv = KVCacheManager(arena, cache)
    prefix = [7] + [2000 + i for i in range(397)]  # 398 tokens: 62 full pages (62.2)
    a = [*prefix, *range(1, 62)]  # 459 tokens: 72 pages
    b = [*prefix, *range(101, 168)]  # 465 tokens: 73 pages
    sa, sb = (_admit(cache, t) for t in (a, b))
    assert full_pages(len(prefix)) == 62 and arena.pool.num_used == 62 + 10 + 11 == 83
    cache.release(sa, a, len(a), tag="a", rank=EntryRank.RETAINED)
    assert kv.make_room() and arena.pool.num_used == 73
    assert kv.restore("a") and arena.pool.num_used == 83
    (restored,) = cache.tagged("a")
    assert arena.slot_pages(restored)[:62] == arena.slot_pages(sb)[:62]
    assert kv.stats().pages_shared == 62 and kv.stats().pages_private == 21
    assert kv_values(arena, restored) == a
    kv.check_integrity()


def test_a_restore_with_nothing_resident_maps_a_fresh_slot_and_shares_after(
        arena: KVArena) -> None:
    """With no slot holding the prefix, the first restore loads all of it; the second session
    restored then branches from the first: the prefix is mapped once again."""
    cache = _cache(arena)
    kv = KVCacheManager(arena, cache)
    prompts = [_prompt(s, t) for s, t in ((0, 30), (1, 7))]
    for s, p in enumerate(prompts):
        cache.release(_admit(cache, p), p, len(p), tag=f"s{s}", rank=EntryRank.RETAINED)
    while kv.make_room():
        pass
    assert arena.pool.num_used == 0
    assert kv.offloaded_tokens("s0") == len(prompts[0])
    assert kv.restore("s0") and arena.pool.num_used == pages_for(len(prompts[0]))
    assert kv.restore("s1") and arena.pool.num_used == _fleet_pages((30, 7))
    kv.check_integrity()


def test_sharing_survives_a_zero_copy_commit(arena: KVArena) -> None:
    """A session on the shared prefix speculates into a branch of its entry and adopts it at
    resume (a commit: slot indices swap); once the old slot is reclaimed the pool holds the
    prefix once, the other session and the committed slot's own pages, nothing more."""
    cache = _cache(arena)
    kv = KVCacheManager(arena, cache)
    first = _prompt(0, 30)
    other = _admit(cache, first)
    mine = _prompt(1, 20)
    slot = _admit(cache, mine)
    cache.release(slot, mine, len(mine), tag="s1", rank=EntryRank.RETAINED)
    predicted = [*mine, 77, 78, 79, 80, 81, 82]
    branch = filled(arena, predicted, src=slot, at=len(mine))
    cache.release(branch, predicted, len(predicted), tag="s1/b0", rank=EntryRank.SPECULATIVE)
    hit = kv.match([*predicted, 5], len(predicted), claim=("s1/b0",), own_tag="s1")
    assert hit is not None and hit.slot == branch and hit.committed == (slot,)
    assert kv.reclaim() == 1
    assert arena.pool.num_used == _fleet_pages((30, len(predicted) - len(PREFIX)))
    assert arena.slot_pages(branch)[:39] == arena.slot_pages(other)[:39]
    assert kv_values(arena, branch) == predicted
    cache.release(branch, predicted, len(predicted))
    kv.check_integrity()


def test_evicting_a_session_never_frees_pages_another_maps(arena: KVArena) -> None:
    """Every entry of the fleet but one evicted: the survivor's pages, the shared prefix's
    included, stay mapped and hold its KV; each eviction freed its private pages only."""
    cache = _cache(arena, host=False)
    prompts = [_prompt(s, t) for s, t in enumerate(TAILS)]
    slots = [_admit(cache, p) for p in prompts]
    for slot, p in zip(slots[:-1], prompts[:-1], strict=True):
        cache.release(slot, p, len(p))
    for p in prompts[:-1]:
        free = arena.pool.num_free
        assert cache.evict_one()
        assert arena.pool.num_free - free == pages_for(len(p)) - full_pages(len(PREFIX))
    assert arena.pool.num_used == pages_for(len(prompts[-1]))
    assert kv_values(arena, slots[-1]) == prompts[-1]
    cache.check_integrity()


def test_tail_first_eviction_frees_what_is_asked_from_the_tail(arena: KVArena) -> None:
    """Under ``apc`` an eviction asked for k pages unmaps the victim's last k pages and keeps
    its prefix indexed (a later prompt still finds it); an entry whose private pages are no
    more than asked goes whole, and never takes a shared page with it."""
    cache = _cache(arena, "apc", host=False)
    base = _prompt(0, 150)  # 400 tokens: 63 pages
    slot = _admit(cache, base)
    _admit(cache, _prompt(1, 10))  # shares the prefix's 39 full pages
    cache.release(slot, base, len(base))
    used = arena.pool.num_used
    assert cache.evict_one(pages=5) and arena.pool.num_used == used - 5
    kept = cache.lookup(base, len(base))
    assert kept == (slot, (63 - 5) * PAGE // SPEC.token_bytes)  # 371 tokens on 58 pages
    assert cache.trimmed_pages == 5 and cache.num_entries == 1
    private = 63 - 39  # the entry's private pages: 24; 5 gone, 19 left, fewer than 30
    assert cache.evict_one(pages=30) and arena.pool.num_used == used - private
    assert cache.num_entries == 0
    assert cache.lookup(base, len(base)) is not None  # the prefix, held by the other session
    cache.check_integrity()


def test_blocks_are_written_through_once_and_shared_blocks_held_once(arena: KVArena) -> None:
    """Under ``blocks`` every full block goes to the host as it is computed; a second session
    on the same prefix copies only its own blocks (the prefix's are held); finishing a turn
    copies nothing more than its last partial block at eviction."""
    cache = _cache(arena, "blocks")
    store = cache.offload_store()
    first = _prompt(0, 30)  # 280 tokens: 70 blocks
    _admit(cache, first)
    assert store.num_held == 70 and store.counters.saved_bytes == 280 * SPEC.token_bytes
    second = _prompt(1, 7)  # 257 tokens: 62 prefix blocks held, 2 of its own
    _admit(cache, second)
    assert store.num_held == 70 + 2
    assert store.counters.saved_bytes == (280 + 8) * SPEC.token_bytes
    cache.check_integrity()


def test_an_unknown_cache_policy_is_refused_naming_the_known_ones() -> None:
    from edmm.engine.config import EngineConfig, EngineConfigError
    from edmm.engine.kv_policy import cache_policy

    known = r"\['apc', 'blocks', 'sessions', 'tiered'\]"
    with pytest.raises(EngineConfigError, match=f"kv_cache_policy must be one of {known}, "
                                                "got 'lru'"):
        EngineConfig(kv_cache_policy="lru")
    with pytest.raises(ValueError, match=f"unknown KV cache policy 'lru'; known: {known}"):
        cache_policy("lru")
    assert cache_policy("apc") == CACHE_POLICIES["apc"]


def test_a_record_whose_host_keys_end_before_the_gpu_s_match_is_restorable(
        arena: KVArena) -> None:
    """A host record whose known block keys end before the prefix another slot holds on the
    GPU has the missing chain hashes computed. Such a record is a copy cut short by a full
    host store (`PrefixCache._save` keeps the blocks that fit; on 2026-12-07's fleet replay
    17 keys for a 700-token record, 522 tokens matched on the GPU): before, ``offloaded_tokens``
    raised IndexError on the engine thread and the server failed every request."""
    cache = _cache(arena)
    kv = KVCacheManager(arena, cache)
    a = _prompt(0, 30)
    cache.release(_admit(cache, a), a, len(a), tag="s0", rank=EntryRank.RETAINED)
    while kv.make_room():
        pass
    off = cache._offloaded["s0"]
    off.keys = off.keys[:3]  # keys known for the first 3 blocks only
    b = _prompt(1, 5)
    _admit(cache, b)  # a slot holding the 250-token prefix on the GPU
    assert kv.offloaded_tokens("s0") == len(a)  # the host blocks past the GPU's match
    assert kv.restore("s0")
    (restored,) = cache.tagged("s0")
    assert kv_values(arena, restored) == a
    kv.check_integrity()
