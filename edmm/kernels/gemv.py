"""A linear layer for a single row: the decode step of one sequence.

At one row a projection only streams its weight. cuBLAS runs the small projections of a 7B
decode step (QKV, output: 26-33 MB per call) at 2.2-2.9 TB/s on an H200, well under the
~4 TB/s its large ones reach; this kernel splits the weight's rows over enough programs to
keep every SM streaming. The launch depends on the weight's shape only (capturable).
"""

from __future__ import annotations

import torch

from edmm.kernels._common import GemvConfig, KernelInputError, cdiv, require_triton


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """``F.linear`` of one row: x [1, k] (unit stride), weight [n, k] (unit stride on k), bias
    [n] or None, one dtype, one device -> [1, n]."""
    require_triton(x.device)
    n, k = weight.shape
    if x.dim() != 2 or x.shape != (1, k) or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise KernelInputError(f"gemv takes x [1, {k}] and weight [n, k] with unit stride on "
                               f"k, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise KernelInputError(f"bias must be [{n}] contiguous, got {tuple(bias.shape)}")
    tensors = [t for t in (x, weight, bias) if t is not None]
    if len({t.dtype for t in tensors}) != 1 or len({t.device for t in tensors}) != 1:
        raise KernelInputError("x, weight and bias must share one dtype and device")
    cfg = config or GemvConfig()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)  # [1, n]
    from edmm.kernels import _triton_gemv as tk

    tk.gemv_kernel[(cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else y, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
