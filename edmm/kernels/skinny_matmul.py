"""Skinny matmuls: ``x @ w^T (+ bias)`` for at most 16 rows of x, the projections of a decode
step, streaming the weight once with no second launch.

At one to a few rows per step a projection only reads its weight; cuBLAS's kernels for these
shapes read some of them well below the H200's bandwidth and run split-K with a separate
reduce launch (o_proj and down of Qwen2.5-7B: 56 reduce launches a decode step). This kernel
(`edmm.kernels._triton_skinny`) spreads a weight over (N tiles x K splits) programs and, when
split, merges the splits inside the same launch (the last split of a tile sums them in split
order). `RoutedMatmul` is the model's projection function: the kernel where a measured table
(`edmm.kernels.matmul_routes`) says it beats cuBLAS for the shape, ``F.linear`` everywhere
else. The launch depends on shapes only (capturable in a CUDA graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edmm.kernels._common import (
    CounterWorkspace,
    KernelInputError,
    SkinnyConfig,
    cdiv,
    dot_precision,
    pdl_usable,
    require_triton,
)
from edmm.kernels.matmul_routes import MatmulRoutes

MAX_ROWS = 16  # rows of x one program holds (tl.dot's smallest tile side)
PREFETCH_TILES = 2  # weight tiles a PDL launch asks L2 for before the kernel before it ends
ROUTED_DTYPES = (torch.float16, torch.bfloat16)  # what the routing tables are measured in


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None,
                  workspace: CounterWorkspace | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x of at most `MAX_ROWS` rows, in one launch.

    Args:
        x: [M, K] with M <= 16, unit stride on K.
        weight: [N, K], unit stride on K (an ``nn.Linear`` weight).
        bias: [N] or None.
        config: launch parameters; default `SkinnyConfig()`.
        workspace: the counters of a split launch; default a fresh zeroed one per call (one
            more small launch: callers that launch often, or capture graphs, keep one).

    Returns:
        [M, N] in x's dtype: the fp32 sum over K (plus the bias in fp32), rounded once.
    """
    require_triton(x.device)
    _check(x, weight, bias)
    cfg = config or SkinnyConfig()
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return out
    k_split = cdiv(cdiv(k, cfg.splits), cfg.block_k) * cfg.block_k  # a multiple of block_k
    splits = max(1, cdiv(k, k_split))  # no empty split
    tiles = cdiv(n, cfg.block_n)
    if splits > 1:
        part = torch.empty(splits, n, MAX_ROWS, dtype=torch.float32, device=x.device)
        counters = (workspace or CounterWorkspace()).counters(tiles, x.device)  # [>= tiles]
    else:  # the kernel writes `out` directly: placeholders
        part = counters = out
    pdl = cfg.pdl and pdl_usable(x.device)
    from edmm.kernels import _triton_skinny as tk

    tk.skinny_matmul_kernel[(tiles, splits)](
        x, weight, bias if bias is not None else out, out, part, counters,
        m, n, k, k_split // cfg.block_k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=splits > 1,
        EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0,
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION=dot_precision(x.dtype), PDL=pdl, PREFETCH_TILES=PREFETCH_TILES,
        ELEM_BYTES=x.element_size(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Shapes, strides, dtypes and devices `skinny_linear` takes (never values)."""
    if x.dim() != 2 or not 0 <= x.shape[0] <= MAX_ROWS or x.stride(-1) != 1:
        raise KernelInputError(f"x must be [M <= {MAX_ROWS}, K] with unit stride on K, got "
                               f"{tuple(x.shape)} strides {x.stride()}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.stride(-1) != 1:
        raise KernelInputError(f"weight must be [N, {x.shape[1]}] with unit stride on K, got "
                               f"{tuple(weight.shape)} strides {weight.stride()}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise KernelInputError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    tensors = [x, weight] + ([bias] if bias is not None else [])
    if any(t.dtype != x.dtype for t in tensors) or any(t.device != x.device for t in tensors):
        raise KernelInputError("x, weight and bias must share one dtype and device, got "
                               f"{[(t.dtype, str(t.device)) for t in tensors]}")


class RoutedMatmul:
    """``F.linear`` with measured skinny routes: a call of at most `MAX_ROWS` rows (16-bit, on
    CUDA) whose (rows, N, K) the table routes to the kernel runs `skinny_linear`; every other
    call runs ``F.linear``. One instance per model: it keeps the split launches' counters.
    """

    def __init__(self, routes: MatmulRoutes) -> None:
        self.routes = routes
        self.workspace = CounterWorkspace()
        self._looked_up: dict[tuple[int, int, int], SkinnyConfig | None] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K], weight [N, K], bias [N] or None -> [M, N]."""
        if (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.is_cuda and x.dtype in ROUTED_DTYPES
                and x.stride(-1) == 1 and weight.stride(-1) == 1):
            key = (x.shape[0], weight.shape[0], weight.shape[1])  # rows, N, K
            if key not in self._looked_up:
                self._looked_up[key] = self.routes.lookup(*key)
            cfg = self._looked_up[key]
            if cfg is not None:
                return skinny_linear(x, weight, bias, cfg, self.workspace)
        return F.linear(x, weight, bias)

