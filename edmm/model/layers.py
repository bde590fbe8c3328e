"""Basic layers: projections, RMSNorm and the SwiGLU MLP (gate and up projections fused)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edmm.model.fusion import PointwiseOps

Matmul = Callable[[Tensor, Tensor, Tensor | None], Tensor]  # F.linear's (x, weight, bias)


class Projection(nn.Linear):
    """An ``nn.Linear`` whose product runs through ``matmul`` (default ``F.linear``), which a
    model sets for all its projections at once (`CausalLM.set_matmul`: the measured skinny
    routes of decode batches)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.matmul: Matmul = F.linear

    def forward(self, x: Tensor) -> Tensor:
        """x [T, in_features] -> [T, out_features]."""
        return self.matmul(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back, then scaled (the HF Llama/Qwen order)."""

    def __init__(self, dim: int, eps: float, ops: PointwiseOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops if ops is not None else PointwiseOps()

    def forward(self, x: Tensor) -> Tensor:
        """x [..., dim] -> [..., dim]."""
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """``(norm(x + residual), x + residual)``, one fused kernel when compiled."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up stacked in one ``gate_up_proj``.

    ``gate_up_proj.weight`` rows [0, I) hold HF ``gate_proj`` and rows [I, 2I) ``up_proj``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 ops: PointwiseOps | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.ops = ops if ops is not None else PointwiseOps()
        self.gate_up_proj = Projection(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Projection(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """x [T, hidden] -> [T, hidden]."""
        gate_up = self.gate_up_proj(x)  # [T, 2I]: gate rows, then up rows
        return self.down_proj(self.ops.silu_mul(gate_up))  # silu(gate) * up: [T, I]
