"""SiLU-and-multiply of a fused gate/up projection in one pass over its rows.

``torch.compile`` with dynamic shapes turns ``silu(gate) * up`` into a flat kernel that
divides every element's index by the (symbolic) width; at 512 tokens of Qwen2.5-7B it ran at
about a third of the H200's memory bandwidth. This kernel walks rows and column blocks: the
launch depends on the token count only (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from edmm.kernels._common import (
    SUPPORTED_DTYPES,
    KernelInputError,
    cdiv,
    pdl_usable,
    require_triton,
)

WIDE, NARROW = 1024, 256  # columns per program: many rows, few rows (spread a decode's row)
FEW_ROWS = 64


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first, unit stride on the last dim) -> silu(gate) * up [T, I]."""
    require_triton(gate_up.device)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise KernelInputError(f"gate_up must be [T, 2I] with unit stride on the last dim, "
                               f"got {tuple(gate_up.shape)} strides {gate_up.stride()}")
    if gate_up.dtype not in SUPPORTED_DTYPES:
        raise KernelInputError(f"dtype {gate_up.dtype} not in {SUPPORTED_DTYPES}")
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)  # [T, I]
    if t == 0:
        return out
    from edmm.kernels import _triton_silu as tk

    block = NARROW if t <= FEW_ROWS else WIDE
    tk.silu_mul_kernel[(t, cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block,
        TRIGGER=pdl_usable(gate_up.device), num_warps=4)
    return out
