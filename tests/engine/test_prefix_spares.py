"""Spare branches of a hot prefix (`PrefixCache.make_spare`): mapped ahead of an admission,
adopted whole by it (no page mapped then), the prefix's pages still one physical copy; and an
engine with spares on gives the same greedy outputs and cached counts as one with them off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kv_helpers import host_arena, kv_values

from edmm.engine import EngineConfig, PrefixCache, SamplingParams
from edmm.engine.engine import Engine
from edmm.memory import KVArena, KVSpec

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=80, dtype=torch.float32)  # 640 B/token
# 6.4 tokens a 4 KiB page of `host_arena`: page boundaries fall inside tokens
BLOCK = 4
PREFIX = [1000 + i for i in range(100)]  # 15 full pages, the boundary inside page 16


@pytest.fixture
def arena() -> Iterator[KVArena]:
    with host_arena(200, num_slots=8, max_tokens=256, spec=SPEC) as a:
        yield a


def _admit(cache: PrefixCache, tokens: list[int]) -> tuple[int, int]:
    """Admit ``tokens`` as the scheduler does, then finish it as an entry; (slot, source)."""
    arena = cache.arena
    hit = cache.acquire(tokens, len(tokens))
    slot = arena.allocate() if hit is None else hit.slot
    start = 0 if hit is None else hit.num_tokens
    assert kv_values(arena, slot)[:start] == tokens[:start]
    arena.grow(slot, len(tokens))
    arena.kv[slot, start:len(tokens)] = torch.tensor(
        tokens[start:], dtype=torch.float32).view(-1, 1, 1, 1, 1)
    cache.track(slot, tokens, len(tokens))
    cache.release(slot, tokens, len(tokens))
    return slot, -2 if hit is None else hit.source


def _prompt(i: int) -> list[int]:
    return [*PREFIX, *(i * 1000 + k for k in range(20))]


def test_a_hot_prefix_gets_a_spare_that_the_next_admission_adopts(arena: KVArena) -> None:
    cache = PrefixCache(arena, BLOCK)
    _admit(cache, _prompt(1))
    assert not cache.make_spare()  # no branch yet
    _admit(cache, _prompt(2))  # branches at the prefix: once
    assert not cache.make_spare()
    _admit(cache, _prompt(3))  # twice: hot
    used = arena.pool.num_used
    assert cache.make_spare() and cache.spares_made == 1
    spare = cache.entry_slots()[-1]
    assert kv_values(arena, spare) == PREFIX
    assert arena.pool.num_used == used + 1  # the boundary page only: 15 pages shared
    assert arena.slot_pages(spare)[:15] == arena.slot_pages(cache.entry_slots()[0])[:15]
    assert not cache.make_spare()  # one spare of it at a time
    pages_before = arena.driver.map_pages
    slot, source = _admit(cache, _prompt(4))
    assert slot == source == spare and cache.spares_used == 1  # adopted whole
    assert arena.driver.map_pages - pages_before == 3  # its own 20 tokens' pages only
    assert kv_values(arena, slot) == _prompt(4)
    cache.check_integrity()
    assert cache.make_spare()  # the prefix is still hot: the next spare


def test_no_spare_when_slots_are_short(arena: KVArena) -> None:
    cache = PrefixCache(arena, BLOCK)
    for i in range(3):
        _admit(cache, _prompt(i))
    assert not cache.make_spare(min_free_slots=arena.free_slots())
    assert not cache.make_spare(min_free_pages=arena.pool.num_free + 1)
    assert cache.make_spare()


def test_a_prefix_gone_from_the_pool_is_forgotten(arena: KVArena) -> None:
    """Once no slot holds a hot prefix, it is forgotten: it is hot again only after two more
    branches, not the first."""
    from edmm.engine.prefix_cache import EntryRank

    cache = PrefixCache(arena, BLOCK)
    for i in range(3):
        _admit(cache, _prompt(i))
    while cache.evict_one(EntryRank.RETAINED):
        pass
    assert cache.num_entries == 0 and not cache.make_spare()
    _admit(cache, _prompt(5))  # computed again
    _admit(cache, _prompt(6))  # one branch since
    assert not cache.make_spare()
    _admit(cache, _prompt(7))
    assert cache.make_spare()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_outputs_equal_with_spares_on_and_off(async_scheduling: bool) -> None:
    """Eight requests on a shared 96-token prefix, one after the other: with spares (async
    scheduling: made while a launched step computes), later ones adopt a spare; the greedy
    tokens and cached counts equal the run without spares (and in step, none is made)."""
    rng = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 1000, (96,), generator=rng).tolist()
    prompts = [prefix + torch.randint(3, 1000, (24,), generator=rng).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = {}
    for spares in (True, False):
        engine = Engine(EngineConfig(device="cpu", prefix_spares=spares,
                                     async_scheduling=async_scheduling))
        got = []
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
            while engine.has_unfinished():
                got += [(o.request_id, tuple(o.outputs[0].token_ids), o.num_cached_tokens)
                        for o in engine.step() if o.finished]
        stats = engine.kv.stats()
        runs[spares] = (got, stats)
        if spares and async_scheduling:
            assert stats.spares_made >= 5 and stats.spares_used >= 5
        else:
            assert stats.spares_made == stats.spares_used == 0
        engine.close()
    assert runs[True][0] == runs[False][0]
    assert all(cached >= 96 - 16 for _, _, cached in runs[True][0][1:])


def test_serve_flag_turns_spares_off() -> None:
    from edmm.server.cli import build_parser, config_from_args

    on = config_from_args(build_parser().parse_args([]))
    off = config_from_args(build_parser().parse_args(["--no-prefix-spares"]))
    assert "prefix_spares" not in on.engine  # the engine's default: on
    assert EngineConfig().prefix_spares and off.engine["prefix_spares"] is False
