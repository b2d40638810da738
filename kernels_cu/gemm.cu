// Small-M block-scaled GEMMs for decode: y[m, n] = sum_k xq[m, k] sx[m, k/128] * W[n, k] sw(n, k),
// i.e. the reference's W8A8 / W4A8 linears (quant.act_quant_fp8 on the input, fp32 accumulation
// per scale block). Memory-bound: every weight byte is read once with 16-byte loads; the tensor
// cores (mma.sync m16n8k32 e4m3) keep the arithmetic off the critical path.
//
// Weight formats
//   FP8: e4m3 [N, K], E8M0 scales [N/128, K/128] (the checkpoint layout, used as is).
//   FP4: experts stacked [E, N, K/2], two e2m1 codes a byte (even element low), E8M0 scales
//        [E, N, K/32]; each 64-byte chunk of a row (128 elements) is pre-permuted by
//        dsuf.gpu.moe.permute_fp4 so that one 16-byte load gives a lane its words for all four
//        k-steps of the chunk: new[16t + 4i + b] = old[16i + 4t + b]; the bits of each word are
//        placed for a cheap conversion to e4m3 (fp4_e4m3: two byte permutes of a table). The
//        rows come in tiles of 128 (dsuf.gpu.moe.fp4_kernel_layout): chunk c of a tile's rows is
//        8 KB at c * 8 KB, a row's 64 bytes at 64 * (row % 128), so a warp's 16 rows of a chunk are
//        one 1 KB run.
//
// mma.m16n8k32 fragments (PTX ISA), lane = 4g + t: A (16x32, row) a0 = row g, k 4t..4t+3;
// a1 = row g+8, same k; a2/a3 = the same rows at k 16+4t..; B (32x8, col) b0 = column g,
// k 4t..4t+3; b1 = k 16+4t..; D: d0, d1 = row g, columns 2t, 2t+1; d2, d3 = row g+8. The k order
// inside one mma is free as long as A and B agree, so each lane feeds bytes it loaded itself.
//
// Work split: grid.x = 128-row block of N (8 warps x 16 rows), grid.y = mat * splits + split
// (mat 1 is the SwiGLU "up" matrix), grid.z = item (an expert/token pair, or 0). Each CTA reduces
// its K range; with several CTAs per output tile the partials go to global memory and the last CTA
// to arrive (atomic counter) sums them in split order, so results are deterministic.
#include "fp4.cuh"

struct GemmParams {
  const u8* w[2];         // weights of mat 0 (or the gate) and mat 1 (the up projection)
  const u8* ws[2];        // their E8M0 scales
  const int* expert;      // FP4: [pairs] expert of each (token, expert) pair
  const int* order;       // FP4: [pairs] pair indices sorted by expert, or null (as given)
  const u8* xq;           // [rows, K] e4m3 activations
  const float* sx;        // [rows, K/128] activation scales
  const float* route_w;   // FP4: [pairs] weight multiplied into the SwiGLU output, or null (= 1)
  void* out;              // STORE: bf16 [rows_out, N]; SWIGLU: e4m3 [rows_out, N]
  float* out_scale;       // SWIGLU: [rows_out, N/128] scales of `out`
  float* partial;         // split-K partials [items, N/128, mats, splits, 8 * MT, 128]
  int* counter;           // [items, N/128] arrivals; zero between launches (the last CTA resets)
  int N, K, cols, splits; // cols: FP8 tokens (<= 8 * MT); FP4: 1 = every pair a column of its own, 0 = find runs
  int x_div;              // FP4: pair p reads activation row p / x_div (top-k for w1/w3, 1 for w2)
  float limit;            // SwiGLU clamp (<= 0: none)
};

enum { FMT_FP8 = 0, FMT_FP4 = 1 };
enum { EPI_STORE_BF16 = 0, EPI_SWIGLU = 1 };


// Where a lane's activation columns live: xb[j] = row of column j*8 + g (its B fragment),
// xa[j] / xa1[j] = rows of columns j*8 + 2t and j*8 + 2t + 1 (its accumulators); -1: no column.
template <int MT>
struct Cols {
  int xb[MT], xa[MT], xa1[MT];
};

// The FP8 tile's activations for wgmma (WG): K blocks [kb0, kb1) of the CTA's columns as B,
// FP8_WG_STEP bytes a (K block, mma i of mma_e4m3_kblock): two core matrices (logical k 0-15,
// 16-31) of the 8 columns' 16 bytes, zeros past `cols`; then visible to the tensor cores.
#define FP8_WG_STEP 256
#define FP8_WG_MAX_KB 16  // K blocks a CTA of the WG variant covers at most (the host splits K so)
#define GEMM_THREADS 256

// A thread's elements are e = thread + 256 r; all of its loads are issued before its first store
// (a loop of load-then-store would wait out one L2 round trip a round).
DSUF_DEVICE void fp8_stage_x_wg(const GemmParams& p, const int* col_xrow, int cols, int kb0, int kb1, u8* xs) {
  constexpr int ROUNDS = FP8_WG_MAX_KB * 4 * 32 / GEMM_THREADS;
  const int K = p.K, t = threadIdx.x & 3, m = (threadIdx.x >> 2) & 7, n = (kb1 - kb0) * 4 * 32;
  const u8* xrow = m < cols ? p.xq + (i64)col_xrow[m] * K + 16 * t : nullptr;
  uint2 v[ROUNDS];
#pragma unroll
  for (int r = 0; r < ROUNDS; ++r) {
    const int e = threadIdx.x + r * GEMM_THREADS, ki = e >> 5, kb = kb0 + (ki >> 2), i = ki & 3;
    v[r] = make_uint2(0, 0);
    if (xrow && e < n) v[r] = ld_nc8(xrow + kb * 128 + 64 * (i >> 1) + 8 * (i & 1));
  }
#pragma unroll
  for (int r = 0; r < ROUNDS; ++r) {
    const int e = threadIdx.x + r * GEMM_THREADS, ki = e >> 5;
    if (e >= n) break;
    u8* at = xs + ki * FP8_WG_STEP + m * 16 + 4 * t;  // bytes 0-3: logical k 4t.., 4-7: 16 + 4t..
    *reinterpret_cast<u32*>(at) = v[r].x;
    *reinterpret_cast<u32*>(at + 128) = v[r].y;
  }
  fence_proxy_async_smem();
}

// One pipeline stage of the FP8 tile: U K-blocks of 16 weight rows and the matching activations.
template <int MT, int U>
struct Fp8Stage {
  uint4 w[U][4], x[U][MT][2];
  float sa[U][MT], sb[U][MT];
};

template <int MT, int U, bool WG = false>
DSUF_DEVICE void fp8_load(Fp8Stage<MT, U>& st, const GemmParams& p, const u8* wa, const Cols<MT>& c, int kb, int kb1) {
  const int t = threadIdx.x & 3, K = p.K, KB = K >> 7;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (kb + u >= kb1) break;
    const i64 off = (i64)(kb + u) * 128;
    st.w[u][0] = ld_stream(wa + off);
    st.w[u][1] = ld_stream(wa + off + 64);
    st.w[u][2] = ld_stream(wa + 8 * (i64)K + off);
    st.w[u][3] = ld_stream(wa + 8 * (i64)K + off + 64);
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      st.x[u][j][0] = st.x[u][j][1] = make_uint4(0, 0, 0, 0);
      if (!WG && c.xb[j] >= 0) {  // (WG: the activations are in shared memory)
        const u8* xp = p.xq + (i64)c.xb[j] * K + off + 16 * t;
        st.x[u][j][0] = ld_nc16(xp);
        st.x[u][j][1] = ld_nc16(xp + 64);
      }
      st.sa[u][j] = c.xa[j] >= 0 ? p.sx[(i64)c.xa[j] * KB + kb + u] : 0.0f;
      st.sb[u][j] = c.xa1[j] >= 0 ? p.sx[(i64)c.xa1[j] * KB + kb + u] : 0.0f;
    }
  }
}

// desc0 (WG, MT = 1): the descriptor of the staged activations' K block kb0 (fp8_stage_x_wg).
template <int MT, int U, bool WG = false>
DSUF_DEVICE void fp8_compute(const Fp8Stage<MT, U>& st, const u8* ws_row, int kb, int kb1, float acc[MT][4], int kb0 = 0, u64 desc0 = 0) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (kb + u >= kb1) break;
    const float sw = e8m0_to_f32(ws_row[kb + u]);
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (WG) {
        uint4 w[4] = {st.w[u][0], st.w[u][1], st.w[u][2], st.w[u][3]};
        const u64 desc = desc0 + (u64)((kb + u - kb0) * 4 * (FP8_WG_STEP >> 4));
        wgmma_fence();
        wgmma_e4m3<false>(d, w[0].x, w[2].x, w[0].y, w[2].y, desc);
        wgmma_e4m3<true>(d, w[0].z, w[2].z, w[0].w, w[2].w, desc + (FP8_WG_STEP >> 4));
        wgmma_e4m3<true>(d, w[1].x, w[3].x, w[1].y, w[3].y, desc + 2 * (FP8_WG_STEP >> 4));
        wgmma_e4m3<true>(d, w[1].z, w[3].z, w[1].w, w[3].w, desc + 3 * (FP8_WG_STEP >> 4));
        wgmma_wait();
        pin(d), pin(w[0]), pin(w[1]), pin(w[2]), pin(w[3]);
      } else {
        mma_e4m3_kblock(d, st.w[u], st.x[u][j]);
      }
      const float s0 = sw * st.sa[u][j], s1 = sw * st.sb[u][j];
      acc[j][0] += d[0] * s0;
      acc[j][1] += d[1] * s1;
      acc[j][2] += d[2] * s0;
      acc[j][3] += d[3] * s1;
    }
  }
}

// FP8 weights: warp rows [row0, row0 + 16), K blocks [kb0, kb1); two register stages so that
// one stage's loads are in flight while the other's are multiplied. WG (MT = 1, sm_90a): the
// products by wgmma, a warpgroup's 64 rows at a time, the activations staged first into xs as its
// B (fp8_stage_x_wg).
template <int MT, bool WG = false>
DSUF_DEVICE void fp8_tile(const GemmParams& p, const u8* w, const u8* ws_row, int row0, int kb0, int kb1,
                          const Cols<MT>& c, float acc[MT][4], u8* xs = nullptr, const int* col_xrow = nullptr, int cols = 0) {
  constexpr int U = 1;  // K blocks a stage (2 spill at MT = 1 under the 128-register cap)
  const int lane = threadIdx.x & 31;
  const u8* wa = w + (i64)(row0 + (lane >> 2)) * p.K + 16 * (lane & 3);
  Fp8Stage<MT, U> a, b;
  fp8_load<MT, U, WG>(a, p, wa, c, kb0, kb1);  // weights in flight while the activations are staged
  u64 desc0 = 0;
  if (WG) {
    fp8_stage_x_wg(p, col_xrow, cols, kb0, kb1, xs);
    __syncthreads();
    desc0 = wgmma_desc(xs, 128, FP8_WG_STEP);
  }
  for (int kb = kb0; kb < kb1; kb += 2 * U) {
    if (kb + U < kb1) fp8_load<MT, U, WG>(b, p, wa, c, kb + U, kb1);
    fp8_compute<MT, U, WG>(a, ws_row, kb, kb1, acc, kb0, desc0);
    if (kb + 2 * U < kb1) fp8_load<MT, U, WG>(a, p, wa, c, kb + 2 * U, kb1);
    if (kb + U < kb1) fp8_compute<MT, U, WG>(b, ws_row, kb + U, kb1, acc, kb0, desc0);
  }
}

// FP4 weights (permuted chunks, per-32 scales): warp rows [row0, row0 + 16), 128-element chunks
// [kc0, kc1), double-buffered like fp8_tile; a fresh mma per 32-element k-step, since every step
// has its own weight scale. The CTA first copies its K range of every column's activations into
// shared memory, already in B-fragment order and converted to f16 once for all warps
// (xs[step * 32 + lane] = {b0, b1} of that lane for that k-step in mma_e4m3_f16b's form; zeros
// for absent columns), with their scales times 64 (xsc[chunk * 8 + column]),
// so the loop's only global loads are the weights and their scales: 20 registers a stage at
// U = 2 (40 with the activations in registers), 3-4 CTAs an SM instead of 2. A CTA covers at most
// FP4_MAX_CHUNKS chunks (the host picks enough splits). With a single column (batch 1) only the
// column-0 accumulators are updated. Same products and per-split summation order as with the
// activations in registers; only the split count moves (more CTAs an SM), which can move a rare
// bf16 rounding (H200: outputs equal to the old kernel's at batch 1 and 8). Batch-1 MoE
// 73.9 -> 60 µs, batch 8 188 -> 164 (the old path had 2 CTAs of 128 registers an SM).
#define FP4_MAX_CHUNKS 16

template <int U>
struct Fp4WStage {
  uint4 w[U][2];
  u32 s[U][2];
};

#define FP4_TILE_CHUNK_BYTES (128 * 64)  // a 128-row tile's chunk in the kernel layout

// wa: the lane's row g (its 16 bytes of chunk 0); row g + 8 is 8 rows on in the same tile.
template <int U>
DSUF_DEVICE void fp4_load_w(Fp4WStage<U>& st, const u8* wa, const u8* sa, int K, int kc, int kc1) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (kc + u >= kc1) break;
    st.w[u][0] = ld_stream(wa + (i64)(kc + u) * FP4_TILE_CHUNK_BYTES);
    st.w[u][1] = ld_stream(wa + 8 * 64 + (i64)(kc + u) * FP4_TILE_CHUNK_BYTES);
    st.s[u][0] = ld_nc4(sa + (kc + u) * 4);
    st.s[u][1] = ld_nc4(sa + 8 * (i64)(K >> 5) + (kc + u) * 4);
  }
}


// The activations of k-step s in the wgmma variant: B of wgmma_e4m3_rs, 256 bytes: two core
// matrices (logical k 0-15, 16-31) of the 8 columns' 16 bytes, k ordered as mma_e4m3's (see
// fp4_stage_x).
#define FP4_WG_STEP_BYTES 256

// xs: the staged activations (fp4_stage_x); with WG, desc0 is the descriptor of their k-step 0.
// TIGHT: 64 registers a thread (4 CTAs an SM), the conversion's table made at each use.
template <int U, bool SINGLE, bool WG, bool TIGHT>
DSUF_DEVICE void fp4_compute_s(const Fp4WStage<U>& st, const void* xs, u64 desc0, const float2* xsc, int kc, int kc1, float acc[4]) {
  const int lane = threadIdx.x & 31, t = lane & 3;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (kc + u >= kc1) break;
    const float2 sc = xsc[(kc + u) * 4 + t];  // columns 2t, 2t + 1
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 wg = word(st.w[u][0], i), wg8 = word(st.w[u][1], i);
      u32 a0, a1, a2, a3;
      if (TIGHT) {
        fp4_e4m3_unscaled(wg, a0, a2), fp4_e4m3_unscaled(wg8, a1, a3);
      } else {
        fp4_e4m3(wg, FP4_E4M3_LO, FP4_E4M3_HI, a0, a2), fp4_e4m3(wg8, FP4_E4M3_LO, FP4_E4M3_HI, a1, a3);
      }
      float swg, swg8;
      if (i == 0) swg = e8m0_byte<0>(st.s[u][0]), swg8 = e8m0_byte<0>(st.s[u][1]);
      if (i == 1) swg = e8m0_byte<1>(st.s[u][0]), swg8 = e8m0_byte<1>(st.s[u][1]);
      if (i == 2) swg = e8m0_byte<2>(st.s[u][0]), swg8 = e8m0_byte<2>(st.s[u][1]);
      if (i == 3) swg = e8m0_byte<3>(st.s[u][0]), swg8 = e8m0_byte<3>(st.s[u][1]);
      float d[4];
      if (WG) {  // the descriptor's address field counts 16 bytes
        wgmma_e4m3_rs(d, a0, a1, a2, a3, desc0 + (u64)(((kc + u) * 4 + i) * (FP4_WG_STEP_BYTES >> 4)));
      } else {
        mma_e4m3_f16b(d, a0, a1, a2, a3, static_cast<const uint4*>(xs)[((kc + u) * 4 + i) * 32 + lane]);
      }
      acc[0] += d[0] * (swg * sc.x);
      acc[2] += d[2] * (swg8 * sc.x);
      if (!SINGLE) {
        acc[1] += d[1] * (swg * sc.y);
        acc[3] += d[3] * (swg8 * sc.y);
      }
    }
  }
}

// Activations of chunks [kc0, kc1) of the CTA's columns into shared memory (see above); with WG,
// as wgmma's B (FP4_WG_STEP_BYTES a k-step, column g's logical k at g * 16 + k % 16 of core matrix
// k / 16), made visible to the tensor cores.
// A thread's elements are e = thread + 256 r (k-step e / 32, the lane's column); all of its loads,
// the scales' too, are issued before its first store.
template <bool WG>
DSUF_DEVICE void fp4_stage_x(const GemmParams& p, const int* col_xrow, int cols, int kc0, int kc1, void* xs, float* xsc) {
  constexpr int ROUNDS = FP4_MAX_CHUNKS * 128 / GEMM_THREADS;
  const int K = p.K, KB = K >> 7, n = (kc1 - kc0) * 128;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, sc = threadIdx.x & 7;
  const u8* xrow = g < cols ? p.xq + (i64)col_xrow[g] * K + (i64)kc0 * 128 + 8 * t : nullptr;
  uint2 x[ROUNDS];
#pragma unroll
  for (int r = 0; r < ROUNDS; ++r) {
    const int step = (threadIdx.x + r * GEMM_THREADS) >> 5;
    x[r] = make_uint2(0, 0);
    if (xrow && step * 32 < n) x[r] = ld_nc8(xrow + step * 32);
  }
  // Thread e < 8 * chunks (at most 8 * FP4_MAX_CHUNKS = 128) stages the scale of column e % 8, chunk kc0 + e / 8.
  const bool stages_scale = (int)threadIdx.x < (kc1 - kc0) * 8;
  const float s = stages_scale && sc < cols ? 64.0f * p.sx[(i64)col_xrow[sc] * KB + kc0 + (threadIdx.x >> 3)] : 0.0f;
#pragma unroll
  for (int r = 0; r < ROUNDS; ++r) {
    const int e = threadIdx.x + r * GEMM_THREADS, step = e >> 5;
    if (e >= n) break;
    // Logical k 4t+b <-> element 8t+2b of the step (low nibbles), 16+4t+b <-> 8t+2b+1.
    const u32 b0 = __byte_perm(x[r].x, x[r].y, 0x6420), b1 = __byte_perm(x[r].x, x[r].y, 0x7531);
    if (WG) {
      u8* at = static_cast<u8*>(xs) + step * FP4_WG_STEP_BYTES + g * 16 + 4 * t;
      *reinterpret_cast<u32*>(at) = b0;
      *reinterpret_cast<u32*>(at + 128) = b1;
    } else {
      static_cast<uint4*>(xs)[e] = e4m3_b_to_f16(b0, b1);
    }
  }
  if (WG) fence_proxy_async_smem();
  if (stages_scale) xsc[threadIdx.x] = s;
}

// EARLY: the kernel's PDL wait comes here, after the first weight stage is in flight (see gemm_body).
template <int U, bool SINGLE, bool WG, bool EARLY, bool TIGHT>
DSUF_DEVICE void fp4_tile_s(const GemmParams& p, const u8* w, const u8* ws, int row0, int kc0, int kc1,
                            const int* col_xrow, int cols, void* xs, float* xsc, float acc[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, K = p.K;
  const int row = row0 + g;  // (row0: a multiple of 16)
  const u8* wa = w + (i64)(row >> 7) * 64 * K + (row & 127) * 64 + 16 * (lane & 3);
  const u8* sa = ws + (i64)row * (K >> 5);
  Fp4WStage<U> a, b;
  fp4_load_w(a, wa, sa, K, kc0, kc1);  // weights in flight while the activations are staged
  if (EARLY) pdl_begin();
  fp4_stage_x<WG>(p, col_xrow, cols, kc0, kc1, xs, xsc);
  __syncthreads();
  const float2* xsc2 = reinterpret_cast<const float2*>(xsc);
  const u64 desc0 = WG ? wgmma_desc(xs, 128, FP4_WG_STEP_BYTES) : 0;  // B: k halves 128 bytes apart
  const int n = kc1 - kc0;
  for (int kc = 0; kc < n; kc += 2 * U) {
    if (kc + U < n) fp4_load_w(b, wa, sa, K, kc0 + kc + U, kc1);
    fp4_compute_s<U, SINGLE, WG, TIGHT>(a, xs, desc0, xsc2, kc, n, acc);
    if (kc + 2 * U < n) fp4_load_w(a, wa, sa, K, kc0 + kc + 2 * U, kc1);
    if (kc + U < n) fp4_compute_s<U, SINGLE, WG, TIGHT>(b, xs, desc0, xsc2, kc + U, n, acc);
  }
}

// WG: the k-steps' products by wgmma (a warpgroup's 64 rows a step, the activations read by the
// tensor cores from shared memory as they are), not two f16 mma.sync of converted operands a warp.
template <int U, bool WG, bool EARLY, bool TIGHT>
DSUF_DEVICE void fp4_main(const GemmParams& p, const u8* w, const u8* ws, int row0, int kc0, int kc1,
                          const int* col_xrow, int cols, float acc[4]) {
  __shared__ __align__(128) uint4 xs[FP4_MAX_CHUNKS * 128 / (WG ? 2 : 1)];  // f16: 32 bytes a lane a step; WG: 256 a step
  __shared__ __align__(16) float xsc[FP4_MAX_CHUNKS * 8];
  if (cols == 1) {
    fp4_tile_s<U, true, WG, EARLY, TIGHT>(p, w, ws, row0, kc0, kc1, col_xrow, cols, xs, xsc, acc);
  } else {
    fp4_tile_s<U, false, WG, EARLY, TIGHT>(p, w, ws, row0, kc0, kc1, col_xrow, cols, xs, xsc, acc);
  }
}

DSUF_DEVICE int pair_at(const GemmParams& p, int i) { return p.order ? p.order[i] : i; }

// FP4U: chunks a pipeline stage of the FP4 path (unused for FP8); FP4WG: the products by wgmma
// (FP8: MT = 1 only). EARLY (FP4): the kernel has not waited for its PDL predecessor yet; what it
// reads before fp4_tile_s waits (pairs, experts, weights, scales) was written before that
// predecessor (common.cuh), so only the activations wait: the routed w2, whose pairs the router
// made two launches back, has its first weights in flight during the gate/up launch's tail.
// FP4TIGHT: the kernel is capped at 64 registers (fp4_compute_s's TIGHT).
template <int FMT, int MT, int EPI, int FP4U, bool FP4WG = false, bool EARLY = false, bool FP4TIGHT = false>
DSUF_DEVICE void gemm_body(const GemmParams& p) {
  constexpr int MATS = EPI == EPI_SWIGLU ? 2 : 1, COLS = 8 * MT, STRIDE = COLS * 128;
  __shared__ float red[MATS][STRIDE];  // [mat][col * 128 + row]: this CTA's tile, then the sums
  __shared__ float4 group_sum[256];
  __shared__ int col_xrow[COLS], col_orow[COLS], n_cols, last;
  __shared__ float col_w[COLS];

  const int rb = blockIdx.x, mat = blockIdx.y / p.splits, split = blockIdx.y % p.splits;
  const int item = blockIdx.z, NB = p.N >> 7, KB = p.K >> 7;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

  // Columns. FP8: the tokens. FP4 with p.cols == 1: every pair is a column of its own (the host
  // knows that no two consecutive pairs share an expert: one token's top-k), nothing to find.
  // Else the pairs that share this item's expert, in expert order: the item that starts each run
  // of up to 8 equal experts takes the run, so each expert's weights are read once for all of its
  // tokens; the other items of the run exit. Meanwhile threads < 8 read the pair and routing
  // weight of the column they would hold; the weight is stored for the epilogue only after the
  // products, so that no barrier waits for its load.
  int pair = threadIdx.x;
  float route_w = 1.0f;
  if (FMT == FMT_FP4 && threadIdx.x < COLS && item + (int)threadIdx.x < (int)gridDim.z) {
    pair = pair_at(p, item + threadIdx.x);
    if (p.route_w) route_w = p.route_w[pair];
  }
  const i64 expert = FMT == FMT_FP4 ? p.expert[pair_at(p, item)] : 0;  // (in flight across the barriers)
  const bool runs = FMT == FMT_FP4 && p.cols != 1;
  if (runs) {
    if (threadIdx.x == 0) {
      int start = item, cols = 0;
      while (start > 0 && p.expert[pair_at(p, start - 1)] == expert) --start;
      if ((item - start) % COLS == 0)
        while (cols < COLS && item + cols < (int)gridDim.z && p.expert[pair_at(p, item + cols)] == expert) ++cols;
      n_cols = cols;
    }
    __syncthreads();
  }
  const int cols = runs ? n_cols : p.cols;
  if (cols == 0) return;
  if (threadIdx.x < cols) {
    col_xrow[threadIdx.x] = FMT == FMT_FP4 ? pair / p.x_div : pair;
    col_orow[threadIdx.x] = pair;
  }
  __syncthreads();

  Cols<MT> c;
#pragma unroll
  for (int j = 0; j < MT; ++j) {
    const int cb = j * 8 + g, ca = j * 8 + 2 * t;
    c.xb[j] = cb < cols ? col_xrow[cb] : -1;
    c.xa[j] = ca < cols ? col_xrow[ca] : -1;
    c.xa1[j] = ca + 1 < cols ? col_xrow[ca + 1] : -1;
  }
  const int kb0 = (int)((i64)split * KB / p.splits), kb1 = (int)((i64)(split + 1) * KB / p.splits);
  const int row0 = rb * 128 + warp * 16;
  float acc[MT][4];
#pragma unroll
  for (int j = 0; j < MT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  if (FMT == FMT_FP8 && FP4WG) {  // (FP4WG: for FP8, the tile's products by wgmma)
    __shared__ __align__(128) u8 xs_wg[FMT == FMT_FP8 && FP4WG ? FP8_WG_MAX_KB * 4 * FP8_WG_STEP : 1];
    fp8_tile<MT, true>(p, p.w[mat], p.ws[mat] + (i64)rb * KB, row0, kb0, kb1, c, acc, xs_wg, col_xrow, cols);
  } else if (FMT == FMT_FP8) {
    fp8_tile<MT>(p, p.w[mat], p.ws[mat] + (i64)rb * KB, row0, kb0, kb1, c, acc);
  } else {
    const u8* we = p.w[mat] + expert * p.N * (p.K >> 1);
    const u8* wse = p.ws[mat] + expert * p.N * (p.K >> 5);
    fp4_main<FP4U, FP4WG, EARLY, FP4TIGHT>(p, we, wse, row0, kb0, kb1, col_xrow, cols, acc[0]);
  }
  if (threadIdx.x < cols) col_w[threadIdx.x] = route_w;  // (visible after the barrier below)

  const int r = warp * 16 + g;
#pragma unroll
  for (int j = 0; j < MT; ++j) {
    const int cc = j * 8 + 2 * t;
    red[0][cc * 128 + r] = acc[j][0];
    red[0][(cc + 1) * 128 + r] = acc[j][1];
    red[0][cc * 128 + r + 8] = acc[j][2];
    red[0][(cc + 1) * 128 + r + 8] = acc[j][3];
  }
  __syncthreads();

  const int parts = MATS * p.splits;
  if (parts > 1) {
    // Split-K: publish this CTA's partial; the last CTA of the tile sums all of them.
    const i64 tile = (i64)item * NB + rb;
    float* part = p.partial + tile * parts * STRIDE;
    float4* mine = reinterpret_cast<float4*>(part + (i64)(mat * p.splits + split) * STRIDE);
    for (int i = threadIdx.x; i < cols * 32; i += blockDim.x) mine[i] = reinterpret_cast<const float4*>(red[0])[i];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      last = atomicAdd(p.counter + tile, 1) == parts - 1;
      if (last) p.counter[tile] = 0;  // every other CTA has arrived: ready for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // slots: (mat, 4 rows of a column) float4 sums. With few slots, `groups` threads share a
    // slot's splits (contiguous ranges) and their sums are added in group order: every launch
    // adds in the same order, so the result is deterministic.
    const int slots = MATS * cols * 32;
    const int groups = max(1, min((int)blockDim.x / slots, p.splits));
    for (int i = threadIdx.x; i < slots * groups; i += blockDim.x) {
      const int grp = i / slots, slot = i - grp * slots, m = slot / (cols * 32), q = slot - m * cols * 32;
      const float4* src = reinterpret_cast<const float4*>(part + (i64)m * p.splits * STRIDE) + q;
      float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      const int k1 = (grp + 1) * p.splits / groups;
#pragma unroll 4
      for (int k = grp * p.splits / groups; k < k1; ++k) {
        const float4 v = __ldcg(src + (i64)k * (STRIDE / 4));
        sum.x += v.x;
        sum.y += v.y;
        sum.z += v.z;
        sum.w += v.w;
      }
      if (groups == 1) {
        reinterpret_cast<float4*>(red[m])[q] = sum;
      } else {
        group_sum[i] = sum;
      }
    }
    __syncthreads();
    if (groups > 1) {
      for (int slot = threadIdx.x; slot < slots; slot += blockDim.x) {
        float4 sum = group_sum[slot];
        for (int grp = 1; grp < groups; ++grp) {
          const float4 v = group_sum[grp * slots + slot];
          sum.x += v.x;
          sum.y += v.y;
          sum.z += v.z;
          sum.w += v.w;
        }
        const int m = slot / (cols * 32);
        reinterpret_cast<float4*>(red[m])[slot - m * cols * 32] = sum;
      }
      __syncthreads();
    }
  }

  // Epilogue: one warp per column; a lane owns 4 consecutive rows.
  for (int cc = warp; cc < cols; cc += 8) {
    const i64 at = (i64)col_orow[cc] * p.N + rb * 128 + lane * 4;
    const float4 v = reinterpret_cast<const float4*>(red[0])[cc * 32 + lane];
    if (EPI == EPI_STORE_BF16) {
      const u32 lo = f32_to_bf16(v.x) | ((u32)f32_to_bf16(v.y) << 16);
      const u32 hi = f32_to_bf16(v.z) | ((u32)f32_to_bf16(v.w) << 16);
      *reinterpret_cast<uint2*>(static_cast<u16*>(p.out) + at) = make_uint2(lo, hi);
    } else {
      // The reference Expert: clamp, silu(gate) * up in fp32 (silu in float64), times the routing
      // weight, rounded to bf16, then w2's per-128 act_quant, whose block is exactly this tile.
      const float4 u = reinterpret_cast<const float4*>(red[MATS - 1])[cc * 32 + lane];
      const float gates[4] = {v.x, v.y, v.z, v.w}, ups[4] = {u.x, u.y, u.z, u.w};
      float h[4], amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float gate = gates[i], up = ups[i];
        if (p.limit > 0.0f) {
          up = fminf(fmaxf(up, -p.limit), p.limit);
          gate = fminf(gate, p.limit);
        }
        h[i] = bf16_to_f32(f32_to_bf16(col_w[cc] * (silu_f64(gate) * up)));
        amax = fmaxf(amax, fabsf(h[i]));
      }
      const int ex = act_scale_exponent(warp_max(amax));
      *reinterpret_cast<u32*>(static_cast<u8*>(p.out) + at) = quant4_e4m3(h[0], h[1], h[2], h[3], ex);
      if (lane == 0) p.out_scale[(i64)col_orow[cc] * NB + rb] = pow2f(ex);
    }
  }
}

// Up to 128 registers a thread (2 CTAs an SM) for one token tile; more tiles need more. WG: wgmma.
#define DSUF_GEMM(name, FMT, MT, EPI, WG)                                              \
  extern "C" __global__ void __launch_bounds__(256, MT == 1 ? 2 : 1)                  \
      name(const __grid_constant__ GemmParams p) { \
    pdl_begin();                                                                       \
    gemm_body<FMT, MT, EPI, 1, WG>(p);                                                 \
  }

// FP4 with staged activations: U chunks a pipeline stage, at least BLOCKS CTAs an SM, WG: wgmma.
// The w2 launches (EPI_STORE_BF16) wait for their predecessor only before their activations.
#define DSUF_GEMM_FP4(name, EPI, U, BLOCKS, WG)                                        \
  extern "C" __global__ void __launch_bounds__(256, BLOCKS)                           \
      name(const __grid_constant__ GemmParams p) { \
    if (EPI != EPI_STORE_BF16) pdl_begin();                                            \
    gemm_body<FMT_FP4, 1, EPI, U, WG, EPI == EPI_STORE_BF16, BLOCKS == 4>(p);         \
  }

// Dense FP8 linears for up to 8 * MT tokens (attention projections, the shared expert's w2).
DSUF_GEMM(fp8_gemm_bf16_m8, FMT_FP8, 1, EPI_STORE_BF16, false)
DSUF_GEMM(fp8_gemm_bf16_m16, FMT_FP8, 2, EPI_STORE_BF16, false)
DSUF_GEMM(fp8_gemm_bf16_m24, FMT_FP8, 3, EPI_STORE_BF16, false)
DSUF_GEMM(fp8_gemm_bf16_m32, FMT_FP8, 4, EPI_STORE_BF16, false)
// The shared expert's w1/w3 with the SwiGLU epilogue, output ready for w2.
DSUF_GEMM(fp8_swiglu_m8, FMT_FP8, 1, EPI_SWIGLU, false)
DSUF_GEMM(fp8_swiglu_m16, FMT_FP8, 2, EPI_SWIGLU, false)
DSUF_GEMM(fp8_swiglu_m24, FMT_FP8, 3, EPI_SWIGLU, false)
DSUF_GEMM(fp8_swiglu_m32, FMT_FP8, 4, EPI_SWIGLU, false)
// Up to 8 tokens with wgmma (sm_90a).
DSUF_GEMM(fp8_gemm_bf16_wg_m8, FMT_FP8, 1, EPI_STORE_BF16, true)
DSUF_GEMM(fp8_swiglu_wg_m8, FMT_FP8, 1, EPI_SWIGLU, true)
// Routed FP4 experts over (token, expert) pairs, up to 8 tokens of one expert per item: 3 CTAs an
// SM for few pairs (batch 1: 60.2 µs MoE against 61-65 at 4), 4 for more (batch 8: 164 against 170).
DSUF_GEMM_FP4(fp4_swiglu_pairs_u2b3, EPI_SWIGLU, 2, 3, false)
DSUF_GEMM_FP4(fp4_gemm_bf16_pairs_u2b3, EPI_STORE_BF16, 2, 3, false)
DSUF_GEMM_FP4(fp4_swiglu_pairs_u2b4, EPI_SWIGLU, 2, 4, false)
DSUF_GEMM_FP4(fp4_gemm_bf16_pairs_u2b4, EPI_STORE_BF16, 2, 4, false)
// The same with wgmma (sm_90a).
DSUF_GEMM_FP4(fp4_swiglu_pairs_g2b3, EPI_SWIGLU, 2, 3, true)
DSUF_GEMM_FP4(fp4_gemm_bf16_pairs_g2b3, EPI_STORE_BF16, 2, 3, true)
DSUF_GEMM_FP4(fp4_swiglu_pairs_g2b4, EPI_SWIGLU, 2, 4, true)
DSUF_GEMM_FP4(fp4_gemm_bf16_pairs_g2b4, EPI_STORE_BF16, 2, 4, true)
