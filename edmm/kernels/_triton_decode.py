"""Triton kernels of split-K (flash-decoding) attention over the strided KV arena.

Imported only when a kernel runs: this module imports triton at the top.

Grid of the split kernel: (batch, kv_heads, splits). A program reads one chunk of one
sequence's tokens for one KV head, once, for all query heads of that head's GQA group (rows of
a [GROUP_PAD, D] query tile), and writes the normalised partial output and its log-sum-exp
(base 2). Then the splits are merged, in one of two ways:
- the reduce kernel, grid (batch, q_heads), a second launch;
- FUSED: the split kernel merges them itself. Each program counts itself done on an int32
  counter of its (sequence, KV head) in a workspace; the program that counts last merges the
  partials of the group's heads (in a fixed order: deterministic) and sets the counter back to
  0, so the workspace is zero again when the kernel ends (one zeroing at allocation;
  capturable in a CUDA graph, replayable).
With `DecodeConfig.sliced_reduce` the reduce kernel's grid also splits the head dim: grid
(batch, q_heads, slices), each program merging BLOCK_D columns, so its loads spread over more
SMs. With one split the split kernel writes the final output itself and nothing merges. With
VARLEN, q and out are a packed [T, Hq, D] batch: sequence b's query is row cu_q[b], and
sequences with other than exactly one query are skipped (the prefill kernel computes those).

FP8: the cache holds scaled e4m3 (`edmm.model.kv_quant`). Tiles are converted to q's dtype
after the load (exact: every e4m3 value is a bf16 / fp16 one); a program's KV head has one K
and one V scale, so the K scale multiplies the softmax scale of its scores and the V scale
its normalised output, and nothing dequantised is ever written.

BALANCED: each split of a sequence gets an equal share of its tokens (within one), not a
multiple of BLOCK_N, so split counts that are no power of two (a multiple of the SM count)
keep every split busy; the last tile of each chunk is masked.

TMA (Hopper and later): the full tiles of a chunk are loaded through a host-built tensor
descriptor of the layer's token rows (each row the K and V of every KV head, contiguous), the
masked last tile by pointer loads: the descriptor spans every token of the slot, and tokens
past the context may be unmapped, so no TMA box ever reaches past ``end``.

PDL (Hopper and later; not in the interpreter, which has no inline assembly): the kernels are
launched with programmatic dependent launch, so a kernel's programs start while the kernel
before it drains. Before ``gdc_wait`` a program reads only the batch metadata (cu_q,
slot_ids, context_lens), which the engine writes before the step, never a kernel just before;
q, the KV cache and every write come after it.

EARLY (with PDL): a program lets the next kernel launch first thing, not after its own
``gdc_wait``, so the next kernel's programs take SM slots as soon as this kernel's free them
and read their metadata (and prefetch) while this kernel and the one before it finish. The
next kernel still waits for this one's end before it reads anything this one writes. (A
launch whose programs fit more than the grid's share per SM lets early programs take the
spare slots and unbalances the SMs: the sweep measures which launches gain.)

PREFETCH (same conditions): before anything else reads the cache, a program asks L2 for every
128-byte line of its chunk's K and V (``prefetch.global.L2``: no registers, no wait), or of its
first PREFETCH_TOKENS tokens only, so those bytes are requested at once rather than a few tiles
ahead, and with PDL while the kernel before it still runs. It never prefetches a sequence's
last token, the one the kernel just before (RoPE + KV store) writes; the tiles themselves are
loaded after ``gdc_wait``. The invariant it needs: the kernel launched just before writes no
other KV of these sequences.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LINE_BYTES = tl.constexpr(128)  # L2 line one prefetch asks for

NEG_INIT = tl.constexpr(-1.0e30)  # running-max start: finite, so never inf - inf
MERGE_UNROLL = tl.constexpr(4)  # fused merge steps unrolled: their loads in flight together


@triton.jit
def _query_row(cu_q_ptr, b, VARLEN: tl.constexpr):
    """Row of q / out of sequence ``b``: ``b``, or with VARLEN its query offset; -1 when a
    VARLEN sequence has not exactly one query (another kernel computes it)."""
    if VARLEN:
        start = tl.load(cu_q_ptr + b).to(tl.int32)
        single = tl.load(cu_q_ptr + b + 1).to(tl.int32) - start == 1
        return tl.where(single, start, -1)
    return b.to(tl.int32)


@triton.jit(do_not_specialize=["num_splits", "qk_scale"])
def decode_split_kernel(
    q_ptr, kv_ptr, slot_ids_ptr, ctx_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, cu_q_ptr,
    kv_desc,  # TMA: descriptor of the layer view as [S, M, 2 * Hkv * D], box [1, BLOCK_N, D]
    count_ptr,  # FUSED: int32 [B * Hkv] counters, zero on entry and on exit
    kv_scale_ptr,  # FP8: float32 [2, Hkv], the layer's K then V scales
    num_splits,  # a runtime value: no recompile per batch size
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh,  # q [B, Hq, D]
    stride_ks, stride_kt, stride_kkv, stride_kh,  # kv layer view [S, M, 2, Hkv, D]
    stride_ob, stride_oh,  # out [B, Hq, D]
    stride_pb, stride_ph, stride_ps,  # part_o [B, Hq, num_splits, D]
    stride_lb, stride_lh,  # part_lse [B, Hq, num_splits]
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    VARLEN: tl.constexpr, FUSED: tl.constexpr, MERGE_G: tl.constexpr, MERGE_S: tl.constexpr,
    LSE_S: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, PREFETCH: tl.constexpr,
    PREFETCH_TOKENS: tl.constexpr, ELEM_BYTES: tl.constexpr, BALANCED: tl.constexpr,
    TMA: tl.constexpr, FP8: tl.constexpr,
):
    """One (sequence, KV head, split): attention of the group's queries over its token chunk;
    with FUSED, the last split of a (sequence, KV head) to finish merges them all."""
    if PDL and EARLY:  # the next kernel may launch now; it still waits for this one's end
        gdc_launch_dependents()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row_q = _query_row(cu_q_ptr, b, VARLEN)
    slot = tl.load(slot_ids_ptr + b).to(tl.int64)
    ctx = tl.load(ctx_lens_ptr + b).to(tl.int32)
    # Per-sequence chunking: every split of this sequence gets a multiple of BLOCK_N tokens,
    # or with BALANCED an equal share (within one token), its last tile masked.
    chunk = tl.cdiv(ctx, num_splits)
    if not BALANCED:
        chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)  # never past the context: beyond it is unmapped
    k_base = kv_ptr + slot * stride_ks + kvh * stride_kh
    v_base = k_base + stride_kkv
    if PREFETCH:  # all but the last token (the kernel before writes it); none if skipped
        last = tl.where(row_q >= 0, tl.minimum(end, ctx - 1), start)
        if PREFETCH_TOKENS > 0:  # only the chunk's first tiles
            last = tl.minimum(last, start + PREFETCH_TOKENS)
        _prefetch_l2(k_base, v_base, start, last, stride_kt, HEAD_DIM, ELEM_BYTES)
    if PDL:  # every program waits, so the launch never ends before the kernel before it
        gdc_wait()  # q and the KV cache are written by the kernels before this one
        if not EARLY:
            gdc_launch_dependents()
    if row_q < 0:
        return

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # [GROUP_PAD] query heads of this KV head
    q_ptrs = q_ptr + row_q.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None], other=0.0)  # [GROUP_PAD, D]
    v_scale = 1.0
    if FP8:  # the head's K scale into the scores' scale, its V scale onto the output
        qk_scale = qk_scale * tl.load(kv_scale_ptr + kvh)
        v_scale = tl.load(kv_scale_ptr + tl.num_programs(1) + kvh)

    m_i = tl.full([GROUP_PAD], NEG_INIT, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    tail = start  # first token of the masked tiles: all of them without TMA
    if TMA:  # the chunk's full tiles by TMA (never past ``end``: beyond ctx is unmapped)
        tail = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        k_col = kvh * stride_kh
        for n0 in range(start, tail, BLOCK_N):
            k = kv_desc.load([slot.to(tl.int32), n0, k_col]).reshape(BLOCK_N, HEAD_DIM)
            v = kv_desc.load([slot.to(tl.int32), n0, k_col + stride_kkv]).reshape(BLOCK_N,
                                                                                  HEAD_DIM)
            k, v = k.to(q.dtype), v.to(q.dtype)  # no-ops unless the cache is FP8
            m_i, l_i, acc = _attend_tile(q, k, v, offs_n < BLOCK_N, m_i, l_i, acc, qk_scale,
                                         DOT_PRECISION)
    for n0 in range(tail, end, BLOCK_N):
        offs = n0 + offs_n  # [BLOCK_N] token indices
        n_mask = offs < end
        tok = offs.to(tl.int64)[:, None] * stride_kt + offs_d[None, :]
        k = tl.load(k_base + tok, mask=n_mask[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_base + tok, mask=n_mask[:, None], other=0.0)  # [BLOCK_N, D]
        k, v = k.to(q.dtype), v.to(q.dtype)  # no-ops unless the cache is FP8
        m_i, l_i, acc = _attend_tile(q, k, v, n_mask, m_i, l_i, acc, qk_scale, DOT_PRECISION)

    has = l_i > 0.0  # False for an empty split (or an empty context)
    o = acc * (v_scale / tl.where(has, l_i, 1.0))[:, None]  # [GROUP_PAD, D]
    if SINGLE_SPLIT:
        o_ptrs = (out_ptr + row_q.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
                  + offs_d[None, :])
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        row = b.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps  # [GROUP_PAD]
        tl.store(part_o_ptr + row[:, None] + offs_d[None, :], o, mask=g_mask[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        lse_ptrs = part_lse_ptr + b * stride_lb + heads * stride_lh + split
        tl.store(lse_ptrs, lse, mask=g_mask)
        if FUSED:
            count = count_ptr + b * tl.num_programs(1) + kvh
            tl.debug_barrier()  # every thread's partial stores before the release below
            if tl.atomic_add(count, 1, sem="acq_rel") == num_splits - 1:
                tl.debug_barrier()  # the acquire above before any thread's partial loads
                tl.store(count, 0)  # zero again for the next launch
                _merge(part_o_ptr, part_lse_ptr, out_ptr, b, row_q, kvh * GROUP, num_splits,
                       stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob,
                       stride_oh, GROUP, MERGE_G, MERGE_S, LSE_S, HEAD_DIM)


@triton.jit
def _attend_tile(q, k, v, n_mask, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One tile of online softmax: the running max ``m_i`` and sum ``l_i`` [GROUP_PAD] and
    output ``acc`` [GROUP_PAD, D] of queries ``q`` [GROUP_PAD, D] after keys ``k`` and values
    ``v`` [BLOCK_N, D] (tokens where ``n_mask`` [BLOCK_N] is False count for nothing)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(n_mask[None, :], s, float("-inf"))  # [GROUP_PAD, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefetch_l2(k_base, v_base, lo, hi, stride_kt, HEAD_DIM: tl.constexpr,
                 ELEM_BYTES: tl.constexpr):
    """Ask L2 for the K and V lines of tokens lo .. hi - 1 (one head's row each). Lanes past
    ``hi`` repeat token ``lo``'s lines (the instruction has no masked form)."""
    LINE_ELEMS: tl.constexpr = LINE_BYTES // ELEM_BYTES
    LINES: tl.constexpr = (HEAD_DIM + LINE_ELEMS - 1) // LINE_ELEMS
    TOKENS: tl.constexpr = 64
    offs_t = tl.arange(0, TOKENS)
    first = (tl.arange(0, LINES) * LINE_ELEMS).to(tl.int64)  # [LINES] first element of a line
    for t0 in range(lo, hi, TOKENS):
        tok = t0 + offs_t
        tok = tl.where(tok < hi, tok, lo).to(tl.int64)  # [TOKENS]
        at = tok[:, None] * stride_kt + first[None, :]  # [TOKENS, LINES]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [k_base + at],
                                  dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [v_base + at],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _merge(part_o_ptr, part_lse_ptr, out_ptr, b, row_q, head0, num_splits,
           stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
           GROUP: tl.constexpr, MERGE_G: tl.constexpr, MERGE_S: tl.constexpr,
           LSE_S: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Merge the splits of query heads head0 .. head0 + GROUP - 1 of sequence ``b`` into
    out row ``row_q``, in a fixed order (deterministic).

    First the largest log-sum-exp of each head (LSE_S splits at a time: one step for up to
    LSE_S splits), then the partial outputs MERGE_S splits at a time, weighted by
    2^(lse - max): no rescaling between steps, so the steps' loads do not wait on each other
    and the unrolled loop keeps several in flight. Partials are read from L2 (``.cg``):
    other programs wrote them."""
    offs_g = tl.arange(0, MERGE_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = head0 + offs_g  # [MERGE_G]
    lse_base = part_lse_ptr + b.to(tl.int64) * stride_lb + heads[:, None] * stride_lh
    m = tl.full([MERGE_G], NEG_INIT, tl.float32)  # finite: all-empty heads give weights 0
    offs_l = tl.arange(0, LSE_S)
    for s0 in range(0, num_splits, LSE_S):
        s = s0 + offs_l  # [LSE_S]
        lse = tl.load(lse_base + s[None, :], mask=g_mask[:, None] & (s < num_splits)[None, :],
                      other=float("-inf"), cache_modifier=".cg")  # [MERGE_G, LSE_S]
        m = tl.maximum(m, tl.max(lse, 1))
    offs_s = tl.arange(0, MERGE_S)
    o_base = (part_o_ptr + b.to(tl.int64) * stride_pb + heads[:, None, None] * stride_ph
              + offs_d[None, None, :])
    den = tl.zeros([MERGE_G], tl.float32)
    acc = tl.zeros([MERGE_G, HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, MERGE_S * MERGE_UNROLL):
        for u in tl.static_range(MERGE_UNROLL):  # unrolled: independent loads, all in flight
            s = s0 + u * MERGE_S + offs_s  # [MERGE_S]
            mask = g_mask[:, None] & (s < num_splits)[None, :]  # [MERGE_G, MERGE_S]
            lse = tl.load(lse_base + s[None, :], mask=mask, other=float("-inf"),
                          cache_modifier=".cg")  # [MERGE_G, MERGE_S]
            o = tl.load(o_base + s[None, :, None] * stride_ps, mask=mask[:, :, None],
                        other=0.0, cache_modifier=".cg")  # [MERGE_G, MERGE_S, D]
            w = tl.exp2(lse - m[:, None])  # 0 for empty splits (lse -inf)
            den += tl.sum(w, 1)
            acc += tl.sum(w[:, :, None] * o, 1)
    # den >= 1 (the largest split weighs 1) unless every split is empty: then acc = 0, zeros.
    # (One use of each loop result: Triton's thread-locality pass asserts on more.)
    res = acc / tl.maximum(den, 1.0)[:, None]
    o_ptrs = out_ptr + row_q.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, cu_q_ptr,
    num_splits,
    stride_pb, stride_ph, stride_ps,  # part_o [B, Hq, num_splits, D]
    stride_lb, stride_lh,  # part_lse [B, Hq, num_splits]
    stride_ob, stride_oh,  # out [B, Hq, D]
    SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    """One (sequence, query head, head-dim slice of BLOCK_D columns): merge the splits'
    partial outputs by their log-sum-exp."""
    row_q = _query_row(cu_q_ptr, tl.program_id(0), VARLEN)  # int32
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if PDL:  # every program waits, so the launch never ends before the split kernel
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()  # the split kernel's partials
        if not EARLY:
            gdc_launch_dependents()
    if row_q < 0:
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))  # [SPLITS_PAD]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights 0, output 0
    w = tl.exp2(lse - m)  # [SPLITS_PAD]
    o_ptrs = part_o_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
    o = tl.load(o_ptrs + offs_d[None, :], mask=s_mask[:, None], other=0.0)  # [SPLITS_PAD, BLOCK_D]
    denom = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0.0, denom, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + row_q.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             res.to(out_ptr.dtype.element_ty))
