"""`StepTimeModel`: the fit reproduces the measured points it is fitted to, and the engine
records each step's shape and charges modelled seconds when given a model."""

from __future__ import annotations

import pytest

from edmm.engine import Engine, EngineConfig, SamplingParams
from edmm.engine.step_cost import H200_QWEN7B, StepShape, StepTimeModel


def chunked_prefill(model: StepTimeModel, context: int, chunk: int) -> float:
    return sum(model(StepShape((min(chunk, context - s),), (min(s + chunk, context),)))
               for s in range(0, context, chunk))


def test_fit_reproduces_its_measured_points() -> None:
    kw = dict(context=8192, decode_s=4e-3, kv_token_s=1e-8, cached_new=256, cached_s=7.25e-3,
              full_s=197.4e-3, full_chunk=1024, kv_bytes_per_token=1000,
              restore_bytes_per_s=1e10)
    m = StepTimeModel.fit(**kw)  # type: ignore[arg-type]
    assert m(StepShape((1,), (8192,))) == pytest.approx(4e-3)
    assert m(StepShape((256,), (8192 + 256,))) == pytest.approx(7.25e-3)
    assert chunked_prefill(m, 8192, 1024) == pytest.approx(197.4e-3)
    assert m.restore_token_s == pytest.approx(1e-7)
    assert (m.token_s, m.pair_s) == (pytest.approx(20e-6, rel=1e-3), pytest.approx(1e-9, rel=1e-2))
    with pytest.raises(ValueError, match="do not fit"):  # 256 new tokens under a decode step
        StepTimeModel.fit(**{**kw, "cached_s": 3e-3})  # type: ignore[arg-type]


def test_h200_model_matches_the_committed_measurements() -> None:
    """benchmarks/results/2026-12-01-h200-session8/ttft-model.md."""
    assert H200_QWEN7B(StepShape((1,), (16384,))) == pytest.approx(4.874e-3)
    assert H200_QWEN7B(StepShape((512,), (16384 + 512,))) == pytest.approx(19.12e-3)
    assert chunked_prefill(H200_QWEN7B, 16384, 2048) == pytest.approx(464.0e-3)
    # decode rows read their KV: a longer context costs more, more rows cost more
    one = H200_QWEN7B(StepShape((1,), (4096,)))
    assert H200_QWEN7B(StepShape((1, 1), (4096, 4096))) > one
    assert H200_QWEN7B(StepShape((1,), (8192,))) > one
    assert H200_QWEN7B(StepShape((1,), (4096,), restored_tokens=4096)) > one


def test_engine_records_steps_and_charges_the_model(tiny_dir) -> None:
    engine = Engine(EngineConfig(model=str(tiny_dir), dtype="float32",
                                 host_page_size=16384, max_model_len=512))
    try:
        engine.step_time_model = H200_QWEN7B
        engine.add_request("a", list(range(20, 60)), SamplingParams(max_tokens=2))
        engine.step()
        first = engine.last_step
        assert first is not None and first.query_lens == (40,) and first.context_lens == (40,)
        assert first.seconds == H200_QWEN7B(first)
        engine.step()
        assert engine.last_step is not None and engine.last_step.query_lens == (1,)
        assert engine.last_step.context_lens == (41,)
        assert not engine.has_unfinished()
        engine.step()
        assert engine.last_step is None  # nothing computed
    finally:
        engine.close()
