"""The CUDA C++ decode split kernel's CPU-side contract: its config rules, the fallback to the
Triton kernel where it cannot run, its sweep letter and route flag, and its source compiling
with NVRTC (no GPU needed; skipped where cuda-bindings or the NVRTC library is missing).
Its numerics run on the GPU (tests/gpu/test_kernels_gpu.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from edmm.kernels import DecodeConfig, KernelInputError, decode_attention
from edmm.kernels._cuda_decode import CudaDecodeShape, compile_cubin, cuda_decode_usable
from edmm.kernels.reference import decode_attention_reference


@pytest.mark.parametrize("bad", [
    {"block_n": 32, "num_warps": 4},  # a tile is 16 tokens a warp
    {"num_stages": 1},
    {"fused": True}, {"balanced": True}, {"tma": True}, {"prefetch": True},
    {"pdl": True, "early_launch": True},
    {"cuda": False, "cluster": True},  # the cluster merge is the CUDA kernel's
])
def test_config_rules(bad: dict[str, Any]) -> None:
    base: dict[str, Any] = {"block_n": 64, "num_warps": 4, "num_stages": 3, "cuda": True}
    with pytest.raises(KernelInputError):
        DecodeConfig(**{**base, **bad})
    DecodeConfig(**base, pdl=True, sliced_reduce=True)  # its own flags are fine


def test_cpu_tensors_are_not_for_it() -> None:
    q = torch.zeros(1, 28, 128, dtype=torch.bfloat16)
    kv = torch.zeros(1, 8, 2, 4, 128, dtype=torch.bfloat16)
    why = cuda_decode_usable(q, kv)
    assert why is not None and "CUDA tensor" in why


@pytest.mark.usefixtures("interpreted")
def test_falls_back_to_the_triton_kernel_where_it_cannot_run(make_cache: Any,
                                                              check_close: Any) -> None:
    """On the CPU interpreter a ``cuda`` config runs the Triton kernel of the same tile."""
    lens = {0: 77, 1: 300}
    cache = make_cache(lens, dtype=torch.bfloat16, num_slots=2, max_tokens=300)
    q = torch.randn(2, 14, 32).to(torch.bfloat16)
    slots, ctx = [1, 0], [300, 77]
    out = decode_attention(q, cache.kv, 1, torch.tensor(slots, dtype=torch.int32),
                           torch.tensor(ctx, dtype=torch.int32), 32**-0.5, num_splits=3,
                           config=DecodeConfig(32, 2, 2, pdl=True, sliced_reduce=True,
                                               cuda=True))
    ref = decode_attention_reference(q, cache.kv, 1, slots, ctx, 32**-0.5, torch.float64)
    check_close(out, ref, torch.bfloat16)


def test_sweep_letter_and_route_flag(tmp_path: Path) -> None:
    """``c`` sets `DecodeConfig.cuda`; the sweep leaves such configs out of the modes the
    kernel lacks; a routing table keeps the flag."""
    from benchmarks.kernels import decode_sweep as sweep
    from edmm.kernels.decode_routes import DecodeRoutes

    config, clustered = sweep.parse_configs("64x4x3rc,64x4x2ck")
    assert config == DecodeConfig(64, 4, 3, sliced_reduce=True, cuda=True)
    assert clustered == DecodeConfig(64, 4, 2, cuda=True, cluster=True)
    assert [n for n, _ in sweep.candidates(["reduce-pdl"], (clustered,), (8, 16, 24), 16384)] \
        == [8, 16]  # a cluster holds at most 16 splits
    with pytest.raises(SystemExit):
        sweep.parse_configs("64x2x3c")  # 64 tokens need 4 warps of 16
    launches = sweep.candidates(["reduce-pdl", "fused-pdl", "reduce-pdl-prefetch"], (config,),
                                (8, 64), 16384)
    assert {sweep.mode_of(c) for _, c in launches} == {"reduce-pdl"}
    path = tmp_path / "routes.json"
    path.write_text(json.dumps({"routes": [
        {"batch": 1, "context": 16384, "num_splits": 32, "block_n": 64, "num_warps": 4,
         "num_stages": 2, "graph_us": 11.0, "pdl": True, "cuda": True, "cluster": True}]}))
    route = DecodeRoutes.from_json(path).lookup(1, 16384)
    assert route is not None and route.config == DecodeConfig(64, 4, 2, pdl=True, cuda=True,
                                                               cluster=True)


def _nvrtc_or_skip() -> None:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    try:
        nvrtc.nvrtcVersion()
    except Exception as e:  # the binding is there, the library is not
        pytest.skip(f"no NVRTC library: {e}")


@pytest.mark.parametrize("shape", [
    CudaDecodeShape("sm_90", 7, 128, 4, 3, True),  # Qwen2.5-7B, the sweep's configs
    CudaDecodeShape("sm_90", 1, 64, 1, 2, False),
    CudaDecodeShape("sm_90", 16, 128, 8, 2, True),
    CudaDecodeShape("sm_90", 7, 128, 4, 2, True, cluster=16),
])
def test_source_compiles_for_hopper(shape: CudaDecodeShape) -> None:
    _nvrtc_or_skip()
    cubin = compile_cubin(shape)
    assert cubin[:4] == b"\x7fELF" and b"edmm_decode_split" in cubin


def test_shared_memory_of_a_shape() -> None:
    """The rings (warps x stages x 16 tokens of K and V), or the end merge if larger."""
    assert CudaDecodeShape("sm_90", 7, 128, 4, 3, True).smem_bytes == 4 * 3 * 2 * 16 * 256
    assert CudaDecodeShape("sm_90", 7, 64, 1, 2, True).smem_bytes == 2 * 2 * 16 * 128
    # one warp, 64 dims, 16 heads: the merge and the split's output pass the ring
    assert CudaDecodeShape("sm_90", 16, 64, 1, 2, True, cluster=4).smem_bytes == (
        16 * 66 * 4 + (16 * 64 + 16) * 4)
