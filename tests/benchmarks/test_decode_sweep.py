"""benchmarks.kernels.decode_sweep: the routing table from timed rows (no GPU: synthetic rows),
read back by `DecodeRoutes`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from benchmarks.kernels.attention import Row
from edmm.kernels import DecodeConfig
from edmm.kernels.decode_routes import DecodeRoutes

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "kernels" / "decode_sweep.py"


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


def _mode_row(batch: int, us: float, splits: int, fused: bool, pdl: bool) -> Row:
    row = _row("triton-sweep", batch, us, splits=splits)
    row.extra |= {"fused": fused, "pdl": pdl}
    return row


def test_fused_and_pdl_launches_route_and_tabulate(tmp_path: Path) -> None:
    sweep = _script()
    rows = [_mode_row(1, 14.0, 64, False, False), _mode_row(1, 12.5, 64, False, True),
            _mode_row(1, 11.0, 384, True, True), _mode_row(1, 13.0, 32, True, False),
            _mode_row(8, 68.0, 8, False, False), _mode_row(8, 69.0, 8, True, True)]
    table = sweep.routes(rows)
    path = tmp_path / "decode_routes.json"
    path.write_text(json.dumps({"device": "test", "date": "today", "routes": table}))
    routes = DecodeRoutes.from_json(path)
    one, eight = routes.lookup(1, 16384), routes.lookup(8, 16384)
    assert one is not None and eight is not None
    assert (one.num_splits, one.config) == (384, DecodeConfig(64, 4, 3, fused=True, pdl=True))
    assert (eight.num_splits, eight.config) == (8, DecodeConfig(64, 4, 3))
    md = sweep.markdown(rows, table, "# t")
    assert "| batch | context | reduce | reduce-pdl | fused | fused-pdl |" in md
    assert "| 1 | 16384 | 14.0 us" in md and "11.0 us, 3.05 TB/s (splits=384, 64x4x3)" in md


def test_candidates_respect_each_mode_and_the_tiles() -> None:
    sweep = _script()
    launches = sweep.candidates(["reduce", "fused-pdl"], (DecodeConfig(32, 2, 3),),
                                (64, 256, 384, 1024), 16384)
    assert [(n, c.fused, c.pdl) for n, c in launches] == [
        (64, False, False), (256, False, False),  # the reduce kernel holds <= 256 splits
        (64, True, True), (256, True, True), (384, True, True)]  # 1024 > 512 tiles of 32
    assert sweep.parse_configs("32x2x3,128x8x3") == (DecodeConfig(32, 2, 3),
                                                      DecodeConfig(128, 8, 3))
    try:
        sweep.parse_configs("32x2")
    except SystemExit as e:
        assert "BLOCK_NxWARPSxSTAGES" in str(e)
    else:
        raise AssertionError("a config of two numbers was accepted")


def test_prefetch_depth_configs_run_only_in_prefetch_modes() -> None:
    sweep = _script()
    configs = sweep.parse_configs("64x2x3x1,64x2x3")
    assert configs == (DecodeConfig(64, 2, 3, prefetch_tiles=1), DecodeConfig(64, 2, 3))
    launches = sweep.candidates(["reduce-pdl", "fused-pdl-early-prefetch"], configs, (64,),
                                16384)
    assert [(c.fused, c.prefetch, c.prefetch_tiles, c.early_launch) for _, c in launches] == [
        (False, False, 0, False),  # 64x2x3x1 without prefetch is 64x2x3: swept once
        (True, True, 1, True), (True, True, 0, True)]
    assert "reduce-early" not in sweep.MODES  # early launch is a form of pdl
    row = _row("triton-sweep", 1, 10.0, splits=64)
    row.extra |= {"fused": True, "pdl": True, "prefetch": True, "prefetch_tiles": 1}
    assert "64x4x3x1)" in sweep.markdown([row], sweep.routes([row]), "# t")


def test_balanced_and_tma_config_letters() -> None:
    """``b`` and ``t`` after a config's numbers set `DecodeConfig.balanced` and ``tma``; the
    route keeps them and the mode table shows them."""
    sweep = _script()
    assert sweep.parse_configs("64x2x3bt,32x2x4x1b,64x2x3t") == (
        DecodeConfig(64, 2, 3, balanced=True, tma=True),
        DecodeConfig(32, 2, 4, prefetch_tiles=1, balanced=True), DecodeConfig(64, 2, 3, tma=True))
    for bad in ("64x2x3bb", "64x2x3q", "b"):
        try:
            sweep.parse_configs(bad)
        except SystemExit:
            continue
        raise AssertionError(f"{bad!r} was accepted")
    row = _row("triton-sweep", 1, 10.0, splits=66)
    row.extra |= {"pdl": True, "balanced": True, "tma": True}
    table = sweep.routes([row])
    assert table[0]["balanced"] and table[0]["tma"] and table[0]["num_splits"] == 66
    assert "64x4x3bt)" in sweep.markdown([row], table, "# t")
