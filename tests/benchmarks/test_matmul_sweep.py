"""benchmarks.kernels.matmul_sweep without a GPU: its candidates, and the routing table and
report from synthetic timings, read back by `MatmulRoutes`."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from benchmarks.kernels import matmul_sweep as sweep
from edmm.kernels._common import SkinnyConfig, cdiv
from edmm.kernels.matmul_routes import MatmulRoutes
from edmm.model.config import resolve_preset


def test_projections_of_qwen_7b() -> None:
    shapes = {s.name: (s.n, s.k, s.bias) for s in sweep.projections(resolve_preset("qwen2.5-7b"))}
    assert shapes == {"qkv": (4608, 3584, True), "o_proj": (3584, 3584, False),
                      "gate_up": (37888, 3584, False), "down": (3584, 18944, False),
                      "lm_head": (152064, 3584, False)}


def test_candidates_fill_the_gpu_and_never_repeat_a_split_size() -> None:
    for n, k in ((3584, 3584), (3584, 18944), (152064, 3584)):
        seen = set()
        for c in sweep.candidates(n, k):
            k_split = cdiv(cdiv(k, c.splits), c.block_k) * c.block_k
            assert cdiv(k, k_split) == c.splits  # the split count the kernel launches
            programs = cdiv(n, c.block_n) * c.splits
            assert programs <= sweep.MAX_PROGRAMS
            assert c.splits == 1 or programs >= sweep.MIN_PROGRAMS
            key = (c.block_n, c.block_k, c.num_warps, c.num_stages, c.splits)
            assert key not in seen
            seen.add(key)
        assert seen
    assert all(c.splits == 1 for c in sweep.candidates(152064, 3584) if c.block_n == 32)


def _t(rows: int, kernel: str, us: float, ulps: float = 0.5,
       cfg: SkinnyConfig | None = None) -> sweep.Timing:
    return sweep.Timing("o_proj", 3584, 3584, rows, kernel, asdict(cfg) if cfg else None, us,
                        25.7e6 / us / 1e6, ulps)


def test_routes_take_the_fastest_exact_skinny_launch_only_where_it_beats_cublas(
        tmp_path: Path) -> None:
    fast, wrong = SkinnyConfig(64, 128, 4), SkinnyConfig(128, 128, 8)
    timings = [_t(1, "cublas", 11.0), _t(1, "skinny", 8.0, cfg=fast),
               _t(1, "skinny", 6.0, ulps=3.0, cfg=wrong),  # off by 3 ulp: never routed
               _t(16, "cublas", 9.0), _t(16, "skinny", 9.5, cfg=fast)]  # slower: cuBLAS
    env = {"gpu": "H200"}
    md = sweep.write(tmp_path, timings, env, "cmd")
    table = MatmulRoutes.from_json(tmp_path / "matmul_routes.json")
    assert table.lookup(1, 3584, 3584) == fast
    assert table.lookup(16, 3584, 3584) is None
    assert "| o_proj | 3584 x 3584 | 1 | 11.0 us" in md and "| skinny | 3.0 us |" in md
    rows = json.loads((tmp_path / "matmul-sweep.json").read_text())["timings"]
    assert len(rows) == len(timings)
