"""Presence and frequency penalties and logit biases (`edmm.engine.sampling.adjust_logits`),
with output counts kept on the logits' device."""

from __future__ import annotations

import pytest
import torch

from edmm.engine.sampling import (
    InvalidSamplingParams,
    OutputCounts,
    SamplingParams,
    adjust_logits,
    count_outputs,
)


def test_penalties_follow_the_counts_and_biases_add() -> None:
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(logit_bias={1: 2.0, 3: -100.0}), SamplingParams()]
    counts = [OutputCounts(), None, None]
    logits = torch.zeros(3, 4)  # [B, V]
    adjust_logits(logits, params, counts)  # nothing generated yet: no penalty
    assert logits[0].tolist() == [0, 0, 0, 0]
    assert logits[1].tolist() == [0, 2, 0, -100] and logits[2].tolist() == [0, 0, 0, 0]
    for token in (2, 2, 0):
        count_outputs(torch.tensor([token, 1, 1]), counts)
    logits = torch.zeros(3, 4)
    adjust_logits(logits, params, counts)
    # token 2 twice: 0.5 + 2 * 0.25; token 0 once: 0.5 + 0.25
    assert logits[0].tolist() == pytest.approx([-0.75, 0, -1.0, 0])
    assert logits[2].tolist() == [0, 0, 0, 0]


def test_penalized_and_range_checks() -> None:
    assert SamplingParams(frequency_penalty=-1.0).penalized
    assert not SamplingParams(logit_bias={1: 5.0}).penalized
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                dict(logit_bias={1: 101.0}), dict(logit_bias={-1: 1.0})):
        with pytest.raises(InvalidSamplingParams):
            SamplingParams(**bad)  # type: ignore[arg-type]
