"""The two test tiers and their hypothesis example counts.

The fast tier is the default ``pytest -q``: tests marked ``slow`` are deselected (pyproject's
``addopts``) and hypothesis runs the ``fast`` profile. The thorough tier is
``HYPOTHESIS_PROFILE=thorough pytest -m 'not gpu'``: every test, each property with its full
example count (.ci/run, after the fast tier, runs only what that adds: ``-m 'not gpu and
(slow or hypothesis)'``). tests/conftest.py registers and loads the profiles; `grid` splits a
parametrization between the tiers (e.g. one shape per kernel code path in the fast tier).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytest

PROFILE_ENV = "HYPOTHESIS_PROFILE"
FAST = "fast"
THOROUGH = "thorough"
FAST_EXAMPLES = 10  # a property without its own count: the fast profile's examples
THOROUGH_EXAMPLES = 100  # ... and the thorough profile's (hypothesis's default)
FAST_SHARE = 30  # a property with its own count runs 1/FAST_SHARE of it in the fast tier
FAST_FLOOR = 5  # ... but at least this many (never more than the thorough count)


def register_profiles() -> None:
    """Register ``fast`` and ``thorough`` (no deadline in either: a loaded machine is slow,
    not wrong) and load the one that ``$HYPOTHESIS_PROFILE`` names (``fast`` when it is
    unset or empty; another name is hypothesis's `InvalidArgument`). Without hypothesis (the
    vLLM suite's venv, .ci/run-vllm) there is nothing to register."""
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile(FAST, max_examples=FAST_EXAMPLES, deadline=None)
    settings.register_profile(THOROUGH, max_examples=THOROUGH_EXAMPLES, deadline=None)
    settings.load_profile(os.environ.get(PROFILE_ENV) or FAST)


def examples(thorough: int) -> int:
    """The example count of a property that the thorough profile runs ``thorough`` times:
    ``thorough`` itself under any profile but ``fast``, else a share of it with a floor.
    Called when a test module is imported, after the profile is loaded (by
    `register_profiles` or hypothesis's ``--hypothesis-profile``)."""
    from hypothesis import settings

    if settings.get_current_profile_name() != FAST:
        return thorough
    return min(thorough, max(FAST_FLOOR, thorough // FAST_SHARE))


def grid(axes: Mapping[str | tuple[str, ...], Sequence[Any] | Mapping[str, Any]],
         fast: Iterable[tuple[Any, ...]]) -> pytest.MarkDecorator:
    """A ``parametrize`` over every combination of ``axes``' values (the first axis varying
    slowest): the combinations in ``fast`` run in both tiers, the others only in the thorough
    one (marked ``slow``).

    ``axes`` maps an argument name (or a tuple of names, whose values are tuples) to its
    values; values given as a mapping are named by their keys in the test ids. A ``fast``
    combination holds one value per axis.

    Raises:
        ValueError: a ``fast`` combination is not in the grid (a typo would leave it slow).
    """
    names: list[str] = []
    for key in axes:
        names.extend((key,) if isinstance(key, str) else key)
    named = [dict(a) if isinstance(a, Mapping) else {_id(v): v for v in a}
             for a in axes.values()]
    combos = list(itertools.product(*(a.items() for a in named)))
    fast = list(fast)
    missing = [f for f in fast if f not in [tuple(v for _, v in c) for c in combos]]
    if missing:
        raise ValueError(f"fast combinations not in the grid: {missing}")
    params = []
    for combo in combos:
        value = tuple(v for _, v in combo)
        flat: list[Any] = []
        for key, v in zip(axes, value, strict=True):
            flat.extend((v,) if isinstance(key, str) else v)
        params.append(pytest.param(*flat, id="-".join(k for k, _ in combo),
                                   marks=() if value in fast else pytest.mark.slow))
    return pytest.mark.parametrize(names, params)


def _id(value: Any) -> str:
    """A value's part of a test id: a dtype without its ``torch.`` prefix; a tuple's parts
    joined by ``-``; else its str."""
    if isinstance(value, tuple):
        return "-".join(map(_id, value))
    return str(value).removeprefix("torch.")
