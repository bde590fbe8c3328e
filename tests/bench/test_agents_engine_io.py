"""The bench's reach past `AgentEngine`: the KV ballast and the counters."""

from __future__ import annotations

from pathlib import Path

from edmm.agent import AgentEngine
from edmm.bench.agents.engine_io import KVBallast, ballast_slots, read_counters
from edmm.engine import EngineConfig


def test_ballast_holds_exact_pages_and_keeps_invariants(tiny_dir: Path) -> None:
    agent = AgentEngine(EngineConfig(model=str(tiny_dir), dtype="float32", host_page_size=16384,
                                     max_model_len=64, num_pages=40, num_slots=8,
                                     max_num_seqs=4))
    try:
        ballast = KVBallast(agent.engine, 19)  # 8 pages a slot at 64 tokens: 3 slots
        assert ballast.num_pages == 19 and len(ballast.slots) == 3
        assert ballast_slots(40, 21, 8) == 3
        agent.engine.check_integrity()
        c = read_counters(agent, ballast.num_pages)
        assert (c.pages_total, c.pages_used) == (21, 0)
        assert read_counters(agent).pages_used == 19
        ballast.release()
        assert agent.engine.stats().kv.pages_in_use == 0
        agent.engine.check_integrity()
    finally:
        agent.close()
