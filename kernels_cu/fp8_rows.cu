// Decode FP8 linears (up to 8 tokens) whose rows split into about one CTA per SM without
// splitting K: y[m, n] = sum_k xq[m, k] sx[m, k/128] * W[n, k] sw(n, k), as gemm.cu's FP8 path
// computes it (mma.sync m16n8k32 e4m3, a block's sum scaled and added in fp32), bf16 out.
//
// A CTA owns R consecutive rows (R in 16, 32, 64, 128: one scale row-block) and all of K. Before
// the PDL wait, its threads post one bulk copy per row into shared memory (rows padded to K + 64
// bytes so that the 8 lanes of a 16-byte access phase hit distinct banks), each 16-row group
// completing on its own mbarrier: the CTA's whole weight slice is in flight at once, from the
// moment the CTA is scheduled, and no partial sums leave the CTA. Then it waits for the kernel
// before it and copies the activations in the same way. Warp (rg, kp) multiplies row group rg over
// its share kp of the K blocks; the K shares are summed in shared memory in a fixed order.
//
// Fragments as in gemm.cu (mma_e4m3_kblock): lane = 4g + t holds 16 bytes of rows g and g + 8 at
// 16t and 64 + 16t of each 128-byte K block, and the matching bytes of token g's activations.
#include "common.cuh"

#define ROWS_THREADS 256
#define ROWS_WARPS (ROWS_THREADS / 32)
#define ROWS_MAX_GROUPS 8  // R <= 128

// Before the PDL wait (the weights depend on no earlier kernel): the CTA's R rows of w (K bytes
// each, from row r0) are posted as one bulk copy a row to dst (pitch bytes apart), barrier b
// completing with 16-row group b; bars[0, n_bars) are initialised (n_bars >= R / 16).
DSUF_DEVICE void post_rows(u8* dst, int pitch, const u8* w, int K, int r0, int R, u64* bars, int n_bars) {
  if (threadIdx.x == 0) {
    for (int b = 0; b < n_bars; ++b) mbar_init(&bars[b]);
    for (int b = 0; b < R >> 4; ++b) mbar_expect_bytes(&bars[b], 16 * K);
  }
  __syncthreads();
  for (int r = threadIdx.x; r < R; r += ROWS_THREADS) bulk_copy(dst + r * pitch, w + (i64)(r0 + r) * K, K, &bars[r >> 4]);
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

extern "C" __global__ void __launch_bounds__(ROWS_THREADS, 1) fp8_rows_m8(const __grid_constant__ RowsParams p) {
  extern __shared__ __align__(128) u8 smem[];
  __shared__ u64 bars[ROWS_MAX_GROUPS + 1];  // a barrier a 16-row group, then the activations'
  const int K = p.K, KB = K >> 7, pitch = K + 64, groups = p.R >> 4;
  const int r0 = blockIdx.x * p.R;
  u8* ws_ = smem;                     // [R][pitch] weights
  u8* xs = smem + p.R * pitch;        // [8][pitch] activations (tokens >= M: zeros)
  float* red = reinterpret_cast<float*>(xs + 8 * pitch);  // [K shares][R][8] partial sums

  post_rows(ws_, pitch, p.w, K, r0, p.R, bars, groups + 1);
  pdl_begin();
  if (threadIdx.x == 0) mbar_expect_bytes(&bars[groups], p.M * K);
  __syncthreads();  // the expectation is posted before any activation copy completes
  if (threadIdx.x < p.M) bulk_copy(xs + threadIdx.x * pitch, p.xq + (i64)threadIdx.x * K, K, &bars[groups]);
  for (int i = p.M * (K / 16) + threadIdx.x; i < 8 * (K / 16); i += ROWS_THREADS) {
    const int m = i / (K / 16), c = i % (K / 16);
    *reinterpret_cast<uint4*>(xs + m * pitch + 16 * c) = make_uint4(0, 0, 0, 0);
  }

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int shares = ROWS_WARPS / groups, rg = warp % groups, kp = warp / groups;
  const int kb0 = kp * KB / shares, kb1 = (kp + 1) * KB / shares;
  const u8* wrow = ws_ + (rg * 16 + g) * pitch + 16 * t;
  const u8* xrow = xs + g * pitch + 16 * t;
  const u8* sw_row = p.ws + (i64)(r0 >> 7) * KB;
  const int ca = 2 * t, ca1 = 2 * t + 1;  // this lane's accumulator tokens
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  __syncthreads();  // the zero rows are written
  mbar_wait(&bars[rg], 0);
  mbar_wait(&bars[groups], 0);
  for (int kb = kb0; kb < kb1; ++kb) {
    const int off = kb * 128;
    const uint4 w[4] = {*reinterpret_cast<const uint4*>(wrow + off), *reinterpret_cast<const uint4*>(wrow + off + 64),
                        *reinterpret_cast<const uint4*>(wrow + 8 * pitch + off), *reinterpret_cast<const uint4*>(wrow + 8 * pitch + off + 64)};
    const uint4 x[2] = {*reinterpret_cast<const uint4*>(xrow + off), *reinterpret_cast<const uint4*>(xrow + off + 64)};
    float d[4];
    mma_e4m3_kblock(d, w, x);
    const float sw = e8m0_to_f32(sw_row[kb]);
    const float s0 = ca < p.M ? sw * p.sx[(i64)ca * KB + kb] : 0.0f, s1 = ca1 < p.M ? sw * p.sx[(i64)ca1 * KB + kb] : 0.0f;
    acc[0] += d[0] * s0;
    acc[1] += d[1] * s1;
    acc[2] += d[2] * s0;
    acc[3] += d[3] * s1;
  }
  rows_reduce_store(p, r0, red, acc, rg * 16 + g, 2 * t, kp, shares);
}

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
  __shared__ u64 bars[ROWS_MAX_GROUPS];
  const int K = p.K, KB = K >> 7, pitch = K + 64, xpitch = 2 * K + 16, groups = p.R >> 4;
  const int r0 = blockIdx.x * p.R;
  u8* ws_ = smem;                                                // [R][pitch] weights
  u8* xs = smem + p.R * pitch;                                   // [M][xpitch] activations
  float* red = reinterpret_cast<float*>(xs + p.M * xpitch);      // [K shares][R][8] partial sums
  post_rows(ws_, pitch, p.w, K, r0, p.R, bars, groups);
  pdl_begin();
  const u16* xg = p.x + (i64)(r0 / p.group_rows) * K;
  for (int i = threadIdx.x; i < p.M * (K / 8); i += ROWS_THREADS) {
    const int m = i / (K / 8), q = i % (K / 8);
    const uint4 v = ld_nc16(xg + (i64)m * p.ldx + 8 * q);
    *reinterpret_cast<uint4*>(xs + m * xpitch + 16 * q) = make_uint4(
        __byte_perm(v.x, v.y, 0x5410), __byte_perm(v.x, v.y, 0x7632), __byte_perm(v.z, v.w, 0x5410), __byte_perm(v.z, v.w, 0x7632));
  }
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int shares = ROWS_WARPS / groups, rg = warp % groups, kp = warp / groups;
  const int kb0 = kp * KB / shares, kb1 = (kp + 1) * KB / shares;
  const u8* wrow = ws_ + (rg * 16 + g) * pitch + 16 * t;  // rows g and g + 8 of the group: 16 e4m3 a 64-element chunk
  const u8* xrow = xs + g * xpitch + 32 * t;              // token g: the matching 16 bf16
  const bool has_x = g < p.M;
  const u8* sw_row = p.ws + (i64)(r0 >> 7) * KB;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mbar_wait(&bars[rg], 0);
  for (int kb = kb0; kb < kb1; ++kb) {
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
  rows_reduce_store(p, r0, red, acc, rg * 16 + g, 2 * t, kp, shares);
}
