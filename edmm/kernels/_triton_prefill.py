"""Triton flash-attention forward for prefill over the strided KV arena.

Imported only when a kernel runs: this module imports triton at the top.

Grid: (row tiles, query heads). A program holds BLOCK_M queries of one head and walks the KV
of that head's GQA group in BLOCK_N tiles with an online softmax (scores scaled inside the
exponent). With PACK_GQA the grid's second axis is the KV heads and a tile's rows are (query,
head) pairs of that KV head's GROUP query heads, so each KV tile is read once per group. In a
varlen batch the row tiles of all sequences are numbered in one flat range (sequence b owns
cdiv(rows_b, BLOCK_M) of them, in order, or last tile first with REVERSE) and each program finds
its sequence with a scan over the B query offsets: the grid, ``T * rows per query // BLOCK_M +
B`` tiles, depends only on the token and sequence counts, never on the lengths, so one CUDA
graph serves every batch of that shape; spare tiles (and sequences with no queries, the padding
of a graph) return at once. Causality is end-aligned: query i of a sequence with Lq queries and
n tokens sees keys < n - Lq + i + 1. Tiles every row of the program fully sees run without
masks (with USE_TMA, loaded by the copy engine); only the tiles at the diagonal are masked, and
no key at or past the context length is ever loaded.
"""

from __future__ import annotations

import triton
import triton.language as tl

NEG_INIT = tl.constexpr(-1.0e30)  # running-max start: finite, so inf - inf never happens


@triton.jit
def _load_tile(base, desc, slot, kvh, which, n0, n_end, stride_kt,
               MASKED: tl.constexpr, USE_TMA: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """K (``which`` 0) or V (1) of keys [n0, n0 + BLOCK_N): [BLOCK_N, D]. When MASKED, keys at
    or past ``n_end`` are not loaded (zeros); USE_TMA loads whole tiles by the copy engine."""
    if USE_TMA and not MASKED:
        x = desc.load([slot, n0, which, kvh, 0]).reshape(BLOCK_N, HEAD_DIM)
    else:
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
def _attend_range(q, kv, lo, hi, tile_end, m_i, l_i, acc, lim, qk_scale, MASKED: tl.constexpr,
                  USE_TMA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """The KV tiles from ``lo`` to ``hi`` (whole tiles below every row's limit, or MASKED the
    diagonal ones); ``kv``: (K base, V base, descriptor, slot, KV head, token stride)."""
    k_base, v_base, kv_desc, slot, kvh, stride_kt = kv
    for n0 in range(lo, hi, BLOCK_N):
        k = _load_tile(k_base, kv_desc, slot, kvh, 0, n0, tile_end, stride_kt, MASKED, USE_TMA,
                       HEAD_DIM, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        v = _load_tile(v_base, kv_desc, slot, kvh, 1, n0, tile_end, stride_kt, MASKED, USE_TMA,
                       HEAD_DIM, BLOCK_N)
        m_i, l_i, acc = _softmax_pv(s, v, n0, m_i, l_i, acc, lim, qk_scale, MASKED, BLOCK_N,
                                    DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _find_tile(cu_q_ptr, num_seqs, ROWS_PER_QUERY: tl.constexpr, BLOCK_M: tl.constexpr,
               SKIP_SINGLE: tl.constexpr, REVERSE: tl.constexpr):
    """Sequence and tile index within it of this program's flat tile (-1: a spare tile).
    With SKIP_SINGLE, sequences of one query own no tile; with REVERSE, a sequence's last
    tile (the most keys) comes first."""
    blk = tl.program_id(0)
    seen = blk * 0
    seq = blk * 0 - 1
    tile = blk * 0
    for i in range(0, num_seqs):
        n_q = (tl.load(cu_q_ptr + i + 1) - tl.load(cu_q_ptr + i)).to(tl.int32)
        if SKIP_SINGLE:
            n_q = tl.where(n_q == 1, 0, n_q)
        n_tiles = (n_q * ROWS_PER_QUERY + BLOCK_M - 1) // BLOCK_M
        hit = (blk >= seen) & (blk < seen + n_tiles)
        seq = tl.where(hit, i, seq)
        own = n_tiles - 1 - (blk - seen) if REVERSE else blk - seen
        tile = tl.where(hit, own, tile)
        seen += n_tiles
    return seq, tile


@triton.jit(do_not_specialize=["slot_arg", "ctx_arg", "qlen_arg", "num_seqs", "qk_scale"])
def prefill_kernel(
    q_ptr, kv_ptr, kv_desc, out_ptr, cu_q_ptr, slot_ids_ptr, ctx_lens_ptr,
    slot_arg, ctx_arg, qlen_arg,  # the one sequence's slot, tokens, queries when not VARLEN
    num_seqs,  # B when VARLEN
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh,  # q [T, Hq, D]
    stride_ks, stride_kt, stride_kkv, stride_kh,  # kv layer view [S, M, 2, Hkv, D]
    stride_ot, stride_oh,  # out [T, Hq, D]
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr, SKIP_SINGLE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, REVERSE: tl.constexpr, PACK_GQA: tl.constexpr,
):
    """One (query tile, query head) of end-aligned causal attention.

    ``kv_desc`` (USE_TMA): a tensor descriptor of the layer view with block [1, BLOCK_N, 1, 1,
    D]; it loads the whole tiles below every row's limit (never past the context), the
    diagonal tiles load through masked pointers.
    """
    R: tl.constexpr = GROUP if PACK_GQA else 1  # rows per query
    if VARLEN:
        b, mt = _find_tile(cu_q_ptr, num_seqs, R, BLOCK_M, SKIP_SINGLE, REVERSE)
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
        n_tiles = (qlen * R + BLOCK_M - 1) // BLOCK_M
        mt = n_tiles - 1 - tl.program_id(0) if REVERSE else tl.program_id(0)
    m0 = mt * BLOCK_M  # first row; a row is a (query, head) pair
    if m0 >= qlen * R or m0 < 0:
        return

    offs_r = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of this tile
    if PACK_GQA:  # rows: the GROUP heads of KV head program_id(1) for each query in turn
        kvh = tl.program_id(1)
        query = offs_r // GROUP  # [BLOCK_M] query index within the sequence
        head = kvh * GROUP + offs_r % GROUP  # [BLOCK_M]
        last_q = tl.minimum((m0 + BLOCK_M - 1) // GROUP, qlen - 1)
    else:  # rows: queries of head program_id(1)
        kvh = tl.program_id(1) // GROUP
        query = offs_r
        head = offs_r * 0 + tl.program_id(1)
        last_q = tl.minimum(m0 + BLOCK_M, qlen) - 1
    first_q = m0 // R
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_r < qlen * R
    rows = (q_start + query).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None], other=0.0)  # [BLOCK_M, D]

    k_base = kv_ptr + slot.to(tl.int64) * stride_ks + kvh * stride_kh
    v_base = k_base + stride_kkv
    m_i = tl.full([BLOCK_M], NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_end = (ctx - qlen + first_q + 1) // BLOCK_N * BLOCK_N  # keys all rows see, whole tiles
    tile_end = ctx - qlen + last_q + 1  # keys the last row sees, <= ctx
    lim = tl.minimum(ctx - qlen + query + 1, tile_end)  # [BLOCK_M] keys each row sees
    kv = (k_base, v_base, kv_desc, slot, kvh, stride_kt)
    m_i, l_i, acc = _attend_range(q, kv, 0, full_end, tile_end, m_i, l_i, acc, lim, qk_scale,
                                  False, USE_TMA, HEAD_DIM, BLOCK_N, DOT_PRECISION)
    m_i, l_i, acc = _attend_range(q, kv, full_end, tile_end, tile_end, m_i, l_i, acc, lim,
                                  qk_scale, True, USE_TMA, HEAD_DIM, BLOCK_N, DOT_PRECISION)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "qk_scale"])
def prefill_ws_kernel(
    q_ptr, kv_ptr, out_ptr, cu_q_ptr, slot_ids_ptr, ctx_lens_ptr,
    num_seqs, num_tokens,  # B; T, the rows of q
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
    b, mt = _find_tile(cu_q_ptr, num_seqs, 1, BLOCK_M, SKIP_SINGLE, REVERSE)
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
