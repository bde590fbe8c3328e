"""The decode kernel's measured routing table (lookup, file format) and the backends that
consult it; the FA4 backend's non-FA4 routes (decode batches, fp32) on the CPU through the
Triton interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edmm.kernels import DecodeConfig, KernelInputError
from edmm.kernels.decode_routes import DecodeRoute, DecodeRoutes, DecodeRoutesError
from edmm.model import PRESETS, AttentionMetadata
from edmm.model.attention import TorchSDPABackend
from edmm.model.attention_fa4 import FA4AttentionBackend
from edmm.model.attention_triton import TritonAttentionBackend
from edmm.model.transformer import CausalLM


def _route(batch: int, context: int, splits: int, block_n: int = 64,
           fused: bool = False) -> DecodeRoute:
    return DecodeRoute(batch, context, splits, DecodeConfig(block_n, 4, 3, fused=fused), 1.0)


TABLE = DecodeRoutes(tuple(_route(b, c, s) for b, c, s in [
    (1, 4096, 16), (1, 16384, 64), (1, 32768, 128), (8, 4096, 4), (8, 16384, 8),
    (8, 32768, 16)]))


@pytest.mark.parametrize(("batch", "context", "splits"), [
    (1, 16384, 64), (1, 100, 16), (1, 5000, 64), (1, 40000, 128),  # at, below, between, above
    (2, 16384, 8), (8, 32768, 16), (32, 4096, 4)])  # batch up to the next measured, or largest
def test_lookup_takes_the_nearest_measured_shape_at_or_above(batch: int, context: int,
                                                             splits: int) -> None:
    route = TABLE.lookup(batch, context)
    assert route is not None and route.num_splits == splits
    assert DecodeRoutes(()).lookup(1, 1) is None


def test_table_file_round_trip_and_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    path.write_text(json.dumps({"device": "H200", "date": "2026-12-01", "routes": [
        {"batch": 1, "context": 16384, "num_splits": 96, "block_n": 32, "num_warps": 4,
         "num_stages": 4, "graph_us": 10.5}]}))
    table = DecodeRoutes.from_json(path)
    assert table.source == "H200, 2026-12-01"
    assert table.routes == (DecodeRoute(1, 16384, 96, DecodeConfig(32, 4, 4), 10.5),)
    for bad in ({"routes": [{"batch": 1}]}, {"rows": []},
                {"routes": [{"batch": 0, "context": 1, "num_splits": 1, "block_n": 64,
                             "num_warps": 4, "num_stages": 3, "graph_us": 1}]}):
        path.write_text(json.dumps(bad))
        with pytest.raises(DecodeRoutesError):
            DecodeRoutes.from_json(path)
    with pytest.raises(DecodeRoutesError):
        DecodeRoutes.from_json(tmp_path / "missing.json")
    flagged = {"batch": 1, "context": 16384, "num_splits": 384, "block_n": 32, "num_warps": 2,
               "num_stages": 3, "graph_us": 9.5, "fused": True, "pdl": True}
    path.write_text(json.dumps({"routes": [flagged]}))
    assert DecodeRoutes.from_json(path).routes[0].config == DecodeConfig(32, 2, 3, True, True)
    path.write_text(json.dumps({"routes": [
        flagged | {"prefetch": True, "prefetch_tiles": 2, "early_launch": True}]}))
    assert DecodeRoutes.from_json(path).routes[0].config == DecodeConfig(
        32, 2, 3, True, True, prefetch=True, prefetch_tiles=2, early_launch=True)
    path.write_text(json.dumps({"routes": [flagged | {"balanced": True, "tma": True}]}))
    assert DecodeRoutes.from_json(path).routes[0].config == DecodeConfig(
        32, 2, 3, True, True, balanced=True, tma=True)
    path.write_text(json.dumps({"routes": [flagged | {"prefetch_tiles": -1}]}))
    with pytest.raises(DecodeRoutesError, match="prefetch_tiles"):
        DecodeRoutes.from_json(path)
    path.write_text(json.dumps({"routes": [flagged | {"fused": "yes"}]}))
    with pytest.raises(DecodeRoutesError, match="fused"):
        DecodeRoutes.from_json(path)


SLOTS, MAX_TOKENS = 4, 64


def _model(dtype: torch.dtype) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(PRESETS["tiny"], max_positions=MAX_TOKENS).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.reset_buffers()
    return model.to(dtype)


def _forward(backend: object, batch: list[tuple[int, int, int]], dtype: torch.dtype
             ) -> torch.Tensor:
    cfg = PRESETS["tiny"]
    gen = torch.Generator().manual_seed(3)
    shape = (SLOTS, MAX_TOKENS, cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)
    kv = torch.randn(shape, generator=gen).to(dtype)
    slots, qlens, ctxs = ([b[i] for b in batch] for i in range(3))
    meta = AttentionMetadata.build(slots, qlens, ctxs)
    ids = torch.randint(0, cfg.vocab_size, (sum(qlens),), generator=gen)
    model = _model(dtype)
    model.set_backend(backend)  # type: ignore[arg-type]
    assert meta.token_index is not None
    with torch.inference_mode():
        return model(ids, meta.token_index, kv, meta)


DECODE = [(1, 1, 9), (3, 1, 30)]


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(("splits", "fused"), [(1, False), (3, False), (3, True)])
def test_triton_decode_takes_the_routed_launch(splits: int, fused: bool) -> None:
    """A routed split count runs (and computes what the reference does; fused: through the
    backend's workspace, left zero); an impossible one reaches the kernel's check, so the
    route is what the launch used."""
    want = _forward(TorchSDPABackend(), DECODE, torch.float32)
    routed = DecodeRoutes((_route(2, 64, splits, block_n=16, fused=fused),))
    backend = TritonAttentionBackend(64, decode_routes=routed)
    got = _forward(backend, DECODE, torch.float32)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not backend.decode_workspace.counters(1, torch.device("cpu")).any()
    with pytest.raises(KernelInputError, match="num_splits"):
        _forward(TritonAttentionBackend(64, decode_routes=DecodeRoutes((_route(2, 64, 999),))),
                 DECODE, torch.float32)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(("batch", "dtype"), [
    (DECODE, torch.bfloat16),  # decode batches: the Triton split-K kernel
    ([(0, 20, 20), (1, 1, 9), (2, 5, 17)], torch.float32),  # fp32: FA4 has none, Triton runs
])
def test_fa4_backend_routes_off_fa4_match_sdpa(batch: list[tuple[int, int, int]],
                                               dtype: torch.dtype) -> None:
    want = _forward(TorchSDPABackend(), batch, dtype)
    got = _forward(FA4AttentionBackend(64), batch, dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
