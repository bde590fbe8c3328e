"""edmm.bench.scripts.decode_sweep: the routing table from timed rows (no GPU: synthetic rows),
read back by `DecodeRoutes`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from edmm.bench.attention import Row
from edmm.kernels import DecodeConfig
from edmm.kernels.decode_routes import DecodeRoutes

SCRIPT = Path(__file__).parents[2] / "edmm" / "bench" / "scripts" / "decode_sweep.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("decode_sweep", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(impl: str, batch: int, us: float, splits: int = 0, err: float = 1e-3) -> Row:
    extra = {"num_splits": splits, "block_n": 64, "num_warps": 4, "num_stages": 3}
    work = batch * 16384 * 4 * 128 * 2 * 2
    return Row("decode-graph", impl, batch, 16384, 1, us, us, us, work / us * 1e-3, "GB/s",
               rel_err=err, note=f"splits={splits}" if splits else "",
               extra=extra if splits else {})


def test_routes_keep_the_fastest_correct_launch(tmp_path: Path) -> None:
    sweep = _script()
    rows = [_row("triton", 1, 16.0), _row("sdpa", 1, 20.0),
            _row("triton-sweep", 1, 12.0, splits=32), _row("triton-sweep", 1, 9.0, splits=64),
            _row("triton-sweep", 1, 5.0, splits=96, err=0.5),  # wrong output: never routed
            _row("triton-sweep", 8, 70.0, splits=8), _row("triton-sweep", 8, 75.0, splits=16)]
    table = sweep.routes(rows)
    assert [(r["batch"], r["num_splits"], r["graph_us"]) for r in table] == [
        (1, 64, 9.0), (8, 8, 70.0)]
    path = tmp_path / "decode_routes.json"
    path.write_text(json.dumps({"device": "test", "date": "today", "routes": table}))
    route = DecodeRoutes.from_json(path).lookup(1, 16384)
    assert route is not None
    assert (route.num_splits, route.config) == (64, DecodeConfig(64, 4, 3))
    md = sweep.markdown(rows, table, "# t")
    assert "| 1 | 16384 | 16.0 us" in md and "(splits=64)" in md
