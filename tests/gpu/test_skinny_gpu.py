"""The skinny matmul kernel on CUDA at Qwen2.5-7B's decode projections, against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edmm.kernels import triton_available
from edmm.kernels._common import CounterWorkspace, SkinnyConfig
from edmm.kernels.matmul_routes import MatmulRoutes, route_row
from edmm.kernels.skinny_matmul import RoutedMatmul, skinny_linear

# No triton import here: collecting this module must not import triton before
# tests/kernels/conftest.py sets TRITON_INTERPRET for the CPU kernel tests.
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled_kernels"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not triton_available(), reason="the kernels need triton")]

SHAPES = {"qkv": (4608, 3584, True), "o_proj": (3584, 3584, False),
          "gate_up": (37888, 3584, False), "down": (3584, 18944, False),
          "lm_head": (152064, 3584, False)}  # N, K, bias
CONFIGS = [SkinnyConfig(64, 128, 1, 4, 4), SkinnyConfig(64, 128, 4, 4, 4),
           SkinnyConfig(128, 128, 8, 8, 4), SkinnyConfig(32, 256, 3, 4, 4),
           SkinnyConfig(16, 256, 2, 4, 8, pdl=True), SkinnyConfig(64, 128, 1, 4, 8, pdl=True)]


def _inputs(m: int, n: int, k: int, bias: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)  # [M, K]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen) if bias else None
    return x, w, b


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| in bf16 units of the last place at |ref| (ref: fp32 product)."""
    return (got.float() - ref).abs() / (torch.finfo(torch.bfloat16).eps
                                        * ref.abs().clamp_min(1e-2))


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("m", [1, 8, 16])
def test_real_shapes_match_torch(name: str, m: int) -> None:
    """Within one bf16 ulp of the fp32 product (the kernel rounds its fp32 sum once), and
    never further from it than torch.matmul's own bf16 result is, plus one ulp."""
    n, k, bias = SHAPES[name]
    x, w, b = _inputs(m, n, k, bias)
    ref = F.linear(x.float(), w.float(), b.float() if b is not None else None)  # [M, N]
    torch_err = _ulps(F.linear(x, w, b), ref).max().item()
    ws = CounterWorkspace()
    for cfg in CONFIGS:
        got = skinny_linear(x, w, b, cfg, ws)
        err = _ulps(got, ref).max().item()
        assert err <= 1.0 and err <= torch_err + 1.0, (cfg, err, torch_err)
    assert not ws.counters(1, x.device).any()


@pytest.mark.parametrize("pdl", [False, True])
def test_graph_replay_is_bitwise_the_eager_result(pdl: bool) -> None:
    """Split launches captured in a CUDA graph, replayed twice on new inputs: the same bits
    as eager calls (the merge's order is fixed; the counters are zero after every launch);
    with PDL too, x written by a copy inside the graph just before the launch."""
    n, k, _ = SHAPES["down"]
    x, w, _b = _inputs(4, n, k, False)
    ws = CounterWorkspace()
    cfg = SkinnyConfig(64, 128, 8, 4, 4, pdl=pdl)
    src, static = x.clone(), torch.empty_like(x)
    skinny_linear(src, w, None, cfg, ws)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.copy_(src)
        out = skinny_linear(static, w, None, cfg, ws)
    for seed in (1, 2):
        new = torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda")
                          .manual_seed(seed)).to(x.dtype)
        src.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, skinny_linear(new, w, None, cfg, ws))


def test_routed_matmul_follows_its_table() -> None:
    """A routed shape runs the kernel (bits equal to skinny_linear's), an unrouted one, or
    more rows than measured, runs F.linear (bits equal to torch's)."""
    n, k, _ = SHAPES["o_proj"]
    cfg = SkinnyConfig(64, 128, 4, 4, 4)
    routes = MatmulRoutes.from_rows([route_row(8, n, k, cfg, 1.0, 2.0)])
    routed = RoutedMatmul(routes)
    x, w, _b = _inputs(8, n, k, False)
    assert torch.equal(routed(x[:3], w), skinny_linear(x[:3], w, None, cfg))
    x_narrow, w_narrow = x[:3, :1024].contiguous(), w[:, :1024].contiguous()  # not in the table
    assert torch.equal(routed(x_narrow, w_narrow), F.linear(x_narrow, w_narrow))
    x16, _, _ = _inputs(16, n, k, False)
    assert torch.equal(routed(x16, w), F.linear(x16, w))
