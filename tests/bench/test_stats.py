"""Tests for edmm.bench.stats: against numpy / statistics, hand values, properties."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edmm.bench.stats import (
    StatsError,
    Summary,
    mean,
    median,
    percentile,
    ratio,
    stdev,
    summarize,
    trimmed_mean,
)

_FINITE = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
_SERIES = st.lists(_FINITE, min_size=1, max_size=60)


# ---------------------------------------------------------------- hand-computed


def test_trimmed_mean_hand_values() -> None:
    xs = [1, 2, 3, 4, 5, 6, 7, 8, 9, 100]  # trim 0.1 drops 1 and 100
    assert trimmed_mean(xs) == pytest.approx(5.5)
    assert trimmed_mean(xs, trim=0.0) == pytest.approx(14.5)
    assert trimmed_mean(xs, trim=0.2) == pytest.approx(5.5)  # drops 1,2 and 9,100
    assert trimmed_mean([5, 1, 9], trim=0.1) == pytest.approx(5.0)  # floor(0.3) = 0 cut


def test_trimmed_mean_keeps_at_least_one_value() -> None:
    assert trimmed_mean([3.0]) == 3.0
    assert trimmed_mean([1, 2, 30], trim=0.5) == 2.0  # odd n: the median
    assert trimmed_mean([1, 2, 3, 40], trim=0.5) == 2.5  # even n: the two middle values


def test_trimmed_mean_cut_is_robust_to_float_products() -> None:
    xs = list(range(100))  # 0.29 * 100 = 28.999999999999996: still 29 cut per end
    assert trimmed_mean(xs, trim=0.29) == pytest.approx(statistics.fmean(range(29, 71)))


def test_percentile_and_median_hand_values() -> None:
    xs = [10, 20, 30, 40]
    assert percentile(xs, 0) == 10
    assert percentile(xs, 100) == 40
    assert percentile(xs, 50) == 25
    assert percentile(xs, 10) == pytest.approx(13.0)  # pos 0.3
    assert percentile(xs, 90) == pytest.approx(37.0)  # pos 2.7
    assert median(xs) == 25
    assert median([3, 1, 2]) == 2
    assert percentile([7.5], 33) == 7.5


def test_summarize_hand_values() -> None:
    s = summarize([4, 1, 3, 2, 5])
    assert isinstance(s, Summary)
    assert (s.n, s.mean, s.median, s.min, s.max) == (5, 3.0, 3.0, 1.0, 5.0)
    assert s.trimmed_mean == 3.0
    assert s.p10 == pytest.approx(1.4)
    assert s.p90 == pytest.approx(4.6)
    assert s.stdev == pytest.approx(math.sqrt(2.5))
    assert list(s.as_dict()) == [
        "n", "mean", "trimmed_mean", "median", "p10", "p90", "min", "max", "stdev"
    ]  # fmt: skip


def test_single_value_summary_has_no_stdev() -> None:
    s = summarize([2.5])
    assert s.stdev is None
    assert s.mean == s.median == s.p10 == s.p90 == s.trimmed_mean == 2.5


def test_ratio() -> None:
    assert ratio(3, 2) == 1.5
    assert ratio(0, 5) == 0.0
    assert isinstance(ratio(np.float32(1), np.int64(4)), float)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "fn",
    [mean, median, stdev, summarize, trimmed_mean, lambda xs: percentile(xs, 50)],
)
@pytest.mark.parametrize("xs", [[], [1.0, math.nan], [math.inf], [1, "2"], [True, 2]])
def test_bad_series_raise(fn, xs) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(StatsError):
        fn(xs)


@pytest.mark.parametrize("trim", [-0.1, 0.51, 1.0, math.nan, "0.1"])
def test_bad_trim_raises(trim: float) -> None:
    with pytest.raises(StatsError, match="trim"):
        trimmed_mean([1, 2, 3], trim)


@pytest.mark.parametrize("q", [-1, 100.5, math.nan])
def test_bad_percentile_raises(q: float) -> None:
    with pytest.raises(StatsError, match="q must be"):
        percentile([1, 2, 3], q)


def test_ratio_zero_denominator_is_clear() -> None:
    with pytest.raises(StatsError, match="denominator b is zero"):
        ratio(1.0, 0)
    with pytest.raises(StatsError, match="b must be a finite"):
        ratio(1.0, math.nan)
    assert issubclass(StatsError, ValueError)


# ---------------------------------------------------------------- against numpy / statistics


@given(_SERIES, st.floats(min_value=0, max_value=100))
def test_percentile_matches_numpy_exactly(xs: list[float], q: float) -> None:
    assert percentile(xs, q) == float(np.percentile(xs, q))


@given(_SERIES)
def test_median_mean_stdev_match_reference(xs: list[float]) -> None:
    assert median(xs) == statistics.median(xs)
    assert mean(xs) == pytest.approx(float(np.mean(xs)), rel=1e-12, abs=1e-6)
    if len(xs) > 1:
        assert stdev(xs) == pytest.approx(float(np.std(xs, ddof=1)), rel=1e-9, abs=1e-6)


@given(_SERIES, st.floats(min_value=0, max_value=0.49))
def test_trimmed_mean_matches_numpy_slicing(xs: list[float], trim: float) -> None:
    arr = np.sort(np.asarray(xs))
    cut = math.floor(trim * len(xs) + 1e-9)
    expected = float(arr[cut : len(xs) - cut].mean())
    assert trimmed_mean(xs, trim) == pytest.approx(expected, rel=1e-9, abs=1e-6)


# ---------------------------------------------------------------- properties


@given(_SERIES, st.floats(min_value=0, max_value=0.5))
def test_trimmed_mean_within_min_max(xs: list[float], trim: float) -> None:
    assert min(xs) <= trimmed_mean(xs, trim) <= max(xs)


@given(_SERIES)
def test_trimmed_mean_without_trim_is_mean(xs: list[float]) -> None:
    assert trimmed_mean(xs, trim=0) == mean(xs)


@given(st.data(), _SERIES, st.floats(min_value=0, max_value=0.5))
def test_trimmed_mean_permutation_invariant(
    data: st.DataObject, xs: list[float], trim: float
) -> None:
    shuffled = data.draw(st.permutations(xs))
    assert trimmed_mean(shuffled, trim) == trimmed_mean(xs, trim)


@given(_SERIES)
def test_summary_is_ordered(xs: list[float]) -> None:
    s = summarize(xs)
    assert s.min <= s.p10 <= s.median <= s.p90 <= s.max
    assert s.min <= s.trimmed_mean <= s.max
