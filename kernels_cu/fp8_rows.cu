// Decode FP8 linears (up to 8 tokens) whose rows split into about one CTA per SM without
// splitting K: y[m, n] = sum_k xq[m, k] sx[m, k/128] * W[n, k] sw(n, k), as gemm.cu's FP8 path
// computes it (mma.sync m16n8k32 e4m3, a block's sum scaled and added in fp32), bf16 out.
//
// A CTA owns R consecutive rows (R in 16, 32, 64, 128: one scale row-block) and all of K; its 16
// warps are (row group rg of 16 rows, K share kp), shares = 16 / (R / 16). Before the PDL wait,
// its threads post the CTA's whole weight slice into shared memory as bulk copies of (row, K
// chunk), chunk-major (rows padded to K + 64 bytes so that the 8 lanes of a 16-byte access phase
// hit distinct banks), each (row group, chunk) completing on its own mbarrier: the slice is in
// flight from the moment the CTA is scheduled, a warp starts as soon as its own chunk has landed,
// and no partial sums leave the CTA. (With 8 warps each owning a row group over all of K, the
// arithmetic, latency-bound at two warps a scheduler, ran mostly after the last byte had landed.)
// After the wait the CTA stages its tokens' activations and the blocks' scales; the K shares'
// sums meet in shared memory and add up in a fixed order.
//
// Fragments as in gemm.cu (mma_e4m3_kblock): lane = 4g + t holds 16 bytes of rows g and g + 8 at
// 16t and 64 + 16t of each 128-byte K block, and the matching bytes of token g's activations.
#include "common.cuh"

#define ROWS_THREADS 512
#define ROWS_WARPS (ROWS_THREADS / 32)

// A warp's place: row group rg, K share kp of `shares`, its K blocks [kb0, kb1), and the barrier
// its weights land on: the K shares are copied in `chunks` (a power of two dividing `shares`, K
// pieces of at least 4 KB: fewer, larger bulk copies stream faster than the warps gain by starting
// on earlier pieces; a TP=2 rank's step at batch 1, A/B: 4 KB -0.5 %, 512 bytes +1.4 % against 1 KB).
struct RowsWarp {
  int rg, kp, shares, kb0, kb1, chunks, bar;
};

DSUF_DEVICE RowsWarp rows_warp(int R, int K) {
  RowsWarp w;
  const int groups = R >> 4, warp = threadIdx.x >> 5, KB = K >> 7;
  w.shares = ROWS_WARPS / groups;
  w.rg = warp % groups;
  w.kp = warp / groups;
  w.kb0 = w.kp * KB / w.shares;
  w.kb1 = (w.kp + 1) * KB / w.shares;
  w.chunks = 1;
  while (2 * w.chunks <= w.shares && 2 * w.chunks * 32 <= KB) w.chunks *= 2;
  w.bar = w.rg * w.chunks + w.kp / (w.shares / w.chunks);
  return w;
}

// Before the PDL wait (the weights depend on no earlier kernel): the CTA's R rows of w (K bytes
// each, from row r0) are posted to dst (pitch bytes apart) as one bulk copy a (row, K chunk),
// chunk-major so that the first chunks land first; barrier rg * chunks + c completes with row
// group rg's chunk c.
DSUF_DEVICE void post_rows(u8* dst, int pitch, const u8* w, int K, int r0, int R, const RowsWarp& rw, u64* bars) {
  const int KB = K >> 7, groups = R >> 4, chunks = rw.chunks;
  if (threadIdx.x == 0) {
    mbar_init(bars, groups * chunks);
    for (int b = 0; b < groups * chunks; ++b) {
      const int c = b % chunks;
      mbar_expect_bytes(&bars[b], 16 * 128 * ((c + 1) * KB / chunks - c * KB / chunks));
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < R * chunks; i += ROWS_THREADS) {
    const int c = i / R, r = i % R, kb0 = c * KB / chunks, kb1 = (c + 1) * KB / chunks;
    bulk_stream(dst + r * pitch + kb0 * 128, w + (i64)(r0 + r) * K + kb0 * 128, (kb1 - kb0) * 128, &bars[(r >> 4) * chunks + c]);
  }
}

// acc: a lane's (row r, tokens m and m + 1), (row r + 8, the same tokens) of K share kp; the
// shares' partial sums meet in red (float [shares][R][8]) and add up in a fixed order; out rows
// r0 … r0 + R - 1 of the M tokens written as bf16.
template <class Params>  // out, N, M, R as in RowsParams
DSUF_DEVICE void rows_reduce_store(const Params& p, int r0, float* red, const float acc[4], int r, int m, int kp, int shares) {
  float* part = red + kp * p.R * 8;
  part[r * 8 + m] = acc[0];
  part[r * 8 + m + 1] = acc[1];
  part[(r + 8) * 8 + m] = acc[2];
  part[(r + 8) * 8 + m + 1] = acc[3];
  __syncthreads();
  for (int i = threadIdx.x; i < p.R * p.M; i += ROWS_THREADS) {
    const int tok = i / p.R, row = i % p.R;
    float sum = 0.0f;
    for (int s = 0; s < shares; ++s) sum += red[(s * p.R + row) * 8 + tok];
    p.out[(i64)tok * p.N + r0 + row] = f32_to_bf16(sum);
  }
}

struct RowsParams {
  const u8* w;      // e4m3 [N, K]
  const u8* ws;     // E8M0 [N/128, K/128]
  const u8* xq;     // e4m3 [M, K]
  const float* sx;  // [M, K/128]
  u16* out;         // bf16 [M, N]
  int N, K, M, R;
};

// The activations are staged once for all warps already as mma_e4m3_f16b's B (f16 pairs), only
// the M real tokens: xf[((kb * 4 + i) * M + m) * 4 + t] = mma i of K block kb, token m, lane t.
// QUANT: p.xq holds bf16 [M, K] rows, quantised here as act_quant_bf16 does (per token and
// 128-block: the same scales and e4m3 bytes), so that no launch before this one quantises them.
template <bool QUANT>
DSUF_DEVICE void fp8_rows_body(const RowsParams& p) {
  extern __shared__ __align__(128) u8 smem[];
  __shared__ u64 bars[ROWS_WARPS];
  const int K = p.K, KB = K >> 7, pitch = K + 64;
  const int r0 = blockIdx.x * p.R;
  u8* ws_ = smem;                                               // [R][pitch] weights
  uint4* xf = reinterpret_cast<uint4*>(smem + p.R * pitch);     // [KB][4][M][4] activations as f16
  float2* scale = reinterpret_cast<float2*>(xf + p.M * (K >> 3));  // [KB][4]: sw * sx of tokens 2t, 2t + 1
  float* red = reinterpret_cast<float*>(scale + 4 * KB);          // [K shares][R][8] partial sums
  const RowsWarp rw = rows_warp(p.R, K);

  post_rows(ws_, pitch, p.w, K, r0, p.R, rw, bars);
  // Thread e < 8 KB stages the scale of K block e / 8, token e % 8 (8 KB <= 512: K <= 8192); the
  // weight's half is read before the wait, the activation's loads are in flight with the x loads.
  const int se = threadIdx.x, skb = se >> 3, sm = se & 7;
  const bool stages_scale = se < 8 * KB;
  const float sw = stages_scale ? e8m0_to_f32(p.ws[(i64)(r0 >> 7) * KB + skb]) : 0.0f;
  float* sxs = reinterpret_cast<float*>(scale);
  pdl_begin();
  if (QUANT) {
    // A half-warp a (token, K block), 8 values a lane: lane j's are the 8 bytes of mma 2 (j / 8) +
    // j % 2, lane (j / 2) % 4 of the block.
    const u16* x = reinterpret_cast<const u16*>(p.xq);
    const int j = threadIdx.x & 15;
    if (stages_scale && sm >= p.M) sxs[se] = 0.0f;
    for (int b0 = 2 * (threadIdx.x >> 5); b0 < p.M * KB; b0 += ROWS_THREADS / 16) {  // (whole warps: the shuffles)
      const int b = b0 + ((threadIdx.x >> 4) & 1), m = b / KB, kb = b - m * KB;
      const bool has = b < p.M * KB;
      const uint4 v = has ? ld_nc16(x + (i64)m * K + kb * 128 + 8 * j) : make_uint4(0, 0, 0, 0);
      const u32 w[4] = {v.x, v.y, v.z, v.w};
      float f[8], amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        f[i] = bf16_to_f32(i & 1 ? w[i >> 1] >> 16 : w[i >> 1] & 0xffff);
        amax = fmaxf(amax, fabsf(f[i]));
      }
#pragma unroll
      for (int o = 8; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));  // within the half-warp
      if (!has) continue;
      const int e = act_scale_exponent(amax);
      const int i = 2 * (j >> 3) + (j & 1), t = (j >> 1) & 3;
      xf[((kb * 4 + i) * p.M + m) * 4 + t] = e4m3_b_to_f16(quant4_e4m3(f[0], f[1], f[2], f[3], e), quant4_e4m3(f[4], f[5], f[6], f[7], e));
      if (j == 0) sxs[kb * 8 + m] = pow2f(e);
    }
    __syncthreads();
    if (stages_scale) sxs[se] = sw * sxs[se];
  } else {
    const float sxv = stages_scale && sm < p.M ? p.sx[(i64)sm * KB + skb] : 0.0f;
#pragma unroll 4
    for (int e = threadIdx.x; e < p.M * (K >> 3); e += ROWS_THREADS) {
      const int t = e & 3, m = (e >> 2) % p.M, ki = (e >> 2) / p.M, kb = ki >> 2, i = ki & 3;
      const uint2 v = ld_nc8(p.xq + (i64)m * K + kb * 128 + 64 * (i >> 1) + 16 * t + 8 * (i & 1));
      xf[e] = e4m3_b_to_f16(v.x, v.y);
    }
    if (stages_scale) sxs[se] = sw * sxv;
  }

  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const u8* wrow = ws_ + (rw.rg * 16 + g) * pitch + 16 * t;
  // Columns g >= M (no token) read token g % M: finite values whose sums are scaled by 0 below.
  const uint4* xrow = xf + (g % p.M) * 4 + t;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  __syncthreads();  // the activations and scales are staged
  if (rw.kb1 > rw.kb0) mbar_wait(&bars[rw.bar], 0);
  for (int kb = rw.kb0; kb < rw.kb1; ++kb) {
    const int off = kb * 128;
    const uint4 w[4] = {*reinterpret_cast<const uint4*>(wrow + off), *reinterpret_cast<const uint4*>(wrow + off + 64),
                        *reinterpret_cast<const uint4*>(wrow + 8 * pitch + off), *reinterpret_cast<const uint4*>(wrow + 8 * pitch + off + 64)};
    uint4 x[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = xrow[(kb * 4 + i) * p.M * 4];
    float d[4];
    mma_e4m3_kblock_f16b(d, w, x);
    const float2 sc = scale[kb * 4 + t];  // this lane's accumulator tokens 2t, 2t + 1 (0 where absent)
    acc[0] += d[0] * sc.x;
    acc[1] += d[1] * sc.y;
    acc[2] += d[2] * sc.x;
    acc[3] += d[3] * sc.y;
  }
  rows_reduce_store(p, r0, red, acc, rw.rg * 16 + g, 2 * t, rw.kp, rw.shares);
}

extern "C" __global__ void __launch_bounds__(ROWS_THREADS, 1) fp8_rows_m8(const __grid_constant__ RowsParams p) { fp8_rows_body<false>(p); }
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, 1) fp8_rows_quant_m8(const __grid_constant__ RowsParams p) { fp8_rows_body<true>(p); }

// wo_a's grouped FP8 projection with bf16 activations (gemv.cu's FP8 format, the reference's bf16
// einsum over the exactly dequantised weight) in the same way: y[m, n] = sum_k x[m, g K + k] W[n, k]
// sw(n, k) for the rows n of group g = n / group_rows, bf16 out. The CTA's rows (one group, one
// scale row-block) arrive by bulk copy before the PDL wait; after it, the CTA stages its group's K
// columns of the M tokens, each 4 elements stored as (0, 2, 1, 3) so that a word holds the pair
// that meets one converted weight word (gemv.cu). Warp (rg, kp) multiplies row group rg over its
// K-block share kp with bf16 mma (m16n8k16); a block's two 64-element chunks are summed unscaled
// and the sum times the block's power-of-two scale is added in fp32; the shares are summed in a
// fixed order. Tokens >= M read as zeros from registers, so only M token rows are staged.
struct RowsBf16Params {
  const u8* w;   // e4m3 [N, K]
  const u8* ws;  // E8M0 [N/128, K/128]
  const u16* x;  // bf16 [M, ldx]: group g's columns are [g K, g K + K)
  u16* out;      // bf16 [M, N]
  int N, K, M, R, ldx, group_rows;
};

extern "C" __global__ void __launch_bounds__(ROWS_THREADS, 1) fp8_rows_bf16x_m8(const __grid_constant__ RowsBf16Params p) {
  extern __shared__ __align__(128) u8 smem[];
  __shared__ u64 bars[ROWS_WARPS];
  const int K = p.K, KB = K >> 7, pitch = K + 64, xpitch = 2 * K + 16;
  const int r0 = blockIdx.x * p.R;
  u8* ws_ = smem;                                                // [R][pitch] weights
  u8* xs = smem + p.R * pitch;                                   // [M][xpitch] activations
  float* red = reinterpret_cast<float*>(xs + p.M * xpitch);      // [K shares][R][8] partial sums
  const RowsWarp rw = rows_warp(p.R, K);
  post_rows(ws_, pitch, p.w, K, r0, p.R, rw, bars);
  pdl_begin();
  const u16* xg = p.x + (i64)(r0 / p.group_rows) * K;
  for (int i = threadIdx.x; i < p.M * (K / 8); i += ROWS_THREADS) {
    const int m = i / (K / 8), q = i % (K / 8);
    const uint4 v = ld_nc16(xg + (i64)m * p.ldx + 8 * q);
    *reinterpret_cast<uint4*>(xs + m * xpitch + 16 * q) = make_uint4(
        __byte_perm(v.x, v.y, 0x5410), __byte_perm(v.x, v.y, 0x7632), __byte_perm(v.z, v.w, 0x5410), __byte_perm(v.z, v.w, 0x7632));
  }
  __syncthreads();

  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const u8* wrow = ws_ + (rw.rg * 16 + g) * pitch + 16 * t;  // rows g and g + 8 of the group: 16 e4m3 a 64-element chunk
  const u8* xrow = xs + g * xpitch + 32 * t;                 // token g: the matching 16 bf16
  const bool has_x = g < p.M;
  const u8* sw_row = p.ws + (i64)(r0 >> 7) * KB;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (rw.kb1 > rw.kb0) mbar_wait(&bars[rw.bar], 0);
  for (int kb = rw.kb0; kb < rw.kb1; ++kb) {
    float blk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = 2 * kb + h;
      const uint4 w0 = *reinterpret_cast<const uint4*>(wrow + c * 64), w1 = *reinterpret_cast<const uint4*>(wrow + 8 * pitch + c * 64);
      uint4 x0 = make_uint4(0, 0, 0, 0), x1 = make_uint4(0, 0, 0, 0);
      if (has_x) {
        x0 = *reinterpret_cast<const uint4*>(xrow + c * 128);
        x1 = *reinterpret_cast<const uint4*>(xrow + c * 128 + 16);
      }
      u32 a[4][4];
      e4m3_a_fragments(a, w0, w1);
      mma_bf16(blk, a[0], x0.x, x0.y);
      mma_bf16(blk, a[1], x0.z, x0.w);
      mma_bf16(blk, a[2], x1.x, x1.y);
      mma_bf16(blk, a[3], x1.z, x1.w);
    }
    const float sw = e8m0_to_f32(sw_row[kb]);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += blk[i] * sw;
  }
  rows_reduce_store(p, r0, red, acc, rw.rg * 16 + g, 2 * t, rw.kp, rw.shares);
}
