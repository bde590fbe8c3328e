"""Triton kernel of a skinny matmul ``out = x @ w^T (+ bias)`` for a few rows of x (decode).

Imported only when a kernel runs: this module imports triton at the top.

Grid: (N tiles, K splits). A program streams one [BLOCK_N, k_split] strip of the weight w
[N, K] (rows contiguous along K) once and multiplies it with the matching columns of all
rows of x [M, K] (M <= BLOCK_M; the tile is [BLOCK_N, BLOCK_M], x transposed: the weight is
the tensor-core operand with the long side). With one split the program writes its tile of
out directly. With several, each writes its fp32 partial to a workspace [splits, N, BLOCK_M]
and counts itself done on its N tile's int32 counter; the program that counts last sums the
partials in split order (the same sum whichever program merges: deterministic), adds the bias,
writes out and sets the counter back to 0, so the counters are zero again when the kernel ends
(zeroed once at allocation; capturable in a CUDA graph, replayable). No second launch, no
atomic adds of data.

PDL (Hopper and later; not in the interpreter, which has no inline assembly): launched with
programmatic dependent launch, a program may start while the kernel before it still runs (as
soon as that kernel lets its dependents start: the decode attention's reduce does, before its
own work). Before ``gdc_wait`` it only asks L2 for the first PREFETCH_TILES tiles of its
weight strip (``prefetch.global.L2``: the weights are written by no kernel of the step); x,
the partials, the counters and out are touched after it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

LINE_BYTES = tl.constexpr(128)  # L2 line one prefetch asks for


@triton.jit(do_not_specialize=["m", "split_tiles"])
def skinny_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    m, n, k,  # out [m, n] = x [m, k] @ w [n, k]^T
    split_tiles,  # BLOCK_K tiles of K per split
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, PREFETCH_TILES: tl.constexpr,
    ELEM_BYTES: tl.constexpr,
):
    """One (N tile, K split): its partial product; with SPLIT, the last split merges."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    n_mask = offs_n < n
    m_mask = offs_m < m
    k_lo = pid_k * split_tiles * BLOCK_K  # a multiple of BLOCK_K: aligned, vector loads
    k_hi = tl.minimum(k_lo + split_tiles * BLOCK_K, k)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    if PDL:
        _prefetch_l2(w_ptr, offs_n, n, k_lo, tl.minimum(k_lo + PREFETCH_TILES * BLOCK_K, k_hi),
                     stride_wn, BLOCK_K, ELEM_BYTES)
        gdc_wait()  # x is the output of the kernels before this one
    x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN:  # N a multiple of BLOCK_N, every split's range a multiple of BLOCK_K
            w = tl.load(w_ptrs + k0)  # [BLOCK_N, BLOCK_K]
            x = tl.load(x_ptrs + k0, mask=m_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]
        else:
            k_in = (k0 + offs_k) < k_hi  # [BLOCK_K]
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_in[None, :], other=0.0)
            x = tl.load(x_ptrs + k0, mask=k_in[:, None] & m_mask[None, :], other=0.0)
        acc = tl.dot(w, x, acc, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT:
        tile = offs_n.to(tl.int64)[:, None] * BLOCK_M + offs_m[None, :]  # [BLOCK_N, BLOCK_M]
        tl.store(part_ptr + pid_k.to(tl.int64) * n * BLOCK_M + tile, acc, mask=n_mask[:, None])
        tl.debug_barrier()  # every thread's partial stores before the release below
        count = count_ptr + pid_n
        if tl.atomic_add(count, 1, sem="acq_rel") == tl.num_programs(1) - 1:
            tl.debug_barrier()  # the acquire above before any thread's partial loads
            tl.store(count, 0)  # zero again for the next launch
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in range(0, tl.num_programs(1)):  # split order: the same sum every time
                total += tl.load(part_ptr + s * n * BLOCK_M + tile, mask=n_mask[:, None],
                                 other=0.0, cache_modifier=".cg")  # other programs wrote it
            _store(total, bias_ptr, offs_n, n_mask, out_ptrs, out_mask, HAS_BIAS)
    else:
        _store(acc, bias_ptr, offs_n, n_mask, out_ptrs, out_mask, HAS_BIAS)


@triton.jit
def _prefetch_l2(w_ptr, offs_n, n, lo, hi, stride_wn, BLOCK_K: tl.constexpr,
                 ELEM_BYTES: tl.constexpr):
    """Ask L2 for the lines of columns lo .. hi - 1 of weight rows ``offs_n`` (rows past n
    and lines past hi repeat row 0's / column lo's: the instruction has no masked form)."""
    LINE_ELEMS: tl.constexpr = LINE_BYTES // ELEM_BYTES
    LINES: tl.constexpr = BLOCK_K // LINE_ELEMS
    rows = tl.where(offs_n < n, offs_n, 0).to(tl.int64)  # [BLOCK_N]
    first = tl.arange(0, LINES) * LINE_ELEMS  # [LINES] first column of each line of a tile
    for k0 in range(lo, hi, BLOCK_K):
        col = tl.where(k0 + first < hi, k0 + first, lo)  # [LINES]
        at = w_ptr + rows[:, None] * stride_wn + col[None, :]  # [BLOCK_N, LINES]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [at],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store(acc, bias_ptr, offs_n, n_mask, out_ptrs, out_mask, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] fp32 (+ bias, in fp32), rounded once to out's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=out_mask)
