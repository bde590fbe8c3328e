"""`edmm.server.collector`: the young garbage collection the server's engine thread runs when
it goes idle, so that a request's allocations seldom pay for walking earlier turns' id lists."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from server_helpers import LiveServer

from edmm.server.collector import SERVING_THRESHOLD0, collect_young, raise_threshold
from edmm.server.engine_loop import EngineLoop


class IdleEngine:
    """An engine with no requests: the loop only runs commands and goes idle."""

    def step(self) -> list[object]:
        return []

    def has_unfinished(self) -> bool:
        return False

    def abort(self, request_id: str) -> bool:
        return False

    def reclaim(self) -> int:
        return 0

    def tick(self) -> int:
        return 0

    def next_timer_s(self) -> float | None:
        return None


@pytest.fixture
def thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def _young(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects(0))


def test_collect_young_moves_a_young_id_list_out_of_the_young_generation() -> None:
    ids = list(range(16_384))  # like a prompt's ids left by a turn
    assert _young(ids)
    collect_young()
    assert not _young(ids) and not any(o is ids for o in gc.get_objects(1))


def test_raise_threshold_sets_the_youngest_only(thresholds: None) -> None:
    gc.set_threshold(700, 11, 12)
    assert raise_threshold() == (700, 11, 12)
    assert gc.get_threshold() == (SERVING_THRESHOLD0, 11, 12)


@pytest.mark.parametrize("hook", [collect_young, None])
def test_a_server_loop_leaves_no_young_id_list_once_idle(thresholds: None, hook: object) -> None:
    """What a turn leaves behind is collected when the engine thread goes idle: the next
    request's first allocations start with the young generations empty of it (without the
    hook, the control, it stays young)."""
    gc.set_threshold(10**9, 10, 10)  # no automatic collection: only the hook can move it
    lp = EngineLoop(IdleEngine(), on_idle=hook)  # type: ignore[arg-type, type-var]
    lp.start()
    try:
        left = lp.call(lambda e: list(range(16_384))).result(5)  # made on the engine thread
        lp.call(lambda e: None).result(5)  # the loop went idle in between
        assert _young(left) == (hook is None)
    finally:
        lp.stop()


def test_the_server_collects_what_a_turn_left_once_its_engine_is_idle(
        server: LiveServer, thresholds: None) -> None:
    """`ServerState`'s engine loop runs `collect_young` when idle."""
    gc.set_threshold(10**9, 10, 10)
    state = server.state
    left = state.loop.call(lambda e: list(range(16_384))).result(10)
    state.loop.call(lambda e: None).result(10)
    assert not _young(left)


def test_stage_timer_counts_collections_up_to_its_last_stage() -> None:
    """`StageTimer`: the collections between its creation and its last stage, per
    generation; none counted after that."""
    import gc

    from edmm.server.stages import LAST, StageTimer

    timer = StageTimer()
    gc.collect(0)
    timer.mark("arrive")
    assert timer.gc_during is None
    timer.mark(LAST)
    assert timer.gc_during is not None and timer.gc_during[0] >= 1
    during = list(timer.gc_during)
    gc.collect(0)
    timer.mark(LAST)  # marked already: nothing changes
    assert timer.gc_during == during
