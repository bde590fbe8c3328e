"""The static inputs of CUDA graphs: a step's rows copied in, stale rows reset to padding.

Runs on the CPU (the buffers are plain tensors); replay itself is tested on the GPU
(tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from edmm.engine.config import EngineConfig
from edmm.engine.cuda_graph import _StaticInputs, mixed_buckets, mixed_shape
from edmm.engine.errors import EngineConfigError
from edmm.engine.runner import ModelInputs
from edmm.model.attention import AttentionMetadata

PAD = 7


def _inputs(slots: list[int], query_lens: list[int], context_lens: list[int]) -> ModelInputs:
    meta = AttentionMetadata.build(slots, query_lens, context_lens)
    assert meta.token_index is not None
    t = meta.num_tokens
    return ModelInputs(input_ids=torch.arange(100, 100 + t), positions=meta.token_index.clone(),
                       meta=meta, sample_rows=torch.zeros(0, dtype=torch.int64), sample_seqs=[],
                       params=[], rngs=[])


def _check(static: _StaticInputs, slots: list[int], query_lens: list[int],
           context_lens: list[int]) -> None:
    inputs = _inputs(slots, query_lens, context_lens)
    static.load(inputs)
    t, b, n, s = sum(query_lens), len(slots), static.ids.shape[0], static.slot_ids.shape[0]
    assert static.ids.tolist() == list(range(100, 100 + t)) + [0] * (n - t)
    tokens = [c - q + i for q, c in zip(query_lens, context_lens, strict=True) for i in range(q)]
    assert static.pos.tolist() == tokens + [0] * (n - t)
    assert static.token_index.tolist() == tokens + [0] * (n - t)
    per_token = [sl for sl, q in zip(slots, query_lens, strict=True) for _ in range(q)]
    assert static.slot_index.tolist() == per_token + [PAD] * (n - t)
    assert static.slot_ids.tolist() == slots + [PAD] * (s - b)
    assert static.ctx.tolist() == context_lens + [1] * (s - b)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    assert static.query_start.tolist() == starts + [t] * (s - b)  # padding: no queries


def test_rows_past_a_step_are_padding_after_larger_and_smaller_steps() -> None:
    static = _StaticInputs(tokens=16, seqs=4, pad_slot=PAD, device=torch.device("cpu"))
    _check(static, [0, 3, 5], [6, 1, 5], [10, 4, 5])  # 12 tokens, 3 sequences
    _check(static, [2], [3], [9])  # smaller: rows 3..11 and sequences 1..2 reset
    _check(static, [1, 2, 4, 6], [4, 4, 4, 4], [4, 8, 12, 16])  # full
    _check(static, [4, 1], [1, 1], [20, 30])  # a decode batch


def test_static_meta_views_the_buffers() -> None:
    static = _StaticInputs(tokens=16, seqs=4, pad_slot=PAD, device=torch.device("cpu"))
    meta = static.meta(16, 4, [13, 1, 1, 1])
    static.load(_inputs([3, 1], [5, 2], [8, 2]))
    assert meta.slot_ids_t is not None and meta.slot_ids_t.tolist() == [3, 1, PAD, PAD]
    assert meta.query_start_loc is not None and meta.query_start_loc.tolist() == [0, 5, 7, 7, 7]
    assert meta.slot_index is not None and meta.slot_index.tolist()[:8] == [3] * 5 + [1] * 2 + [PAD]


def test_mixed_graph_shapes_pad_few_sequences_to_a_small_bound() -> None:
    """A prefill alone replays the mixed graph of the smallest sequence bound (16), not the one
    padded to the engine's most sequences (512): the prefill kernel launches a row tile per
    padding sequence; a batch of many sequences still finds a graph that holds it."""
    sizes, most, buckets = (32, 64, 2048), 512, (16, 64)
    assert mixed_buckets(2048, most, buckets) == (16, 64, 512)
    assert mixed_buckets(32, most, buckets) == (16, 31)
    assert mixed_buckets(8, most, buckets) == (7,)
    assert mixed_shape(sizes, most, buckets, 2048, 1) == (2048, 16)
    assert mixed_shape(sizes, most, buckets, 2048, 17) == (2048, 64)
    assert mixed_shape(sizes, most, buckets, 2048, 65) == (2048, 512)
    assert mixed_shape(sizes, most, buckets, 40, 20) == (64, 63)
    assert mixed_shape(sizes, most, buckets, 30, 20) == (32, 31)
    assert mixed_shape(sizes, most, buckets, 30, 40) == (64, 63)  # 32 tokens hold 31 at most
    assert mixed_shape(sizes, most, buckets, 2049, 1) is None  # past every graph: eager
    assert mixed_shape(sizes, most, (), 2048, 1) == (2048, 512)  # no buckets: as before


def test_mixed_seq_buckets_are_checked() -> None:
    with pytest.raises(EngineConfigError, match="cuda_graph_mixed_seq_buckets"):
        EngineConfig(cuda_graph_mixed_seq_buckets=(0, 16))
