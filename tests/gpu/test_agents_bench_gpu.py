"""`edmm bench agents` on CUDA (tiny model, float32): the 2 MiB-page pool sized by
oversubscription through the ballast, offload through pinned host copies, every policy's greedy
outputs identical, every page back after each run (checked inside `Matrix`)."""

from __future__ import annotations

import pytest

from edmm.bench.agents.matrix import AgentsBenchConfig, Matrix
from edmm.bench.agents.trace import GeneratorConfig

pytestmark = pytest.mark.gpu


def test_policies_on_cuda_agree_and_offload_moves_bytes() -> None:
    gen = GeneratorConfig(turns=(3, 4), context_start=(2000, 3000), growth_per_turn=(300, 600),
                          output_tokens=(3, 6), p_predictable=0.4, p_streamed=0.4)
    cfg = AgentsBenchConfig(device="cuda", dtype="float32", jobs=6, generator=gen,
                            time_scale=0.05, loads=(4,), oversubscription=2.0,
                            policies=("lru", "offload", "edmm"), max_num_seqs=8,
                            cuda_graph_token_sizes=(64, 128, 256, 512, 1024, 2048))
    matrix = Matrix(cfg)
    try:
        records = matrix.run(matrix.plan_main())
    finally:
        matrix.close()
    by = {r.condition.policy: r.result for r in records}
    assert by["offload"].outputs == by["lru"].outputs == by["edmm"].outputs
    off = by["offload"]
    moved = off.counters_after.restored_bytes - off.counters_before.restored_bytes
    assert moved > 0 and off.counters_after.restore_s > off.counters_before.restore_s


def test_speculation_runs_under_sustained_load_on_cuda() -> None:
    """With CUDA graphs a decode step carries no speculation; it rides in the padding of the
    prefill steps instead, so speculation hits at least as often as without (the first H200
    run, without it: 18 hits in 261 resumes at 1x). Ungated: every branch runs."""
    gen = GeneratorConfig(turns=(3, 4), context_start=(2000, 3000), growth_per_turn=(300, 600),
                          output_tokens=(3, 6))
    hits = {}
    for fills in (True, False):
        cfg = AgentsBenchConfig(device="cuda", dtype="float32", jobs=8, generator=gen,
                                time_scale=0.05, loads=(8,), oversubscription=1.0,
                                check_oversubscription=None, short_mix=False,
                                policies=("edmm-no-gate",), max_num_seqs=8,
                                cuda_graph_token_sizes=(64, 128, 256, 512, 1024, 2048),
                                speculation_fills_padding=fills)
        matrix = Matrix(cfg)
        try:
            (record,) = matrix.run(matrix.plan_main())
            engine = matrix._engine
            assert engine is not None
            assert engine.padding_free == fills
        finally:
            matrix.close()
        hits[fills] = record.result.sessions["spec_hits"]
    assert hits[True] > 0 and hits[True] >= hits[False]
