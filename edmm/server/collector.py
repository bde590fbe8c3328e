"""When Python's cyclic garbage collector runs in `edmm serve`: when the engine goes idle, not
inside a request.

A young-generation collection visits every element of every young container. The lists of
token ids a turn leaves behind (its prompt's, the predicted next prompt's: 16K Python ints
each at 16K context) stay young through a tool window, because nothing else allocates then.
The next request's body parse then allocates the collector's threshold and pays for walking
them: profiled on the CPU (real Qwen2.5 vocabulary, 16K context, a speculation hit), one
collection of 510 young objects with 87,044 references (five lists of 15,849-16,387 ids)
took 0.7-1.6 ms inside the parse, and C's parse measured 1.3-2.1 ms against 0.4-0.7 ms for
a prefix hit, whose window leaves no young lists. `collect_young` runs that collection when
the engine thread goes idle (`EngineLoop`'s ``on_idle``), so it costs no request, and
`raise_threshold` makes an automatic one rarer than once per request (a resume's parse alone
allocates some 500 containers at 16K).
"""

from __future__ import annotations

import gc

SERVING_THRESHOLD0 = 10_000  # net container allocations between automatic young collections


def collect_young() -> int:
    """Collect the two young generations (their survivors move to the oldest); return how
    many unreachable objects were found."""
    return gc.collect(1)


def raise_threshold(threshold0: int = SERVING_THRESHOLD0) -> tuple[int, int, int]:
    """Set the youngest generation's threshold to ``threshold0`` (the older ones keep
    theirs); return the thresholds before."""
    before = gc.get_threshold()
    gc.set_threshold(threshold0, before[1], before[2])
    return before
