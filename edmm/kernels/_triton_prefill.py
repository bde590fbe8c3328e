"""Triton flash-attention forward for prefill over the strided KV arena.

Imported only when a kernel runs: this module imports triton at the top.

`prefill_kernel` grid: (row tiles, query heads). A program holds BLOCK_M queries of one head
and walks the KV of that head in BLOCK_N tiles with an online softmax (scores scaled inside
the exponent). In a varlen batch the row tiles of all sequences are numbered in one flat range
(sequence b owns cdiv(queries_b, BLOCK_M) of them, in order, or last tile first with REVERSE)
and each program finds its sequence with a scan over the B query offsets: the grid, ``T //
BLOCK_M + B`` tiles, depends only on the token and sequence counts, never on the lengths, so
one CUDA graph serves every batch of that shape; spare tiles (and sequences with no queries,
the padding of a graph) do nothing. Causality is end-aligned: query i of a sequence with Lq
queries and n tokens sees keys < n - Lq + i + 1. Tiles every row of the program fully sees run
without masks; only the tiles at the diagonal are masked, and no key at or past the context
length is ever loaded.

`prefill_ws_kernel` is the same attention as one warp-specialized loop for Hopper (see its
docstring).
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_INIT = tl.constexpr(-1.0e30)  # running-max start: finite, so inf - inf never happens


@triton.jit
def _load_tile(base, n0, n_end, stride_kt, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """K or V (``base``) of keys [n0, n0 + BLOCK_N): [BLOCK_N, D]. When MASKED, keys at or
    past ``n_end`` are not loaded (zeros)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    tok = offs_n.to(tl.int64)[:, None] * stride_kt + tl.arange(0, HEAD_DIM)[None, :]
    if MASKED:
        x = tl.load(base + tok, mask=(offs_n < n_end)[:, None], other=0.0)
    else:
        x = tl.load(base + tok)
    return x


@triton.jit
def _softmax_pv(s, v, n0, m_i, l_i, acc, lim, qk_scale,
                MASKED: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update with the unscaled scores ``s`` [BLOCK_M, BLOCK_N] of keys
    [n0, n0 + BLOCK_N) and their values ``v`` [BLOCK_N, D].

    ``lim`` [BLOCK_M]: keys each row sees; when MASKED, keys at or past a row's limit get no
    weight. Scores are scaled inside the exponent (one fused multiply-add per score).
    """
    if MASKED:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        s = tl.where(offs_n[None, :] < lim[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # running max of scaled scores
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_range(q, k_base, v_base, stride_kt, lo, hi, tile_end, m_i, l_i, acc, lim, qk_scale,
                  MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """The KV tiles from ``lo`` to ``hi``: whole tiles below every row's limit, or (MASKED)
    the diagonal ones."""
    for n0 in range(lo, hi, BLOCK_N):
        k = _load_tile(k_base, n0, tile_end, stride_kt, MASKED, HEAD_DIM, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        v = _load_tile(v_base, n0, tile_end, stride_kt, MASKED, HEAD_DIM, BLOCK_N)
        m_i, l_i, acc = _softmax_pv(s, v, n0, m_i, l_i, acc, lim, qk_scale, MASKED, BLOCK_N,
                                    DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _find_tile(cu_q_ptr, num_seqs, steps, BLOCK_M: tl.constexpr, SKIP_SINGLE: tl.constexpr,
               REVERSE: tl.constexpr):
    """Sequence and tile index within it of this program's flat tile (-1: a spare tile).

    Sequence i owns the flat tiles from cu_q[i] // BLOCK_M + i, a nondecreasing start that
    leaves room for its ceil(n_q / BLOCK_M) tiles before the next one's; the flat tiles
    number T // BLOCK_M + B in all. A program finds its sequence by a binary search over cu_q
    in ``steps`` (>= bit length of num_seqs) scalar loads: a CUDA graph's padding sequences
    (hundreds in a graph for many running sequences) cost each program a few loads, not one per
    sequence, and the search holds no vector reduction (Triton's warp-specialization pass
    fails on a kernel with one). With SKIP_SINGLE, sequences of one query own no tile; with
    REVERSE, a sequence's last tile (the most keys) comes first."""
    blk = tl.program_id(0)
    lo = blk * 0  # the last sequence whose start is <= blk lies in [lo, hi]
    hi = lo + num_seqs - 1
    for _ in range(0, steps):
        mid = (lo + hi + 1) // 2
        go = tl.load(cu_q_ptr + mid).to(tl.int32) // BLOCK_M + mid <= blk
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    q0 = tl.load(cu_q_ptr + lo).to(tl.int32)
    n_q = tl.load(cu_q_ptr + lo + 1).to(tl.int32) - q0
    if SKIP_SINGLE:
        n_q = tl.where(n_q == 1, 0, n_q)
    n_tiles = (n_q + BLOCK_M - 1) // BLOCK_M
    own = blk - (q0 // BLOCK_M + lo)
    tile = n_tiles - 1 - own if REVERSE else own
    live = own < n_tiles
    return tl.where(live, lo, -1), tl.where(live, tile, 0)


@triton.jit(do_not_specialize=["slot_arg", "ctx_arg", "qlen_arg", "num_seqs", "steps", "qk_scale"])
def prefill_kernel(
    q_ptr, kv_ptr, out_ptr, cu_q_ptr, slot_ids_ptr, ctx_lens_ptr,
    slot_arg, ctx_arg, qlen_arg,  # the one sequence's slot, tokens, queries when not VARLEN
    num_seqs, steps,  # B and its bit length when VARLEN
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh,  # q [T, Hq, D]
    stride_ks, stride_kt, stride_kkv, stride_kh,  # kv layer view [S, M, 2, Hkv, D]
    stride_ot, stride_oh,  # out [T, Hq, D]
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, SKIP_SINGLE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    REVERSE: tl.constexpr,
):
    """One (query tile, query head) of end-aligned causal attention."""
    if VARLEN:
        b, mt = _find_tile(cu_q_ptr, num_seqs, steps, BLOCK_M, SKIP_SINGLE, REVERSE)
        if b < 0:
            return
        q_start = tl.load(cu_q_ptr + b).to(tl.int32)
        qlen = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q_start
        slot = tl.load(slot_ids_ptr + b).to(tl.int32)
        ctx = tl.load(ctx_lens_ptr + b).to(tl.int32)
    else:
        q_start = 0
        qlen = qlen_arg
        slot = slot_arg
        ctx = ctx_arg
        n_tiles = (qlen + BLOCK_M - 1) // BLOCK_M
        mt = n_tiles - 1 - tl.program_id(0) if REVERSE else tl.program_id(0)
    m0 = mt * BLOCK_M  # first query of this tile
    if m0 >= qlen or m0 < 0:
        return

    head = tl.program_id(1)
    kvh = head // GROUP
    query = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the sequence
    last_q = tl.minimum(m0 + BLOCK_M, qlen) - 1
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = query < qlen
    rows = (q_start + query).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None], other=0.0)  # [BLOCK_M, D]

    k_base = kv_ptr + slot.to(tl.int64) * stride_ks + kvh * stride_kh
    v_base = k_base + stride_kkv
    m_i = tl.full([BLOCK_M], NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_end = (ctx - qlen + m0 + 1) // BLOCK_N * BLOCK_N  # keys all rows see, whole tiles
    tile_end = ctx - qlen + last_q + 1  # keys the last row sees, <= ctx
    lim = tl.minimum(ctx - qlen + query + 1, tile_end)  # [BLOCK_M] keys each row sees
    m_i, l_i, acc = _attend_range(q, k_base, v_base, stride_kt, 0, full_end, tile_end, m_i, l_i,
                                  acc, lim, qk_scale, False, HEAD_DIM, BLOCK_N, DOT_PRECISION)
    m_i, l_i, acc = _attend_range(q, k_base, v_base, stride_kt, full_end, tile_end, tile_end,
                                  m_i, l_i, acc, lim, qk_scale, True, HEAD_DIM, BLOCK_N,
                                  DOT_PRECISION)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit(do_not_specialize=["num_seqs", "steps", "num_tokens", "qk_scale"])
def prefill_ws_kernel(
    q_ptr, kv_ptr, out_ptr, cu_q_ptr, slot_ids_ptr, ctx_lens_ptr,
    num_seqs, steps, num_tokens,  # B and its bit length; T, the rows of q
    qk_scale,  # softmax scale * log2(e)
    stride_qt,  # q [T, Hq, D], unit stride on D and Hq * D
    stride_ks, stride_kt, stride_kkv, stride_kh,  # kv layer view [S, M, 2, Hkv, D]
    stride_ot, stride_oh,  # out [T, Hq, D]
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SKIP_SINGLE: tl.constexpr, REVERSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """`prefill_kernel` (VARLEN) as one warp-specialized loop: a TMA producer warpgroup feeds
    two consumer warpgroups that split the BLOCK_M rows (Triton's Hopper warp specialization).

    The pass takes a single loop with descriptor loads and no early exit, so every program runs
    one loop over all its tiles with the causal mask on each, spare programs run it zero times,
    and the K/V descriptors are made here per (sequence, KV head) with the sequence's key count
    as their bound: the copy engine zero-fills the rest of a diagonal tile and never reads a key
    at or past the context (unmapped arena pages there would fault).
    """
    b, mt = _find_tile(cu_q_ptr, num_seqs, steps, BLOCK_M, SKIP_SINGLE, REVERSE)
    live = b >= 0
    b = tl.maximum(b, 0)
    q_start = tl.load(cu_q_ptr + b).to(tl.int32)
    qlen = tl.where(live, tl.load(cu_q_ptr + b + 1).to(tl.int32) - q_start, 0)
    slot = tl.load(slot_ids_ptr + b).to(tl.int64)
    ctx = tl.load(ctx_lens_ptr + b).to(tl.int32)
    m0 = mt * BLOCK_M  # first query of this tile
    head = tl.program_id(1)
    kvh = head // GROUP

    query = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    last_q = tl.minimum(m0 + BLOCK_M, qlen) - 1
    tile_end = tl.maximum(ctx - qlen + last_q + 1, 1)  # keys the last row sees
    hi = tl.where(m0 < qlen, tile_end, 0)  # no tiles for a spare program
    lim = tl.minimum(ctx - qlen + query + 1, tile_end)  # [BLOCK_M] keys each row sees
    q_desc = tl.make_tensor_descriptor(q_ptr + head * HEAD_DIM, shape=[num_tokens, HEAD_DIM],
                                       strides=[stride_qt, 1], block_shape=[BLOCK_M, HEAD_DIM])
    k_base = kv_ptr + slot * stride_ks + kvh * stride_kh
    k_desc = tl.make_tensor_descriptor(k_base, shape=[tile_end, HEAD_DIM],
                                       strides=[stride_kt, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(k_base + stride_kkv, shape=[tile_end, HEAD_DIM],
                                       strides=[stride_kt, 1], block_shape=[BLOCK_N, HEAD_DIM])
    q = q_desc.load([q_start + m0, 0])  # [BLOCK_M, D]; rows past qlen are not stored
    m_i = tl.full([BLOCK_M], NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in tl.range(0, hi, BLOCK_N, warp_specialize=True):
        k = k_desc.load([n0, 0])  # [BLOCK_N, D], zeros past tile_end
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        v = v_desc.load([n0, 0])
        m_i, l_i, acc = _softmax_pv(s, v, n0, m_i, l_i, acc, lim, qk_scale, True, BLOCK_N,
                                    DOT_PRECISION)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    rows = (q_start + query).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    o_ptrs = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=(query < qlen)[:, None])
