"""Triton SiLU-and-multiply over the rows of a fused gate/up projection.

Imported only when a kernel runs: this module imports triton at the top.

TRIGGER (Hopper and later; not in the interpreter): each program first lets a kernel launched
after it with programmatic dependent launch (the down projection's skinny matmul) start; that
kernel waits (``gdc_wait``) for this one to complete before it reads its output.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr,
                    TRIGGER: tl.constexpr):
    """Row ``program_id(0)``, columns [BLOCK * program_id(1), +BLOCK) of silu(gate) * up.

    Rounded as eager PyTorch does in x's dtype: silu rounded, then the product rounded.
    """
    if TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)
