"""Small, dependency-free statistics for benchmark timings.

Every function takes any iterable of real numbers (Python or numpy scalars)
and rejects empty input, NaN, infinities, bools and non-numbers with
:class:`StatsError`.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

# Guards floor(trim * n) against products like 0.29 * 100 = 28.999999999999996.
_TRIM_EPS = 1e-9


class StatsError(ValueError):
    """Invalid input to a statistics function (empty, non-finite, out of range)."""


@dataclass(frozen=True)
class Summary:
    """Summary of one series of measurements (``stdev`` is None below 2 samples)."""

    n: int
    mean: float
    trimmed_mean: float
    median: float
    p10: float
    p90: float
    min: float
    max: float
    stdev: float | None

    def as_dict(self) -> dict[str, Any]:
        """Fields as a plain dict, in declaration order."""
        return asdict(self)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _values(xs: Iterable[float], what: str) -> list[float]:
    """Validate and copy ``xs`` into a list of floats."""
    out: list[float] = []
    for x in xs:
        if not _is_real(x):
            raise StatsError(f"{what}: values must be real numbers, got {x!r}")
        if not math.isfinite(x):
            raise StatsError(f"{what}: values must be finite, got {x!r}")
        out.append(float(x))
    if not out:
        raise StatsError(f"{what}: needs at least one value")
    return out


def mean(xs: Iterable[float]) -> float:
    """Arithmetic mean (``math.fsum`` based, so exact-ish for long series)."""
    return _bounded_mean(sorted(_values(xs, "mean")))


def _bounded_mean(sorted_vals: list[float]) -> float:
    """fsum / n, clamped to [min, max]: the division can round one ulp past the extremes."""
    return min(max(math.fsum(sorted_vals) / len(sorted_vals), sorted_vals[0]), sorted_vals[-1])


def trimmed_mean(xs: Iterable[float], trim: float = 0.1) -> float:
    """Mean after dropping ``floor(trim * n)`` values from each end of the sorted data.

    ``trim`` is in ``[0, 0.5]``; at least one value (two for even ``n`` at
    ``trim=0.5``, giving the median) is always kept. ``trim=0`` is the mean.
    """
    if not _is_real(trim) or not 0 <= trim <= 0.5:
        raise StatsError(f"trimmed_mean: trim must be in [0, 0.5], got {trim!r}")
    vals = sorted(_values(xs, "trimmed_mean"))
    n = len(vals)
    cut = min(math.floor(trim * n + _TRIM_EPS), (n - 1) // 2)
    return _bounded_mean(vals[cut : n - cut])


def median(xs: Iterable[float]) -> float:
    """Median; the mean of the two middle values for even ``n``."""
    return statistics.median(_values(xs, "median"))


def percentile(xs: Iterable[float], q: float) -> float:
    """``q``-th percentile, ``q`` in ``[0, 100]``, linear interpolation.

    Same as ``numpy.percentile(xs, q)`` (method ``"linear"``), including its
    interpolation formula, so results match to the last bit.
    """
    if not _is_real(q) or not 0 <= q <= 100:
        raise StatsError(f"percentile: q must be in [0, 100], got {q!r}")
    vals = sorted(_values(xs, "percentile"))
    pos = (len(vals) - 1) * (q / 100)
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return _lerp(vals[lo], vals[hi], pos - lo)


def _lerp(a: float, b: float, t: float) -> float:
    """numpy's ``_lerp``: exact at both ends, monotone in ``t``."""
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t


def stdev(xs: Iterable[float]) -> float | None:
    """Sample standard deviation (``n - 1``); None for a single value."""
    vals = _values(xs, "stdev")
    return statistics.stdev(vals) if len(vals) > 1 else None


def summarize(xs: Iterable[float], trim: float = 0.1) -> Summary:
    """Every statistic of :class:`Summary` for ``xs`` (validated once)."""
    vals = _values(xs, "summarize")
    return Summary(
        n=len(vals),
        mean=mean(vals),
        trimmed_mean=trimmed_mean(vals, trim),
        median=median(vals),
        p10=percentile(vals, 10),
        p90=percentile(vals, 90),
        min=min(vals),
        max=max(vals),
        stdev=stdev(vals),
    )


def ratio(a: float, b: float) -> float:
    """``a / b``, e.g. a speedup; :class:`StatsError` when ``b`` is zero or either is not finite."""
    for name, v in (("a", a), ("b", b)):
        if not _is_real(v) or not math.isfinite(v):
            raise StatsError(f"ratio: {name} must be a finite number, got {v!r}")
    if b == 0:
        raise StatsError(f"ratio: denominator b is zero (a={a!r})")
    return float(a) / float(b)
