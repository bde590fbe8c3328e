"""Measured routes of the decode step's projections: the skinny kernel or cuBLAS, per shape.

`python -m benchmarks.kernels.matmul_sweep` times, for every projection of a model (qkv,
o_proj, gate_up, down, LM head) and every decode batch size, ``F.linear`` (cuBLAS) and the
skinny kernel's launch configs (CUDA-graph medians over as many distinct weights as the model
has layers, so nothing is served from L2) and writes each shape's fastest as a JSON table:

    {"device": ..., "date": ..., "command": ..., "routes": [
        {"rows": 1, "n": 3584, "k": 3584, "kernel": "skinny", "block_n": 64, "block_k": 128,
         "splits": 4, "num_warps": 4, "num_stages": 4, "pdl": false, "us": 7.1,
         "cublas_us": 11.2},
        {"rows": 1, "n": 37888, "k": 3584, "kernel": "cublas", "us": 69.3, "cublas_us": 69.3},
        ...]}

`MatmulRoutes.lookup` gives a call of ``rows`` rows the route measured for the same (N, K)
at the smallest measured row count >= rows; a shape the table does not hold, more rows than
it measured, or a "cublas" route give None (the caller runs ``F.linear``). A table next to
this module (`ROUTES_FILE`, when a measured one has been committed there) is the engine's
default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from edmm.kernels._common import KernelInputError, SkinnyConfig

ROUTES_FILE = Path(__file__).with_name("matmul_routes.json")
KERNELS = ("skinny", "cublas")


class MatmulRoutesError(KernelInputError):
    """A routing table file that is not one `matmul_sweep.py` writes."""


@dataclass(frozen=True)
class MatmulRoute:
    """The fastest measured launch of one shape; ``config`` None: cuBLAS was fastest."""

    rows: int
    n: int
    k: int
    config: SkinnyConfig | None
    us: float  # the route's median per call
    cublas_us: float  # F.linear's median per call, the same measurement


@dataclass(frozen=True)
class MatmulRoutes:
    """A measured routing table (``source``: the device and date it was measured on)."""

    routes: tuple[MatmulRoute, ...]
    source: str = ""

    @classmethod
    def from_json(cls, path: Path | str) -> MatmulRoutes:
        """The table in ``path``; raises `MatmulRoutesError` if it is malformed."""
        try:
            data = json.loads(Path(path).read_text())
            return cls.from_rows(data["routes"],
                                 f"{data.get('device', '?')}, {data.get('date', '?')}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MatmulRoutesError(f"{path}: not a matmul routing table ({e})") from e

    @classmethod
    def from_rows(cls, rows: list[dict[str, Any]], source: str = "") -> MatmulRoutes:
        """The table of ``rows`` in the file's format (`route_row`'s); raises ValueError,
        KeyError or TypeError for a malformed row."""
        return cls(tuple(_route(r) for r in rows), source)

    def lookup(self, rows: int, n: int, k: int) -> SkinnyConfig | None:
        """The skinny launch of the smallest measured row count >= ``rows`` for (n, k), or
        None (cuBLAS) where the table routes it there or holds no such shape."""
        measured = sorted((r for r in self.routes if (r.n, r.k) == (n, k) and r.rows >= rows),
                          key=lambda r: r.rows)
        return measured[0].config if measured else None


def with_pdl(routes: MatmulRoutes) -> MatmulRoutes:
    """``routes`` with every skinny launch on programmatic dependent launch (an in-model
    experiment: the sweep's timings, back-to-back calls of one kernel, cannot show what PDL
    gains behind the kernels a model runs before each projection)."""
    return MatmulRoutes(tuple(
        replace(r, config=replace(r.config, pdl=True)) if r.config is not None else r
        for r in routes.routes), routes.source + ", PDL on every skinny launch")


def default_matmul_routes() -> MatmulRoutes | None:
    """The measured table committed next to this module, or None."""
    return MatmulRoutes.from_json(ROUTES_FILE) if ROUTES_FILE.is_file() else None


def route_row(rows: int, n: int, k: int, config: SkinnyConfig | None, us: float,
              cublas_us: float) -> dict[str, Any]:
    """One table row as `matmul_sweep.py` writes it (the inverse of `from_json`'s parsing)."""
    row: dict[str, Any] = {"rows": rows, "n": n, "k": k,
                           "kernel": "cublas" if config is None else "skinny"}
    if config is not None:
        row.update(block_n=config.block_n, block_k=config.block_k, splits=config.splits,
                   num_warps=config.num_warps, num_stages=config.num_stages, pdl=config.pdl)
    row.update(us=round(us, 3), cublas_us=round(cublas_us, 3))
    return row


def _route(r: dict[str, Any]) -> MatmulRoute:
    if r["kernel"] not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS} in {r}")
    pdl = r.get("pdl", False)
    if not isinstance(pdl, bool):
        raise ValueError(f"pdl must be true or false in {r}")
    config = (SkinnyConfig(int(r["block_n"]), int(r["block_k"]), int(r["splits"]),
                           int(r["num_warps"]), int(r["num_stages"]), pdl)
              if r["kernel"] == "skinny" else None)
    route = MatmulRoute(int(r["rows"]), int(r["n"]), int(r["k"]), config, float(r["us"]),
                        float(r["cublas_us"]))
    if min(route.rows, route.n, route.k) < 1:
        raise ValueError(f"non-positive rows/n/k in {r}")
    return route
