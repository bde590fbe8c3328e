"""KV offload in /metrics: copies to host memory, restores, host bytes held; shared and private
pages; spares of a hot prefix."""

from __future__ import annotations

from pathlib import Path

from edmm.agent import AgentEngine
from edmm.engine import Engine, EngineConfig, EntryRank
from edmm.server.metrics import EngineSnapshot, ServerMetrics
from edmm.server.sessions import ServerSessions


def _value(text: str, name: str) -> float:
    line = next(li for li in text.splitlines() if li.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_offload_counters_and_host_bytes(tiny_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=256,
                                 num_slots=8, max_num_seqs=4, num_pages=64,
                                 host_page_size=16384, kv_offload_bytes=1 << 20))
    sessions = ServerSessions(AgentEngine(engine))
    slot = engine.kv.allocate()
    engine.kv.grow(slot, 40)
    engine.kv.free(slot, list(range(5, 45)), 40, tag="s", rank=EntryRank.RETAINED)
    assert engine.kv.make_room()  # to the host
    metrics = ServerMetrics("tiny")
    text = metrics.render(EngineSnapshot.take(sessions, 0, 0)).decode()
    host_bytes = 40 * engine.kv.layout().token_bytes
    held = 3 * 16 * engine.kv.layout().token_bytes  # whole host blocks of 16 tokens
    assert _value(text, "edmm_kv_offloads_total") == 1
    assert _value(text, "edmm_kv_restores_total") == 0
    assert _value(text, "edmm_kv_host_bytes") == held
    assert engine.kv.restore("s")
    text = metrics.render(EngineSnapshot.take(sessions, 0, 0)).decode()
    assert _value(text, "edmm_kv_restores_total") == 1  # the host copy stays after a restore
    assert _value(text, "edmm_kv_host_bytes") == held
    kv = engine.stats().kv
    assert (kv.offloaded_bytes_total, kv.restored_bytes_total) == (host_bytes, host_bytes)
    assert kv.cached_pages == kv.pages_in_use > 0 and kv.cache_entries == 1
    engine.reset_prefix_cache()
    assert engine.stats().kv.pages_in_use == 0
    engine.close()


def test_admission_memory_waits_counter(tiny_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=256,
                                 num_slots=8, max_num_seqs=4, num_pages=64))
    sessions = ServerSessions(AgentEngine(engine))
    metrics = ServerMetrics("tiny")
    text = metrics.render(EngineSnapshot.take(sessions, 0, 0)).decode()
    assert _value(text, "edmm_admission_memory_waits_total") == 0
    engine._scheduler.memory_waits.record(running_pages=12)
    engine._scheduler.memory_waits.record(running_pages=10)
    text = metrics.render(EngineSnapshot.take(sessions, 0, 0)).decode()
    assert _value(text, "edmm_admission_memory_waits_total") == 2
    assert engine.stats().memory_wait_running_pages == 22
    engine.close()


def test_shared_and_private_pages_of_two_sessions_on_one_prefix(tiny_dir: Path) -> None:
    """A second prompt on the first one's prefix branches from it: the prefix's full pages are
    mapped by both slots (shared), the rest by one each (private)."""
    engine = Engine(EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=256,
                                 num_slots=8, max_num_seqs=4, num_pages=64,
                                 host_page_size=16384))
    sessions = ServerSessions(AgentEngine(engine))
    layout = engine.kv.layout()
    prefix = list(range(5, 5 + 100))
    first, second = [*prefix, *range(200, 220)], [*prefix, *range(300, 330)]
    slot = engine.kv.allocate()
    engine.kv.grow(slot, len(first))
    engine.kv.free(slot, first, len(first))  # an entry: its KV stays cached
    hit = engine.kv.match(second, len(second))
    assert hit is not None and hit.num_tokens == len(prefix) and hit.source == slot
    engine.kv.grow(hit.slot, len(second))
    shared = layout.full_pages(len(prefix))
    assert shared >= 2

    def pages(n: int) -> int:
        return -(-n * layout.token_bytes // layout.page_size)

    text = ServerMetrics("tiny").render(EngineSnapshot.take(sessions, 0, 0)).decode()
    assert _value(text, "edmm_kv_pages_shared") == shared
    private = pages(len(first)) + pages(len(second)) - 2 * shared
    assert _value(text, "edmm_kv_pages_private") == private
    kv = engine.stats().kv
    assert kv.pages_shared + kv.pages_private == kv.pages_in_use
    engine.kv.drop(hit.slot)
    engine.reset_prefix_cache()
    assert engine.stats().kv.pages_shared == engine.stats().kv.pages_in_use == 0
    engine.close()


def test_prefix_spare_counters(tiny_dir: Path) -> None:
    """Plain requests on one shared prefix, one after the other, async scheduling: spares are
    made and adopted, and /metrics counts both as the engine's KV stats do."""
    from edmm.engine import SamplingParams

    engine = Engine(EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=256,
                                 num_slots=8, max_num_seqs=4, num_pages=64,
                                 host_page_size=16384, async_scheduling=True))
    sessions = ServerSessions(AgentEngine(engine))
    metrics = ServerMetrics("tiny")
    text = metrics.render(EngineSnapshot.take(sessions, 0, 0)).decode()
    assert _value(text, "edmm_prefix_spares_made_total") == 0
    prefix = list(range(10, 90))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", prefix + [100 + 10 * i + k for k in range(8)], params)
        while engine.has_unfinished():
            engine.step()
    kv = engine.stats().kv
    assert kv.spares_made >= 2 and kv.spares_used >= 2
    text = metrics.render(EngineSnapshot.take(sessions, 0, 0)).decode()
    assert _value(text, "edmm_prefix_spares_made_total") == kv.spares_made
    assert _value(text, "edmm_prefix_spares_used_total") == kv.spares_used
    engine.close()
