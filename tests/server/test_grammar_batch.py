"""Grammar masks of one step applied together (`GrammarMasks`): the same masks as one row at a
time, the bit unpacking on the device path equal to numpy's, and the engine's grouping of
batched processors (`apply_logits_processors`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edmm.engine import Engine, EngineConfig, SamplingParams
from edmm.engine.sampling import apply_logits_processors
from edmm.server.guided import (
    GrammarLogitsProcessor,
    GuidedDecoding,
    apply_bitmask,
    unpack_bitmask,
    unpack_bitmask_host,
)
from edmm.server.protocol import FunctionDefinition

WEATHER = FunctionDefinition(name="get_weather", parameters={
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"enum": ["Paris", "Tokyo"]}}})


@pytest.fixture(scope="module")
def guided(tiny_dir: Path) -> Any:
    with Engine(EngineConfig(model=str(tiny_dir), max_model_len=512, num_slots=2,
                             max_num_seqs=2)) as engine:
        tok = engine.tokenizer
        yield GuidedDecoding(tok, engine.model_config.vocab_size, tok.eos_token_id)


def _walk(procs: Sequence[GrammarLogitsProcessor], vocab: int, steps: int,
          batched: bool, seed: int) -> list[torch.Tensor]:
    """Masked logits of each step, the processors fed the argmax of random logits."""
    gen = torch.Generator().manual_seed(seed)
    outs: list[list[int]] = [[] for _ in procs]
    seen = []
    for _ in range(steps):
        logits = torch.randn(len(procs), vocab, generator=gen)
        if batched:
            procs[0].batch.apply(procs, outs, logits)
        else:
            for i, p in enumerate(procs):
                logits[i] = p(outs[i], logits[i])
        seen.append(logits.clone())
        for o, t in zip(outs, logits.argmax(-1).tolist(), strict=True):
            o.append(t)
    return seen


def test_batched_masks_equal_one_row_at_a_time(guided: GuidedDecoding) -> None:
    vocab = guided.spec.vocab_size
    make = [lambda: guided.tool_calls([WEATHER], False), lambda: guided.json_schema(None),
            lambda: guided.tool_calls([WEATHER], True)]
    one = _walk([m() for m in make], vocab, 24, batched=False, seed=3)
    together = _walk([m() for m in make], vocab, 24, batched=True, seed=3)
    for a, b in zip(one, together, strict=True):
        assert torch.equal(a, b)
    assert all(bool(torch.isinf(s).any()) for s in together)  # masks did act


def test_a_stopped_row_allows_only_eos_and_leaves_the_others(guided: GuidedDecoding) -> None:
    vocab, eos = guided.spec.vocab_size, guided.spec.eos_token_id
    stopped, ok = guided.json_schema(None), guided.json_schema(None)
    stopped.failure = "over the budget"
    logits = torch.randn(2, vocab)
    ok_alone = ok.batch.apply([guided.json_schema(None)], [[]], logits[1:].clone())
    stopped.batch.apply([stopped, ok], [[], []], logits)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [eos]
    assert torch.equal(logits[1], ok_alone[0])


def test_device_unpacking_equals_numpy_on_every_bit() -> None:
    rng = np.random.default_rng(0)
    for vocab in (1, 31, 32, 33, 1000, 151_669):
        words = -(-vocab // 32)
        raw = rng.integers(-2**31, 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
        raw[0, 0] = -2**31  # only bit 31 of the first word
        bits = torch.from_numpy(raw)
        host = unpack_bitmask_host(bits, vocab)
        assert torch.equal(unpack_bitmask(bits, vocab), host)
        want = np.unpackbits(raw.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        assert np.array_equal(host.numpy(), want.astype(bool))
        if vocab > 31:
            assert bool(host[0, 31]) and not bool(host[0, :31].any())


def test_apply_bitmask_masks_exactly_the_zero_bits() -> None:
    bits = torch.zeros((2, 2), dtype=torch.int32)
    bits[0, 0], bits[1, 1] = 0b101, 1 << 2  # row 0: tokens 0 and 2; row 1: token 34
    logits = apply_bitmask(torch.zeros(2, 40), bits)
    assert torch.isfinite(logits).nonzero().tolist() == [[0, 0], [0, 2], [1, 34]]


class _Batch:
    """A stand-in `LogitsBatch`: records its calls, adds 1 to its rows."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def apply(self, procs: Sequence[Any], outputs: Sequence[Sequence[int]],
              logits: torch.Tensor) -> torch.Tensor:
        self.calls.append([p.row for p in procs])
        return logits + 1


class _Batched:
    def __init__(self, batch: _Batch, row: int) -> None:
        self.batch, self.row = batch, row

    def __call__(self, out: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a batched processor is applied through its batch")


def test_engine_groups_processors_by_batch_and_keeps_each_rows_order() -> None:
    batch = _Batch()
    double = lambda out, row: row * 2  # noqa: E731 - a plain processor
    params = [SamplingParams(logits_processors=[_Batched(batch, 0), double]),
              SamplingParams(),
              SamplingParams(logits_processors=[double, _Batched(batch, 2)]),
              SamplingParams(logits_processors=[_Batched(batch, 3)])]
    logits = apply_logits_processors(torch.ones(4, 3), params, [[], [], [], []])
    assert batch.calls == [[0, 3], [2]]  # first places together (rows 0, 3), then row 2's
    assert logits[:, 0].tolist() == [4.0, 1.0, 3.0, 2.0]  # (1+1)*2, -, 1*2+1, 1+1


@pytest.mark.gpu
def test_grammar_masks_on_the_gpu_equal_the_host_ones(guided: GuidedDecoding) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    vocab = guided.spec.vocab_size
    procs = [guided.tool_calls([WEATHER], False), guided.json_schema(None)]
    twins = [guided.tool_calls([WEATHER], False), guided.json_schema(None)]
    logits = torch.randn(2, vocab)
    on_gpu = procs[0].batch.apply(procs, [[], []], logits.clone().cuda())
    on_host = twins[0].batch.apply(twins, [[], []], logits.clone())
    assert torch.equal(on_gpu.cpu(), on_host)


def test_guided_decoding_does_not_import_triton() -> None:
    """The kernel tests run triton's interpreter, which must be set up before triton is first
    imported; a server module importing triton (llguidance.torch does) made them skip."""
    code = "import sys, edmm.server.guided; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
