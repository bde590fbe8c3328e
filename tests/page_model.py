"""The page-sharing half of the plain-Python models that the state-machine tests of the arena
(tests/memory/test_arena_model.py) and of the prefix index (tests/engine/test_kv_sharing_model.py)
keep: each model slot maps a list of abstract page ids (a branch repeats its source's ids for the
pages it shares, a fresh page gets a new id); these helpers count them and hold the arena's
physical pages to them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from edmm.memory import KVArena


def page_refcounts(slots: Iterable[Sequence[int]]) -> dict[int, int]:
    """How many of the model's slots (each a list of abstract page ids) map each abstract page."""
    counts: dict[int, int] = {}
    for pages in slots:
        for p in pages:
            counts[p] = counts.get(p, 0) + 1
    return counts


def assert_sharing_matches(arena: KVArena, slots: Iterable[tuple[int, Sequence[int]]]) -> None:
    """Assert that the arena's physical pages are shared as the model's abstract ones, given
    every live slot of the arena as ``(slot, abstract page ids)``: the pool uses one page per
    abstract page, each slot maps as many pages as the model says, an abstract page is one
    physical page wherever it is mapped (and no two abstract pages are the same physical one), and
    each physical page's reference count is the number of model slots mapping it."""
    slots = list(slots)
    counts = page_refcounts(pages for _, pages in slots)
    assert arena.pool.num_used == len(counts)
    real_of: dict[int, int] = {}
    for slot, pages in slots:
        real = arena.slot_pages(slot)
        assert len(real) == len(pages)
        for abstract, page in zip(pages, real, strict=True):
            assert real_of.setdefault(abstract, page) == page
            assert arena.pool.refcount(page) == counts[abstract]
    assert len(set(real_of.values())) == len(real_of)
