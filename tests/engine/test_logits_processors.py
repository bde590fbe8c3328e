"""The per-request logits-processor hook (``SamplingParams.logits_processors``)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from engine_helpers import VOCAB, HFCase, MakeEngine, greedy, run_to_completion

from edmm.engine import SamplingParams
from edmm.engine.sampling import InvalidSamplingParams, apply_logits_processors


class AllowOnly:
    """Masks every token but ``allowed``; records the output ids it was shown."""

    def __init__(self, allowed: Sequence[int]) -> None:
        self.allowed = torch.tensor(list(allowed))
        self.seen: list[list[int]] = []

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        self.seen.append(list(output_ids))
        masked = torch.full_like(logits, float("-inf"))
        masked[self.allowed] = logits[self.allowed]
        return masked


class Force:
    """Forces the token sequence ``tokens`` (then anything)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def __call__(self, output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        n = len(output_ids)
        if n < len(self.tokens):
            logits.fill_(float("-inf"))
            logits[self.tokens[n]] = 0.0
        return logits


def test_non_callable_processor_is_rejected() -> None:
    with pytest.raises(InvalidSamplingParams, match="logits_processors"):
        SamplingParams(logits_processors=[42])  # type: ignore[list-item]


def test_apply_runs_processors_of_each_row_in_order() -> None:
    logits = torch.zeros(2, 4)
    first = SamplingParams(logits_processors=[
        lambda ids, row: row + 1.0, lambda ids, row: row * float(len(ids))])
    out = apply_logits_processors(logits, [first, SamplingParams()], [[7, 8], []])
    assert out[0].tolist() == [2.0] * 4  # (0 + 1) * 2
    assert out[1].tolist() == [0.0] * 4


def test_engine_applies_processor_to_its_request_only(
        qwen2_case: HFCase, make_engine: MakeEngine) -> None:
    engine = make_engine(qwen2_case.folder)
    allow = AllowOnly([5, 6, 7])
    engine.add_request("masked", qwen2_case.prompts[0], greedy(8, logits_processors=[allow]))
    engine.add_request("plain", qwen2_case.prompts[1], greedy(8))
    final = run_to_completion(engine)
    masked = final["masked"].outputs[0].token_ids
    assert set(masked) <= {5, 6, 7}
    assert allow.seen == [masked[:i] for i in range(8)]  # shown the outputs so far
    assert final["plain"].outputs[0].token_ids == qwen2_case.reference[1][:8]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tokens_survive_chunked_prefill_and_sampling(
        qwen2_case: HFCase, make_engine: MakeEngine, temperature: float) -> None:
    engine = make_engine(qwen2_case.folder, max_num_batched_tokens=16, max_num_seqs=4)
    forced = [VOCAB - 1, 3, 3, 9]
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True, seed=1,
                            logits_processors=[Force(forced)])
    engine.add_request("forced", qwen2_case.prompts[3], params)  # 65 tokens: 5 chunks
    assert run_to_completion(engine)["forced"].outputs[0].token_ids == forced
