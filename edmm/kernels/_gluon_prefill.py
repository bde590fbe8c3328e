"""Prefill attention for Hopper in Gluon: warp-specialized, asynchronous wgmma.

Imported only when a kernel runs on an sm_90 GPU: this module imports triton's Gluon at the top.

The same work as `_triton_prefill.prefill_kernel` (end-aligned causal attention of a varlen
batch over the strided KV arena, a flat range of query tiles, tiles of one query sequences
skipped for the split-K decode kernel), written at the level Triton's compiler does not reach
on Hopper, after FlashAttention-3: one loader warp streams the whole KV tiles below every row's
limit by TMA into a shared-memory ring (a ready and an empty mbarrier per stage), while the
compute warps issue the scores of tile j + 1 to the tensor cores (``wgmma``, async) before
the softmax of tile j and let P @ V of tile j run into the next softmax. The tiles at the
diagonal load through masked pointers in the compute warps, so no key at or past the context
is ever read.

Layouts: 8 warps tile the BLOCK_M = 128 rows (16 each, two warpgroups); S [BLOCK_M, BLOCK_N]
and O [BLOCK_M, D] are wgmma accumulators whose rows sit on the same threads, so the row
statistics move between them without shuffles; P feeds the second product from registers.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

NEG_INIT = gl.constexpr(-1.0e30)  # running-max start: finite, so inf - inf never happens


@gluon.jit
def _find_tile(cu_q_ptr, num_seqs, BLOCK_M: gl.constexpr, SKIP_SINGLE: gl.constexpr):
    """Sequence and tile index within it of this program's flat tile (-1: a spare tile),
    the sequence's last tile first."""
    blk = gl.program_id(0)
    seen = blk * 0
    seq = blk * 0 - 1
    tile = blk * 0
    for i in range(0, num_seqs):
        n_q = (gl.load(cu_q_ptr + i + 1) - gl.load(cu_q_ptr + i)).to(gl.int32)
        if SKIP_SINGLE:
            n_q = gl.where(n_q == 1, 0, n_q)
        n_tiles = (n_q + BLOCK_M - 1) // BLOCK_M
        hit = (blk >= seen) & (blk < seen + n_tiles)
        seq = gl.where(hit, i, seq)
        tile = gl.where(hit, n_tiles - 1 - (blk - seen), tile)
        seen += n_tiles
    return seq, tile


@gluon.jit
def _loader(kv_desc, k_ring, v_ring, ready, empty, slot, kvh, n_full, BLOCK_N: gl.constexpr):
    """Worker partition (one warp): TMA of K and V tiles 0 .. n_full - 1 into the ring."""
    stages: gl.constexpr = k_ring.type.shape[0]
    for t in range(n_full):
        st = t % stages
        mbarrier.wait(empty.index(st), ((t // stages) & 1) ^ 1)  # the first lap passes
        bar = ready.index(st)
        mbarrier.expect(bar, 2 * kv_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kv_desc, [slot, t * BLOCK_N, 0, kvh, 0], bar,
                                        k_ring.index(st))
        tma.async_copy_global_to_shared(kv_desc, [slot, t * BLOCK_N, 1, kvh, 0], bar,
                                        v_ring.index(st))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """Online softmax of unscaled scores s: (p, new max, new sum, rescale of the old)."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _compute(q_smem, k_ring, v_ring, ready, empty, kv_ptr, out_ptr, q_start, qlen, slot, kvh, h,
             ctx, m0, n_full, qk_scale, stride_ks, stride_kt, stride_kkv, stride_kh,
             stride_ot, stride_oh, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """Default partition: the attention of the tile (see the module doc), then its output."""
    dtype: gl.constexpr = q_smem.dtype
    stages: gl.constexpr = k_ring.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)

    rows_s = m0 + gl.arange(0, BLOCK_M, layout=row_s)  # [BLOCK_M] query index
    tile_end = ctx - qlen + gl.minimum(m0 + BLOCK_M, qlen)  # keys the last row sees
    lim = gl.minimum(ctx - qlen + rows_s + 1, tile_end)  # [BLOCK_M] keys each row sees
    m_i = gl.full([BLOCK_M], NEG_INIT, gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout))
    s_next = warpgroup_mma_init(s_zero)

    # Whole tiles: S_{j+1} in flight during softmax_j, PV_j into softmax_{j+1}.
    if n_full > 0:
        mbarrier.wait(ready.index(0), 0)
        k0 = k_ring.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
        s_next = warpgroup_mma(q_smem, k0, s_zero, use_acc=False, is_async=True)
    for j in range(0, n_full):
        st = j % stages
        if j == 0:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
        else:  # in flight: S_j, then PV_{j-1}; this leaves PV_{j-1} running
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))
        if j + 1 < n_full:
            st1 = (j + 1) % stages
            mbarrier.wait(ready.index(st1), ((j + 1) // stages) & 1)
            k1 = k_ring.index(st1).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
            s_next = warpgroup_mma(q_smem, k1, s_zero, use_acc=False, is_async=True)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale)
        # PV_{j-1} must be done before acc is rescaled; then tile j - 1's stage is free.
        if j + 1 < n_full:
            o = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        else:
            o = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if j > 0:
            mbarrier.arrive(empty.index((j - 1) % stages), count=1)
        o = o * gl.convert_layout(alpha, row_o)[:, None]
        v = v_ring.index(st).reshape([BLOCK_N, HEAD_DIM])
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v, o, is_async=True)
    out = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    # Diagonal tiles: masked pointer loads, synchronous products.
    kd_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], tile_layout)
    vd_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], tile_layout)
    kv_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io_layout))
    io_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    k_base = kv_ptr + slot.to(gl.int64) * stride_ks + kvh * stride_kh
    cols_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    for n0 in range(n_full * BLOCK_N, tile_end, BLOCK_N):
        tok = n0 + kv_rows
        off = tok.to(gl.int64)[:, None] * stride_kt + io_cols[None, :]
        kv_mask = (tok < tile_end)[:, None]
        gl.thread_barrier()  # every warpgroup is done reading the previous tile
        kd_smem.store(gl.load(k_base + off, mask=kv_mask, other=0.0))
        vd_smem.store(gl.load(k_base + stride_kkv + off, mask=kv_mask, other=0.0))
        fence_async_shared()
        gl.thread_barrier()
        s = warpgroup_mma(q_smem, kd_smem.permute((1, 0)), s_zero, use_acc=False)
        s = gl.where((n0 + cols_s)[None, :] < lim[:, None], s, float("-inf"))
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale)
        out = out * gl.convert_layout(alpha, row_o)[:, None]
        out = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), vd_smem, out)

    l_o = gl.convert_layout(l_i, row_o)
    o_out = gl.convert_layout((out / gl.where(l_o > 0.0, l_o, 1.0)[:, None]).to(dtype),
                              io_layout)
    io_rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io_layout))
    o_off = ((q_start + io_rows).to(gl.int64)[:, None] * stride_ot + h * stride_oh
             + io_cols[None, :])
    gl.store(out_ptr + o_off, o_out, mask=(io_rows < qlen)[:, None])


@gluon.jit
def prefill_kernel_sm90(
    q_ptr, kv_ptr, kv_desc, out_ptr, cu_q_ptr, slot_ids_ptr, ctx_lens_ptr,
    num_seqs, qk_scale,
    stride_qt, stride_qh,  # q [T, Hq, D]
    stride_ks, stride_kt, stride_kkv, stride_kh,  # kv layer view [S, M, 2, Hkv, D]
    stride_ot, stride_oh,  # out [T, Hq, D]
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    SKIP_SINGLE: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """One (query tile, query head) of end-aligned causal attention (see the module doc).
    A spare tile of the flat range runs with no queries and no keys."""
    gl.static_assert(STAGES >= 3, "tiles j - 1, j and j + 1 are live at once")
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)

    h = gl.program_id(1)
    b, mt = _find_tile(cu_q_ptr, num_seqs, BLOCK_M, SKIP_SINGLE)
    valid = b >= 0
    b = gl.maximum(b, 0)
    q_start = gl.load(cu_q_ptr + b).to(gl.int32)
    qlen = gl.where(valid, gl.load(cu_q_ptr + b + 1).to(gl.int32) - q_start, 0)
    slot = gl.load(slot_ids_ptr + b).to(gl.int32)
    ctx = gl.load(ctx_lens_ptr + b).to(gl.int32)
    kvh = h // GROUP
    m0 = mt * BLOCK_M
    n_full = gl.where(valid, (ctx - qlen + m0 + 1) // BLOCK_N, 0)  # whole tiles all rows see

    io_rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io_layout))
    io_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    q_off = ((q_start + io_rows).to(gl.int64)[:, None] * stride_qt + h * stride_qh
             + io_cols[None, :])  # [BLOCK_M, D]
    q = gl.load(q_ptr + q_off, mask=(io_rows < qlen)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_smem_layout, q)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, 1, HEAD_DIM],
                                       kv_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, 1, HEAD_DIM],
                                       kv_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()

    gl.warp_specialize([
        (_compute, (q_smem, k_ring, v_ring, ready, empty, kv_ptr, out_ptr, q_start, qlen, slot,
                    kvh, h, ctx, m0, n_full, qk_scale, stride_ks, stride_kt, stride_kkv,
                    stride_kh, stride_ot, stride_oh, HEAD_DIM, BLOCK_M, BLOCK_N, num_warps)),
        (_loader, (kv_desc, k_ring, v_ring, ready, empty, slot, kvh, n_full, BLOCK_N)),
    ], [1], [24])
