"""The elementwise chains of a decoder layer, run eagerly or compiled into fused kernels.

Eager PyTorch runs a residual add and RMSNorm as ~9 kernels, RoPE as ~10 and SiLU-and-multiply
as 2; at one token per sequence (decode) each is a few microseconds of launch and latency,
~1.4 ms of a 7B decode step on an H200 (measured with `python -m benchmarks.scripts.profile_model`).
`PointwiseOps.compile` turns each chain into one Triton kernel with ``torch.compile``
(dynamic shapes, so one compile serves every token count), except SiLU-and-multiply, which
takes the hand-written `edmm.kernels.silu_mul` where triton is installed (the compiled form
divides every element's index by the symbolic width: a third of the memory bandwidth). The
math is HF's: RMSNorm in float32, cast, then scaled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., dim] -> [..., dim]: normalised in float32, cast back, scaled."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float
                 ) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add folded into the next norm."""
    summed = x + residual  # in the activations' dtype, as HF adds
    return rms_norm(summed, weight, eps), summed


def rotate_half(x: Tensor) -> Tensor:
    """[..., D] -> [..., D] with halves (x1, x2) mapped to (-x2, x1)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D] -> rotated (q, k)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass
class PointwiseOps:
    """The functions a model's layers call for their elementwise work; one instance per model."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor] = rms_norm
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]] = add_rms_norm
    rotary_qk: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] = rotary_qk
    silu_mul: Callable[[Tensor], Tensor] = silu_mul
    compiled: bool = False

    def compile(self) -> None:
        """Replace each function by a fused kernel (CUDA; compiles on first use)."""
        from edmm.kernels import silu_mul as triton_silu_mul
        from edmm.kernels import triton_available

        if self.compiled:
            return
        opts = {"dynamic": True, "fullgraph": True}
        self.rms_norm = torch.compile(rms_norm, **opts)  # type: ignore[call-overload]
        self.add_rms_norm = torch.compile(add_rms_norm, **opts)  # type: ignore[call-overload]
        self.rotary_qk = torch.compile(rotary_qk, **opts)  # type: ignore[call-overload]
        self.silu_mul = (triton_silu_mul if triton_available()
                         else torch.compile(silu_mul, **opts))  # type: ignore[call-overload]
        self.compiled = True
