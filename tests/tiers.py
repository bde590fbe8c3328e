"""The two test tiers and their hypothesis example counts.

The fast tier is the default ``pytest -q``: tests marked ``slow`` are deselected (pyproject's
``addopts``) and hypothesis runs the ``fast`` profile. The thorough tier is
``HYPOTHESIS_PROFILE=thorough pytest -m 'not gpu'``: every test, each property with its full
example count. tests/conftest.py registers and loads the profiles.
"""

from __future__ import annotations

import os

from hypothesis import settings

PROFILE_ENV = "HYPOTHESIS_PROFILE"
FAST = "fast"
THOROUGH = "thorough"
FAST_EXAMPLES = 10  # a property without its own count: the fast profile's examples
THOROUGH_EXAMPLES = 100  # ... and the thorough profile's (hypothesis's default)
FAST_SHARE = 20  # a property with its own count runs 1/FAST_SHARE of it in the fast tier
FAST_FLOOR = 5  # ... but at least this many (never more than the thorough count)


def register_profiles() -> None:
    """Register ``fast`` and ``thorough`` (no deadline in either: a loaded machine is slow,
    not wrong) and load the one that ``$HYPOTHESIS_PROFILE`` names (``fast`` by default)."""
    settings.register_profile(FAST, max_examples=FAST_EXAMPLES, deadline=None)
    settings.register_profile(THOROUGH, max_examples=THOROUGH_EXAMPLES, deadline=None)
    settings.load_profile(os.environ.get(PROFILE_ENV, FAST))


def examples(thorough: int) -> int:
    """The example count of a property that the thorough profile runs ``thorough`` times:
    ``thorough`` itself under any profile but ``fast``, else a share of it with a floor.
    Called when a test module is imported, after the profile is loaded (by
    `register_profiles` or hypothesis's ``--hypothesis-profile``)."""
    if settings.get_current_profile_name() != FAST:
        return thorough
    return min(thorough, max(FAST_FLOOR, thorough // FAST_SHARE))
