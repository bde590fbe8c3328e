// Split-K decode attention over the strided KV arena, in CUDA C++ (compiled at run time by
// NVRTC; see _cuda_decode.py). Compile-time macros: GROUP (query heads per KV head, <= 16),
// HEAD_DIM (64 or 128), WARPS, STAGES, IS_BF16 (else fp16).
//
// One CTA per (split, KV head, sequence): grid (num_splits, Hkv, B). The split's tokens are
// taken in rounds of 16 * WARPS; in each round warp w owns tokens [16w, 16w + 16) and streams
// them through its own ring of STAGES shared-memory slots (cp.async, 16 bytes a lane), so no
// warp ever waits on another until the end. Each warp keeps its own online-softmax state:
//   S = Q K^T on tensor cores (mma m16n8k16: the GROUP query heads padded to 16 rows x 16
//   tokens), P = exp2(S - m) kept in registers as the A operand of O += P V.
// At the end the warps' states merge through shared memory, and the CTA writes the split's
// normalised output and base-2 log-sum-exp (the layout the Triton reduce kernel merges), or
// with one split the final output. With CLUSTER > 0 the grid's CLUSTER splits of a (KV head,
// sequence) form one thread-block cluster: each keeps its partial in shared memory, and the
// cluster merges them through distributed shared memory into the output (no partials in
// global memory, no reduce launch).
//
// Shared-memory tiles are rows of HEAD_DIM * 2 bytes; the 16-byte chunk c of row r lives at
// chunk c ^ (r & 7), so ldmatrix's eight row addresses always fall in distinct banks.

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define TOK_W 16                       // tokens per warp per round
#define ROW_BYTES (HEAD_DIM * 2)
#define CHUNKS (ROW_BYTES / 16)        // 16-byte chunks of one token's K (or V) row
#define SLICE_BYTES (TOK_W * ROW_BYTES)  // K (or V) of one warp's round
#define SLOT_BYTES (2 * SLICE_BYTES)
#define KSTEPS (HEAD_DIM / 16)         // mma k-steps over the head dim
#define DBLOCKS (HEAD_DIM / 8)         // mma n-blocks over the head dim
#define NEG_INIT (-1.0e30f)            // finite running-max start: never inf - inf
#define NEG_INF (-__int_as_float(0x7f800000))

#if IS_BF16
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}

// Byte offset of 16-byte chunk `ch` of tile row `row` (the swizzle above).
__device__ __forceinline__ u32 swizzled(int row, int ch) {
  return row * ROW_BYTES + ((ch ^ (row & 7)) << 4);
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
  // bytes 0: the 16 bytes are zero-filled and nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// c[4] += A[16x16] B[16x8]: a = 4 registers of A (row-major), b0/b1 of B (column-major)
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ u32 pack2(float lo, float hi) {  // lo in the low half
  u32 r;
#if IS_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

__device__ __forceinline__ u16 to16(float x) {
  u16 r;
#if IS_BF16
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(r) : "f"(x));
#else
  asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(r) : "f"(x));
#endif
  return r;
}

#ifndef CLUSTER
#define CLUSTER 0
#endif

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n"
               ::: "memory");
}

__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// The same shared-memory variable in CTA `rank` of the cluster, read through DSMEM.
__device__ __forceinline__ float load_remote(const float* local, u32 rank) {
  u32 remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote)
               : "r"(smem_addr(local)), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

__device__ __forceinline__ i64 load_index(const void* p, int i, bool wide) {
  return wide ? ((const i64*)p)[i] : (i64)((const int*)p)[i];
}

__device__ __forceinline__ float quad_max(float x) {  // over the 4 lanes of one mma row
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Issue the cp.async copies of one warp's round: K and V of tokens tok0 .. tok0 + 15 (those
// at or past `end` zero-filled, never read) into the slot at `slot` (shared address).
__device__ __forceinline__ void load_round(u32 slot, const u16* k_base, i64 s_kt, i64 s_kkv,
                                           int tok0, int end, int safe_tok, int lane) {
#pragma unroll
  for (int j = 0; j < TOK_W * CHUNKS / 32; ++j) {
    const int c = lane + 32 * j;
    const int row = c / CHUNKS, ch = c % CHUNKS;
    const int tok = tok0 + row;
    const bool ok = tok < end;
    const u16* src = k_base + (i64)(ok ? tok : safe_tok) * s_kt + ch * 8;
    const u32 off = swizzled(row, ch);
    cp_async16(slot + off, src, ok ? 16 : 0);
    cp_async16(slot + SLICE_BYTES + off, src + s_kkv, ok ? 16 : 0);
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
edmm_decode_split(const u16* __restrict__ q, const u16* __restrict__ kv,
                  const void* __restrict__ slot_ids, const void* __restrict__ ctx_lens,
                  const void* __restrict__ cu_q,  // nullptr unless varlen
                  int wide,  // bit 0: slot_ids int64, bit 1: ctx_lens, bit 2: cu_q
                  u16* __restrict__ out, float* __restrict__ part_o,
                  float* __restrict__ part_lse, int num_splits, float qk_scale,
                  i64 s_qb, i64 s_qh, i64 s_ks, i64 s_kt, i64 s_kkv, i64 s_kh, i64 s_ob,
                  i64 s_oh, i64 s_pb, i64 s_ph, i64 s_ps, i64 s_lb, i64 s_lh) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;  // mma row (query head) and column pair

  // Batch metadata first (written before the step, never by the kernel just before), then
  // wait for that kernel (programmatic dependent launch; a no-op without it).
  int row_q = b;
  if (cu_q != nullptr) {
    const i64 s0 = load_index(cu_q, b, wide & 4), s1 = load_index(cu_q, b + 1, wide & 4);
    row_q = s1 - s0 == 1 ? (int)s0 : -1;  // a sequence of other than one query: not ours
  }
  const i64 slot = load_index(slot_ids, b, wide & 1);
  const int ctx = (int)load_index(ctx_lens, b, wide & 2);
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  if (row_q < 0) return;

  const int TOK = TOK_W * WARPS;
  int chunk = (ctx + num_splits - 1) / num_splits;
  chunk = (chunk + TOK - 1) / TOK * TOK;
  const int start = split * chunk;
  const int end = min(start + chunk, ctx);  // never past the context: beyond it is unmapped
  const int rounds = end > start ? (end - start + TOK - 1) / TOK : 0;
  const u16* k_base = kv + slot * s_ks + kvh * s_kh;

  const u32 ring = smem_addr(smem) + warp * (STAGES * SLOT_BYTES);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {  // prologue: the first STAGES - 1 rounds
    if (s < rounds) load_round(ring + s * SLOT_BYTES, k_base, s_kt, s_kkv,
                               start + s * TOK + warp * TOK_W, end, start, lane);
    cp_async_commit();
  }

  // Query fragments (A operand, rows g and g + 8; heads past GROUP are zero).
  u32 qa[KSTEPS][4];
  const u16* q_row = q + (i64)row_q * s_qb + (i64)(kvh * GROUP) * s_qh;
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {
    const int d = ks * 16 + 2 * t;
    qa[ks][0] = g < GROUP ? *(const u32*)(q_row + g * s_qh + d) : 0u;
    qa[ks][1] = g + 8 < GROUP ? *(const u32*)(q_row + (g + 8) * s_qh + d) : 0u;
    qa[ks][2] = g < GROUP ? *(const u32*)(q_row + g * s_qh + d + 8) : 0u;
    qa[ks][3] = g + 8 < GROUP ? *(const u32*)(q_row + (g + 8) * s_qh + d + 8) : 0u;
  }

  float o[DBLOCKS][4];  // O rows g (0, 1) and g + 8 (2, 3), columns 8n + 2t, + 1
#pragma unroll
  for (int n = 0; n < DBLOCKS; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m0 = NEG_INIT, m1 = NEG_INIT, l0 = 0.f, l1 = 0.f;  // lane-partial sums l

  const int i8 = lane >> 3, r8 = lane & 7;  // ldmatrix: matrix and row this lane addresses
  for (int r = 0; r < rounds; ++r) {
    const int ahead = r + STAGES - 1;
    if (ahead < rounds) load_round(ring + (ahead % STAGES) * SLOT_BYTES, k_base, s_kt, s_kkv,
                                   start + ahead * TOK + warp * TOK_W, end, start, lane);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();  // round r's copies have landed
    __syncwarp();
    const u32 sk = ring + (r % STAGES) * SLOT_BYTES, sv = sk + SLICE_BYTES;

    float s[2][4];  // S of tokens 8nb + 2t, + 1 (rows g: 0, 1; g + 8: 2, 3)
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
      const int row = nb * 8 + r8;
#pragma unroll
      for (int kp = 0; kp < KSTEPS / 2; ++kp) {
        const int ch = kp * 4 + i8;  // chunks of k-steps 2kp (low, high) and 2kp + 1
        u32 b0, b1, b2, b3;
        ldsm_x4(sk + swizzled(row, ch), b0, b1, b2, b3);
        mma16816(s[nb], qa[2 * kp], b0, b1);
        mma16816(s[nb], qa[2 * kp + 1], b2, b3);
      }
    }
    const int tok0 = start + r * TOK + warp * TOK_W;
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool ok = tok0 + nb * 8 + 2 * t + (e & 1) < end;
        s[nb][e] = ok ? s[nb][e] * qk_scale : NEG_INF;
      }
    const float mn0 = fmaxf(m0, quad_max(fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]))));
    const float mn1 = fmaxf(m1, quad_max(fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]))));
    const float a0 = ex2(m0 - mn0), a1 = ex2(m1 - mn1);
    m0 = mn0;
    m1 = mn1;
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      s[nb][0] = ex2(s[nb][0] - mn0);
      s[nb][1] = ex2(s[nb][1] - mn0);
      s[nb][2] = ex2(s[nb][2] - mn1);
      s[nb][3] = ex2(s[nb][3] - mn1);
    }
    l0 = l0 * a0 + (s[0][0] + s[0][1] + s[1][0] + s[1][1]);
    l1 = l1 * a1 + (s[0][2] + s[0][3] + s[1][2] + s[1][3]);
    const u32 pa[4] = {pack2(s[0][0], s[0][1]), pack2(s[0][2], s[0][3]),
                       pack2(s[1][0], s[1][1]), pack2(s[1][2], s[1][3])};
#pragma unroll
    for (int dp = 0; dp < DBLOCKS / 2; ++dp) {
      o[2 * dp][0] *= a0; o[2 * dp][1] *= a0; o[2 * dp][2] *= a1; o[2 * dp][3] *= a1;
      o[2 * dp + 1][0] *= a0; o[2 * dp + 1][1] *= a0;
      o[2 * dp + 1][2] *= a1; o[2 * dp + 1][3] *= a1;
      const int row = (i8 & 1) * 8 + r8, ch = dp * 2 + (i8 >> 1);
      u32 b0, b1, b2, b3;
      ldsm_x4_t(sv + swizzled(row, ch), b0, b1, b2, b3);
      mma16816(o[2 * dp], pa, b0, b1);
      mma16816(o[2 * dp + 1], pa, b2, b3);
    }
    __syncwarp();  // every lane has read this slot before it is refilled
  }

  // Merge the warps' states through shared memory (the ring is free once all copies land).
  cp_async_wait<0>();
  __syncthreads();
  l0 = quad_sum(l0);
  l1 = quad_sum(l1);
  float* sm_o = (float*)smem;                      // [WARPS][16][HEAD_DIM]
  float* sm_ml = sm_o + WARPS * 16 * HEAD_DIM;     // [WARPS][16][2]: m, l
  float* row0 = sm_o + (warp * 16 + g) * HEAD_DIM;
  float* row1 = row0 + 8 * HEAD_DIM;
#pragma unroll
  for (int n = 0; n < DBLOCKS; ++n) {
    *(float2*)(row0 + n * 8 + 2 * t) = make_float2(o[n][0], o[n][1]);
    *(float2*)(row1 + n * 8 + 2 * t) = make_float2(o[n][2], o[n][3]);
  }
  if (t == 0) {
    sm_ml[(warp * 16 + g) * 2] = m0;
    sm_ml[(warp * 16 + g) * 2 + 1] = l0;
    sm_ml[(warp * 16 + g + 8) * 2] = m1;
    sm_ml[(warp * 16 + g + 8) * 2 + 1] = l1;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM; idx += WARPS * 32) {
    const int h = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float mx = NEG_INIT;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_ml[(w * 16 + h) * 2]);
    float den = 0.f, num = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float wt = ex2(sm_ml[(w * 16 + h) * 2] - mx);  // 0 for a warp with no tokens
      den += wt * sm_ml[(w * 16 + h) * 2 + 1];
      num += wt * sm_o[(w * 16 + h) * HEAD_DIM + d];
    }
    const float res = den > 0.f ? num / den : 0.f;
    const int head = kvh * GROUP + h;
#if CLUSTER
    float* sm_part = sm_ml + WARPS * 32;  // [GROUP][HEAD_DIM] this split's output
    float* sm_lse = sm_part + GROUP * HEAD_DIM;  // [GROUP]
    sm_part[idx] = res;
    if (d == 0) sm_lse[h] = den > 0.f ? mx + __log2f(den) : NEG_INF;
    continue;
#endif
    if (num_splits == 1) {
      out[(i64)row_q * s_ob + (i64)head * s_oh + d] = to16(res);
    } else {
      part_o[(i64)b * s_pb + (i64)head * s_ph + (i64)split * s_ps + d] = res;
      if (d == 0)
        part_lse[(i64)b * s_lb + (i64)head * s_lh + split] =
            den > 0.f ? mx + __log2f(den) : NEG_INF;
    }
  }
#if CLUSTER
  // Every split's partial is in its CTA's shared memory: the cluster's CTAs share the merge.
  cluster_sync();
  const float* sm_part = sm_ml + WARPS * 32;
  const float* sm_lse = sm_part + GROUP * HEAD_DIM;
  const int nt = WARPS * 32;
  for (int idx = (int)cluster_rank() * nt + threadIdx.x; idx < GROUP * HEAD_DIM;
       idx += CLUSTER * nt) {
    const int h = idx / HEAD_DIM;
    float lse[CLUSTER];
    float mx = NEG_INIT;
#pragma unroll
    for (int j = 0; j < CLUSTER; ++j) {
      lse[j] = load_remote(sm_lse + h, j);
      mx = fmaxf(mx, lse[j]);
    }
    float den = 0.f, num = 0.f;
#pragma unroll
    for (int j = 0; j < CLUSTER; ++j) {
      const float wt = ex2(lse[j] - mx);  // 0 for an empty split (lse -inf)
      den += wt;
      num += wt * load_remote(sm_part + idx, j);
    }
    out[(i64)row_q * s_ob + (i64)(kvh * GROUP + h) * s_oh + idx % HEAD_DIM] =
        to16(den > 0.f ? num / den : 0.f);
  }
  cluster_sync();  // no CTA leaves while another still reads its shared memory
#endif
}
