"""`benchmarks.scripts.prefill_step_profile`'s shared-prefix batches, on the embedded model (the
profile itself is a GPU measurement)."""

from __future__ import annotations

import random

from benchmarks.scripts.prefill_step_profile import run_batch
from edmm.engine.config import EngineConfig
from edmm.engine.engine import Engine


def test_a_shared_batch_finds_the_prefix_another_request_computed() -> None:
    """With ``shared`` tokens every request finds them cached (computed by the untimed request
    before the batch), and no more; without, nothing is cached (fresh random prompts)."""
    engine = Engine(EngineConfig(model=None, device="cpu", host_page_size=4096))
    try:
        rng = random.Random(0)
        fresh = run_batch(engine, 96, 2, rng, "fresh")
        assert fresh.cached == 0
        shared = run_batch(engine, 96, 2, rng, "shared", shared=64)
        assert shared.wall_s > 0 and shared.cached == 2 * 64
        # each request's slot maps pages: its own, or the prefix's (a branch) and its own
        assert fresh.map_pages > 0 and shared.map_pages > 0 and shared.map_s > 0
    finally:
        engine.close()
