"""Tests for edmm.engine.sampling."""

from __future__ import annotations

import math

import pytest
import torch

from edmm.engine.sampling import (
    FinishReason,
    InvalidSamplingParams,
    RequestRng,
    Sampler,
    SamplerError,
    SamplingParams,
    _filtered_probs,  # internal invariant under test
    is_stop,
    truncate_at_stop,
)


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], sampler: Sampler | None = None
) -> torch.Tensor:
    rngs = [RequestRng.for_params(p) for p in params]
    return (sampler or Sampler(seed=0)).sample(logits, params, rngs)


def _frequencies(logits_row: list[float], params: SamplingParams, draws: int) -> torch.Tensor:
    """Empirical token frequencies ``[V]`` of ``draws`` unseeded rows in one batch."""
    logits = torch.tensor([logits_row]).repeat(draws, 1)  # [draws, V]
    tokens = _sample(logits, [params] * draws, Sampler(seed=1234))
    return torch.bincount(tokens, minlength=len(logits_row)).double() / draws


def _chi_square(freq: torch.Tensor, expected: torch.Tensor, draws: int) -> float:
    """Pearson statistic over tokens with expected mass > 0."""
    keep = expected > 0
    obs, exp = freq[keep] * draws, expected[keep] * draws
    return float(((obs - exp) ** 2 / exp).sum())


# ---------------------------------------------------------------- greedy


def test_greedy_equals_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 100, generator=gen)  # [B, V]
    tokens = _sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert tokens.dtype == torch.int64
    assert tokens.shape == (8,)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_ties_pick_first_max() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    tokens = _sample(logits, [SamplingParams(temperature=0.0)] * 2)
    assert tokens.tolist() == [1, 0]


def test_greedy_rows_in_mixed_batch_equal_argmax() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=gen)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=9),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1e-7),
        SamplingParams(temperature=1.2, top_k=10),
    ]
    tokens = _sample(logits, params)
    argmax = logits.argmax(dim=-1)
    for i in (0, 2, 4):
        assert tokens[i] == argmax[i]


def test_top_k_one_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 300, generator=gen)
    logits[3, 7] = logits[3, 250] = logits[3].max() + 1.0  # tie: argmax keeps the first
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(16)]
    tokens = _sample(logits, params)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens[3] == 7


def test_low_precision_logits_are_accepted() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]], dtype=torch.bfloat16)
    assert _sample(logits, [SamplingParams(temperature=0.0)]).tolist() == [1]
    assert _sample(logits, [SamplingParams(seed=1)]).dtype == torch.int64


# ---------------------------------------------------------------- filters

# A shuffled hand-made distribution: token -> prob.
_HAND = {3: 0.5, 0: 0.3, 4: 0.15, 1: 0.04, 2: 0.01}
_HAND_LOGITS = [math.log(_HAND[t]) for t in range(5)]
_HAND_PROBS = torch.tensor([_HAND[t] for t in range(5)], dtype=torch.float64)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.3, {3}),  # 0.5 alone reaches 0.3
        (0.5 - 1e-3, {3}),
        (0.75, {3, 0}),  # 0.5 < 0.75 <= 0.8
        (0.9, {3, 0, 4}),  # 0.8 < 0.9 <= 0.95
        (0.97, {3, 0, 4, 1}),
        (1.0, {3, 0, 4, 1, 2}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, kept: set[int]) -> None:
    draws = 20_000
    freq = _frequencies(_HAND_LOGITS, SamplingParams(top_p=top_p), draws)
    assert set(torch.nonzero(freq).flatten().tolist()) == kept
    mass = sum(_HAND[t] for t in kept)
    expected = torch.tensor([_HAND[t] / mass if t in kept else 0.0 for t in range(5)])
    assert _chi_square(freq, expected, draws) < 25.0


def test_top_p_boundary_and_ties() -> None:
    """Uniform 4 tokens: mass 0.5 is reached by exactly 2 tokens, the first two (stable)."""
    freq = _frequencies([0.0] * 4, SamplingParams(top_p=0.5), 4_000)
    assert set(torch.nonzero(freq).flatten().tolist()) == {0, 1}


def test_top_p_one_keeps_whole_large_vocab() -> None:
    """float32 prefix sums pass 1.0 over ~150k tokens; top_p=1 must still keep all."""
    logits = torch.randn(2, 152_000, generator=torch.Generator().manual_seed(0)) * 2
    probs = _filtered_probs(logits, [SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)])
    assert torch.all(probs[0] > 0)
    assert torch.allclose(probs[0], logits[0].softmax(dim=-1))


def test_top_k_keeps_k_best() -> None:
    freq = _frequencies(_HAND_LOGITS, SamplingParams(top_k=2), 5_000)
    assert set(torch.nonzero(freq).flatten().tolist()) == {3, 0}


def test_top_k_larger_than_vocab_is_no_op() -> None:
    freq = _frequencies(_HAND_LOGITS, SamplingParams(top_k=100), 20_000)
    assert set(torch.nonzero(freq).flatten().tolist()) == set(_HAND)


def test_masked_logits_are_never_sampled() -> None:
    row = [0.0, -math.inf, 0.0, -math.inf]
    freq = _frequencies(row, SamplingParams(temperature=2.0, top_p=0.99), 2_000)
    assert freq[1] == 0 and freq[3] == 0


def _softmax(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64).softmax(dim=-1)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # Temperature only: softmax(logits / T).
        (SamplingParams(temperature=0.7), _softmax([x / 0.7 for x in _HAND_LOGITS])),
        # Top-k 3 at T=2: renormalized over tokens 3, 0, 4.
        (
            SamplingParams(temperature=2.0, top_k=3),
            _softmax(
                [x / 2.0 if t in (3, 0, 4) else -math.inf for t, x in enumerate(_HAND_LOGITS)]
            ),
        ),
        # Top-k 4 then top-p 0.9 over the renormalized top-4 (0.5,0.3,0.15,0.04)/0.99:
        # prefix masses 0.505, 0.808, 0.960 -> keeps 3 tokens.
        (
            SamplingParams(top_k=4, top_p=0.9),
            torch.tensor([0.3, 0.0, 0.0, 0.5, 0.15], dtype=torch.float64) / 0.95,
        ),
    ],
)
def test_sampled_frequencies_match_filtered_distribution(
    params: SamplingParams, expected: torch.Tensor
) -> None:
    draws = 40_000
    freq = _frequencies(_HAND_LOGITS, params, draws)
    assert torch.all(freq[expected == 0] == 0)
    # df <= 4; chi2 = 25 is p < 1e-4, and the seed is fixed, so no flakes.
    assert _chi_square(freq, expected, draws) < 25.0


def test_seeded_row_frequencies_match_distribution() -> None:
    """One seeded request over many steps draws from the right distribution."""
    params = SamplingParams(temperature=1.0, seed=77)
    rng = RequestRng.for_params(params)
    sampler = Sampler()
    logits = torch.tensor([_HAND_LOGITS])  # [1, V]
    draws = 4_000
    tokens = torch.cat([sampler.sample(logits, [params], [rng]) for _ in range(draws)])
    freq = torch.bincount(tokens, minlength=5).double() / draws
    assert _chi_square(freq, _HAND_PROBS, draws) < 25.0


# ---------------------------------------------------------------- seeds


def _step_logits(steps: int, batch: int, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(42)
    return [torch.randn(batch, vocab, generator=gen) * 3 for _ in range(steps)]


def _run_seeded(
    target: SamplingParams, others: list[SamplingParams], position: int, steps: int = 12
) -> list[int]:
    """Tokens of ``target`` at ``position`` in a batch with ``others``, fixed logits."""
    vocab = 500
    batch = [*others[:position], target, *others[position:]]
    rngs = [RequestRng.for_params(p) for p in batch]
    sampler = Sampler()  # unseeded shared stream: must not matter to seeded rows
    noise = torch.Generator().manual_seed(position)
    out = []
    for logits in _step_logits(steps, 1, vocab):
        full = torch.randn(len(batch), vocab, generator=noise)  # [B, V] for the other rows
        full[position] = logits[0]
        out.append(int(sampler.sample(full, batch, rngs)[position]))
    return out


_OTHERS = [
    SamplingParams(temperature=0.0),
    SamplingParams(seed=5, top_k=3),
    SamplingParams(temperature=0.5, top_p=0.5),
    SamplingParams(seed=6, temperature=1.3),
]


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(seed=123),
        SamplingParams(seed=123, temperature=0.9, top_k=50),
        SamplingParams(seed=123, top_p=0.95),
    ],
)
def test_seed_reproducible_across_batch_composition(target: SamplingParams) -> None:
    alone = _run_seeded(target, [], 0)
    assert _run_seeded(target, [], 0) == alone
    assert _run_seeded(target, _OTHERS, 0) == alone
    assert _run_seeded(target, _OTHERS, 2) == alone
    assert _run_seeded(target, _OTHERS, 4) == alone
    assert _run_seeded(target, _OTHERS[1:3], 1) == alone


def test_different_seeds_differ() -> None:
    a = _run_seeded(SamplingParams(seed=1), [], 0, steps=20)
    b = _run_seeded(SamplingParams(seed=2), [], 0, steps=20)
    assert a != b


def test_shared_stream_reproducible_with_sampler_seed() -> None:
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams()] * 4
    assert torch.equal(
        _sample(logits, params, Sampler(seed=9)), _sample(logits, params, Sampler(seed=9))
    )


def test_rng_seed_must_match_params() -> None:
    with pytest.raises(SamplerError, match="seed"):
        Sampler().sample(torch.zeros(1, 4), [SamplingParams(seed=1)], [RequestRng(2)])


@pytest.mark.parametrize(
    ("shape", "n_params"),
    [((4,), 1), ((2, 4), 1), ((1, 0), 1), ((2, 3, 4), 2)],
)
def test_bad_inputs_raise(shape: tuple[int, ...], n_params: int) -> None:
    params = [SamplingParams()] * n_params
    with pytest.raises(SamplerError):
        Sampler().sample(torch.zeros(shape), params, [RequestRng() for _ in params])


def test_integer_logits_rejected() -> None:
    with pytest.raises(SamplerError, match="floating"):
        _sample(torch.zeros(1, 4, dtype=torch.int64), [SamplingParams()])


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 2}, "n"),
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidSamplingParams, match=f"^{field}:") as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert isinstance(err.value, ValueError)


def test_valid_params_and_normalization() -> None:
    p = SamplingParams(top_k=0, stop="END", stop_token_ids=(7, 8), seed=-1)  # type: ignore[arg-type]
    assert not p.top_k_enabled
    assert p.stop == ["END"]
    assert p.stop_token_ids == [7, 8]
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(top_k=1).top_k_enabled


# ---------------------------------------------------------------- stop logic

_EOS = {2}


@pytest.mark.parametrize(
    ("token", "num", "kwargs", "expected"),
    [
        (5, 1, {}, None),
        (2, 1, {}, FinishReason.STOP),  # eos
        (2, 1, {"ignore_eos": True}, None),
        (9, 3, {"stop_token_ids": [9]}, FinishReason.STOP),
        (9, 3, {"stop_token_ids": [9], "ignore_eos": True}, FinishReason.STOP),
        (2, 3, {"min_tokens": 4}, None),  # too early for eos
        (9, 3, {"min_tokens": 4, "stop_token_ids": [9]}, None),
        (2, 4, {"min_tokens": 4}, FinishReason.STOP),
        (5, 16, {}, FinishReason.LENGTH),
        (5, 4, {"max_tokens": 4}, FinishReason.LENGTH),
        (2, 4, {"max_tokens": 4}, FinishReason.STOP),  # stop wins over length
        (2, 4, {"max_tokens": 4, "ignore_eos": True}, FinishReason.LENGTH),
        (2, 4, {"max_tokens": 4, "min_tokens": 4}, FinishReason.STOP),
    ],
)
def test_is_stop(token: int, num: int, kwargs: dict, expected: FinishReason | None) -> None:
    assert is_stop(token, num, SamplingParams(**kwargs), _EOS) == expected


def test_finish_reason_is_a_string() -> None:
    assert FinishReason.STOP == "stop"
    assert FinishReason.LENGTH.value == "length"


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("hello world", ["xyz"], ("hello world", None)),
        ("hello world", [], ("hello world", None)),
        ("hello world", ["world"], ("hello ", "world")),
        ("a</tool>b<end>c", ["<end>", "</tool>"], ("a", "</tool>")),  # earliest wins
        ("xabcY", ["b", "abc"], ("x", "abc")),  # earliest start, not earliest end
        ("xabY", ["ab", "a"], ("x", "ab")),  # same start: first listed
        ("stop", ["stop"], ("", "stop")),
    ],
)
def test_truncate_at_stop(text: str, stop: list[str], expected: tuple[str, str | None]) -> None:
    assert truncate_at_stop(text, stop) == expected


def test_truncate_at_stop_search_from() -> None:
    assert truncate_at_stop("END then END", ["END"], search_from=1) == ("END then ", "END")
