"""Triton projection of one row (a decode step of one sequence): y = W x (+ b), W read once.

Imported only when a kernel runs: this module imports triton at the top.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["k"])
def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, n, k, stride_wn, HAS_BIAS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Outputs [BLOCK_N * program_id(0), +BLOCK_N) of y [n] = W [n, k] @ x [k] (+ b [n]).

    Products and sums in float32 on the CUDA cores (the kernel is bound by reading W); the bias
    is added in float32 and the sum rounded once, as cuBLAS's epilogue does.
    """
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = offs_n < n
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = offs_k < k
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)  # [BLOCK_K]
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)
