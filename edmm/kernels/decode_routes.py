"""Measured launch parameters of the split-K decode kernel, per batch size and context.

`python -m benchmarks.kernels.decode_sweep` times split counts and launch configs (CUDA-graph
medians on a real arena) and writes the fastest per (batch, context) as a JSON routing table:

    {"device": ..., "date": ..., "command": ..., "routes": [
        {"batch": 1, "context": 16384, "num_splits": 64, "block_n": 64, "num_warps": 4,
         "num_stages": 3, "fused": false, "pdl": true, "prefetch": true, "graph_us": 12.3},
        ...]}

(``fused``, ``pdl``, ``prefetch``, ``early_launch``, ``balanced``, ``tma``,
``sliced_reduce``, ``cuda`` and ``cluster``, `DecodeConfig`'s, are false where a table
leaves them out; ``prefetch_tiles`` is 0, the whole chunk.)

`DecodeRoutes.lookup` gives a decode call the route of the nearest measured shape at or above
it (the largest where none is); a table next to this module (`ROUTES_FILE`, when a measured one
has been committed there) is the engine's default. Without one the kernel keeps its own
heuristic (`default_num_splits`, `DecodeConfig()`). Only split-K routes exist (the Triton
split kernel, or with ``cuda`` the CUDA C++ one): SDPA cannot run
a CUDA-graph decode batch of unequal lengths without reading past each context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edmm.kernels._common import DecodeConfig, KernelInputError

ROUTES_FILE = Path(__file__).with_name("decode_routes.json")


class DecodeRoutesError(KernelInputError):
    """A routing table file that is not one `decode_sweep.py` writes."""


@dataclass(frozen=True)
class DecodeRoute:
    """The fastest measured launch of one shape: split count, launch config, its time."""

    batch: int
    context: int
    num_splits: int
    config: DecodeConfig
    graph_us: float  # per layer, median inside a CUDA graph of all layers


@dataclass(frozen=True)
class DecodeRoutes:
    """A measured routing table (``source``: the device and date it was measured on)."""

    routes: tuple[DecodeRoute, ...]
    source: str = ""

    @classmethod
    def from_json(cls, path: Path | str) -> DecodeRoutes:
        """The table in ``path``; raises `DecodeRoutesError` if it is malformed."""
        try:
            data = json.loads(Path(path).read_text())
            return cls(tuple(_route(r) for r in data["routes"]),
                       f"{data.get('device', '?')}, {data.get('date', '?')}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DecodeRoutesError(f"{path}: not a decode routing table ({e})") from e

    def lookup(self, batch: int, context: int) -> DecodeRoute | None:
        """The route of the smallest measured batch >= ``batch`` (else the largest) and, among
        its contexts, the smallest >= ``context`` (else the largest); None if empty."""
        if not self.routes:
            return None
        b = _at_or_above(sorted({r.batch for r in self.routes}), batch)
        rows = [r for r in self.routes if r.batch == b]
        c = _at_or_above(sorted({r.context for r in rows}), context)
        return next(r for r in rows if r.context == c)


def default_decode_routes() -> DecodeRoutes | None:
    """The measured table committed next to this module, or None."""
    return DecodeRoutes.from_json(ROUTES_FILE) if ROUTES_FILE.is_file() else None


def _at_or_above(values: list[int], x: int) -> int:
    return next((v for v in values if v >= x), values[-1])


def _flag(r: dict[str, Any], key: str) -> bool:
    value = r.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false in {r}")
    return value


def _route(r: dict[str, Any]) -> DecodeRoute:
    route = DecodeRoute(int(r["batch"]), int(r["context"]), int(r["num_splits"]),
                        DecodeConfig(int(r["block_n"]), int(r["num_warps"]),
                                     int(r["num_stages"]), _flag(r, "fused"), _flag(r, "pdl"),
                                     _flag(r, "prefetch"), int(r.get("prefetch_tiles", 0)),
                                     _flag(r, "early_launch"), _flag(r, "balanced"),
                                     _flag(r, "tma"), _flag(r, "sliced_reduce"),
                                     _flag(r, "cuda"), _flag(r, "cluster")),
                        float(r["graph_us"]))
    if min(route.batch, route.context, route.num_splits) < 1:
        raise ValueError(f"non-positive batch/context/num_splits in {r}")
    return route
