"""KV offload in /metrics: copies to host memory, restores, host bytes held."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edmm.engine import Engine, EngineConfig, EntryRank
from edmm.server.metrics import EngineSnapshot, ServerMetrics
from edmm.server.sessions import SessionStats


@dataclass
class _Backend:
    engine: Engine

    def stats(self) -> SessionStats:
        return SessionStats()


def _value(text: str, name: str) -> float:
    line = next(li for li in text.splitlines() if li.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_offload_counters_and_host_bytes(tiny_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=256,
                                 num_slots=8, max_num_seqs=4, num_pages=64,
                                 host_page_size=16384, kv_offload_bytes=1 << 20))
    cache = engine.prefix_cache
    slot = engine.arena.allocate()
    engine.arena.grow(slot, 40)
    cache.release(slot, list(range(5, 45)), 40, tag="s", rank=EntryRank.RETAINED)
    assert cache.evict_one()  # to the host
    metrics = ServerMetrics("tiny")
    text = metrics.render(EngineSnapshot.take(_Backend(engine), 0, 0)).decode()  # type: ignore[arg-type]
    assert _value(text, "edmm_kv_offloads_total") == 1
    assert _value(text, "edmm_kv_restores_total") == 0
    assert _value(text, "edmm_kv_host_bytes") == 40 * engine.arena.spec.token_bytes
    assert engine.restore("s")
    text = metrics.render(EngineSnapshot.take(_Backend(engine), 0, 0)).decode()  # type: ignore[arg-type]
    assert _value(text, "edmm_kv_restores_total") == 1 and _value(text, "edmm_kv_host_bytes") == 0
    engine.reset_prefix_cache()
    engine.close()
