"""The projections' skinny-matmul routing table (lookup, file format), `RoutedMatmul`'s
fallback, and the model's projections routed through one matmul function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from edmm.kernels._common import SkinnyConfig
from edmm.kernels.matmul_routes import MatmulRoutes, MatmulRoutesError, route_row, with_pdl
from edmm.kernels.skinny_matmul import RoutedMatmul
from edmm.model.config import ModelConfig
from edmm.model.transformer import CausalLM

FAST = SkinnyConfig(64, 128, 4, 4, 4)
TABLE = MatmulRoutes.from_rows([
    route_row(1, 3584, 3584, FAST, 7.0, 11.0), route_row(4, 3584, 3584, None, 12.0, 12.0),
    route_row(16, 3584, 3584, SkinnyConfig(128, 128, 8, 8, 4), 9.0, 13.0),
    route_row(1, 37888, 3584, None, 70.0, 70.0)])


@pytest.mark.parametrize(("rows", "n", "k", "want"), [
    (1, 3584, 3584, FAST),  # measured, skinny
    (3, 3584, 3584, None), (4, 3584, 3584, None),  # up to 4: cuBLAS measured faster
    (9, 3584, 3584, SkinnyConfig(128, 128, 8, 8, 4)),  # the next measured row count
    (17, 3584, 3584, None),  # more rows than measured
    (1, 37888, 3584, None), (1, 3584, 18944, None)])  # a cuBLAS route; a shape not measured
def test_lookup(rows: int, n: int, k: int, want: SkinnyConfig | None) -> None:
    assert TABLE.lookup(rows, n, k) == want


def test_file_round_trip_and_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    rows = [route_row(2, 4608, 3584, FAST, 8.5, 10.25), route_row(2, 64, 64, None, 3.0, 3.0)]
    path.write_text(json.dumps({"device": "H200", "date": "2026-12-01", "routes": rows}))
    table = MatmulRoutes.from_json(path)
    assert table.source == "H200, 2026-12-01"
    assert [(r.rows, r.n, r.k, r.config, r.us, r.cublas_us) for r in table.routes] == [
        (2, 4608, 3584, FAST, 8.5, 10.25), (2, 64, 64, None, 3.0, 3.0)]
    bad_rows = [{**rows[0], "kernel": "cutlass"}, {**rows[0], "block_n": 24},
                {**rows[0], "rows": 0}, {"rows": 1, "n": 2}]
    for bad in [{"routes": [r]} for r in bad_rows] + [{"rows": []}]:
        path.write_text(json.dumps(bad))
        with pytest.raises(MatmulRoutesError):
            MatmulRoutes.from_json(path)
    path.write_text("{")
    with pytest.raises(MatmulRoutesError):
        MatmulRoutes.from_json(path)


def test_routed_matmul_runs_f_linear_off_cuda() -> None:
    """On the CPU (and for shapes the table does not route) the result is F.linear's."""
    routed = RoutedMatmul(MatmulRoutes.from_rows([route_row(1, 8, 16, FAST, 1.0, 2.0)]))
    x, w, b = torch.randn(1, 16), torch.randn(8, 16), torch.randn(8)
    assert torch.equal(routed(x, w, b), F.linear(x, w, b))


def test_set_matmul_routes_every_projection_and_the_lm_head() -> None:
    """Every weight product of a forward pass and of the logits goes through the function
    set (a recording F.linear); the outputs stay the same."""
    cfg = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=64, hidden_size=32,
                      intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=64, attention_bias=True,
                      dtype="float32")
    model = CausalLM(cfg)
    seen: list[tuple[int, int]] = []

    def recording(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
                  ) -> torch.Tensor:
        seen.append(tuple(w.shape))  # type: ignore[arg-type]
        return F.linear(x, w, b)

    hidden = torch.randn(3, cfg.hidden_size)
    before = model.compute_logits(hidden)
    model.set_matmul(recording)
    assert torch.equal(model.compute_logits(hidden), before)
    layer = model.model.layers[0]
    layer.self_attn.o_proj(torch.randn(2, cfg.num_heads * cfg.head_dim))
    layer.self_attn.qkv_proj(hidden)
    layer.mlp(hidden)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert seen == [(cfg.vocab_size, cfg.hidden_size), (cfg.hidden_size, q),
                    (q + 2 * kv, cfg.hidden_size), (2 * cfg.intermediate_size, cfg.hidden_size),
                    (cfg.hidden_size, cfg.intermediate_size)]


def test_with_pdl_turns_it_on_for_skinny_routes_only() -> None:
    table = with_pdl(TABLE)
    assert table.lookup(1, 3584, 3584) == SkinnyConfig(64, 128, 4, 4, 4, pdl=True)
    assert table.lookup(1, 37888, 3584) is None and "PDL" in table.source
    row = route_row(1, 8, 16, SkinnyConfig(pdl=True), 1.0, 2.0)
    assert MatmulRoutes.from_rows([row]).lookup(1, 8, 16) == SkinnyConfig(pdl=True)
    with pytest.raises(ValueError):
        MatmulRoutes.from_rows([{**row, "pdl": "yes"}])
