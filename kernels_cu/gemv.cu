// Memory-bound GEMVs with bf16 activations for decode batches (up to 64 tokens a launch):
// out[m, r] = sum_k x[m, k] W[r, k], fp32 accumulation on the tensor cores (mma.sync m16n8k16
// bf16: 16 weight rows x 8 tokens a warp), every weight byte read once with 16-byte loads.
//
// Weight formats
//   BF16: bf16 [rows, K], float32 output (the compressors' projections).
//   FP8:  e4m3 [rows, K] with E8M0 scales [rows/128, K/128] (checkpoint layout), bf16 output
//         (wo_a). Each e4m3 byte becomes its exact bf16 value in registers (the reference's
//         dequantised weight); a 128-block's products are summed unscaled and the block sum is
//         multiplied by the power-of-two scale, which is exact.
//   Groups: rows r read the x columns [(r / group_rows) K, +K) (wo_a's 8 groups; 1 group: plain).
//
// Work split: grid.y = 64-row tile (4 warps of 16 rows x 2 warps splitting the CTA's K range),
// grid.x = S CTAs splitting K, one thread-block cluster. A CTA first starts its weight loads, then
// stages its K slice of x (all tokens) in shared memory, which all its warps read. The CTA's two
// K halves and the cluster's S CTAs are summed through (distributed) shared memory in a fixed
// order: deterministic, and no global scratch or counters. Measured on H200: a CTA streams ~14 GB/s
// (4 chunks in flight a warp) at any grid size, so dsuf/gpu/gemv.py picks the most splits that
// still run in one wave. An L2 bulk prefetch of each warp's whole range (cp.async.bulk.prefetch)
// helped only grids of few CTAs and lost at the chosen splits (CSA 11.6 against 9.8 µs).
//
// mma.m16n8k16 fragments, lane = 4g + t: A a0 = row g, k 2t..2t+1; a1 = row g+8; a2/a3 = the
// same rows at k 2t+8..; B b0 = column g, k 2t..2t+1; b1 = k 2t+8..; D d0, d1 = row g, columns
// 2t, 2t+1; d2, d3 = row g+8. The k order inside one mma is free as long as A and B agree, so each
// lane feeds the 16 bytes of a row it loaded itself (a chunk: 32 bf16 or 64 e4m3 per row).
#include "common.cuh"

struct GemvParams {
  const u8* w;     // [rows, K] bf16 or e4m3
  const u8* ws;    // FP8: E8M0 scales [rows/128, K/128]
  const u16* x;    // bf16 [M, ldx]
  void* out;       // [M, rows]: float32 (BF16) or bf16 (FP8)
  int rows, K, M, ldx;
  int group_rows;  // weight rows per group of x columns
};

enum { FMT_BF16 = 0, FMT_FP8 = 1 };
#define TILE 64
#define THREADS 256

// Bytes of one token's row of the x slice in shared memory: padded so that the 8 lanes of a
// 16-byte access phase (two tokens, four t) hit distinct banks.
template <int FMT>
DSUF_DEVICE int slice_stride(int kc) {
  return FMT == FMT_FP8 ? 2 * kc + 16 : 2 * kc + 64;
}

template <int FMT, int MT, int S>
DSUF_DEVICE void gemv_body(const GemvParams& p) {
  constexpr int CH = FMT == FMT_FP8 ? 64 : 32;  // k of a chunk: 64 bytes of a weight row
  constexpr int D = 4;  // chunks in flight a warp (128 bytes a lane)
  constexpr int TOK = 8 * MT;
  extern __shared__ uint4 smem[];
  u8* xs = reinterpret_cast<u8*>(smem);

  const int split = blockIdx.x, tile = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rg = warp & 3, kp = warp >> 2;
  const int kc = p.K / S, kh = kc / 2, nch = kh / CH, stride = slice_stride<FMT>(kc);
  const int row0 = tile * TILE + rg * 16;
  constexpr int EB = FMT == FMT_FP8 ? 1 : 2;  // bytes a weight
  const u8* wa = p.w + ((i64)(row0 + g) * p.K + split * kc + kp * kh) * EB + 16 * t;
  const u8* wb = wa + 8 * (i64)p.K * EB;

  // Weight loads first: they have the longest way to come.
  uint4 buf[D][2];
#pragma unroll
  for (int j = 0; j < D; ++j) {
    if (j < nch) {
      buf[j][0] = ld_stream(wa + j * 64);
      buf[j][1] = ld_stream(wb + j * 64);
    }
  }

  // The CTA's x slice [TOK, kc] (tokens >= M zero). FP8 keeps each 4 elements as (0, 2, 1, 3),
  // so that a word holds the pair that meets one converted weight word.
  const i64 xcol = (i64)(tile * TILE / p.group_rows) * p.K + split * kc;
  const int pieces = kc / 8;
  for (int i = threadIdx.x; i < TOK * pieces; i += THREADS) {
    const int m = i / pieces, q = i - m * pieces;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (m < p.M) v = ld_nc16(p.x + (i64)m * p.ldx + xcol + 8 * q);
    if (FMT == FMT_FP8) {
      v = make_uint4(__byte_perm(v.x, v.y, 0x5410), __byte_perm(v.x, v.y, 0x7632), __byte_perm(v.z, v.w, 0x5410),
                     __byte_perm(v.z, v.w, 0x7632));
    }
    *reinterpret_cast<uint4*>(xs + m * stride + 16 * q) = v;
  }
  float* scales = reinterpret_cast<float*>(xs + TOK * stride);  // FP8: the slice's block scales
  if (FMT == FMT_FP8 && threadIdx.x < kc / 128)
    scales[threadIdx.x] = e8m0_to_f32(p.ws[(i64)(row0 >> 7) * (p.K >> 7) + split * (kc >> 7) + threadIdx.x]);
  __syncthreads();

  const u8* xl = xs + g * stride + 2 * kp * kh + (FMT == FMT_FP8 ? 32 : 16) * t;
  const float* sl = scales + kp * (kh >> 7);
  float acc[MT][4], blk[MT][4];
#pragma unroll
  for (int j = 0; j < MT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  for (int base = 0; base < nch; base += D, wa += D * 64, wb += D * 64) {
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int c = base + j;
      if (c >= nch) break;
      const uint4 w0 = buf[j][0], w1 = buf[j][1];
      if (c + D < nch) {
        buf[j][0] = ld_stream(wa + (D + j) * 64);
        buf[j][1] = ld_stream(wb + (D + j) * 64);
      }
      if (FMT == FMT_BF16) {
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          const uint4 xv = *reinterpret_cast<const uint4*>(xl + m * 8 * stride + c * 64);
          const u32 a0[4] = {w0.x, w1.x, w0.y, w1.y}, a1[4] = {w0.z, w1.z, w0.w, w1.w};
          mma_bf16(acc[m], a0, xv.x, xv.y);
          mma_bf16(acc[m], a1, xv.z, xv.w);
        }
      } else {
        // D is even and chunks pair up into 128-blocks: j's parity is the chunk's half.
        if ((j & 1) == 0) {
#pragma unroll
          for (int m = 0; m < MT; ++m) blk[m][0] = blk[m][1] = blk[m][2] = blk[m][3] = 0.0f;
        }
        u32 a[4][4];
        e4m3_a_fragments(a, w0, w1);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          const u8* xp = xl + m * 8 * stride + c * 128;
          const uint4 x0 = *reinterpret_cast<const uint4*>(xp), x1 = *reinterpret_cast<const uint4*>(xp + 16);
          mma_bf16(blk[m], a[0], x0.x, x0.y);
          mma_bf16(blk[m], a[1], x0.z, x0.w);
          mma_bf16(blk[m], a[2], x1.x, x1.y);
          mma_bf16(blk[m], a[3], x1.z, x1.w);
        }
        if (j & 1) {
          const float sw = sl[c >> 1];
#pragma unroll
          for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][i] += blk[m][i] * sw;
        }
      }
    }
  }

  // Partials [kp][token][row] over the x slice, then the sum of both halves of all S CTAs.
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);
  const int r = rg * 16 + g;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    float* col = red + (kp * TOK + m * 8 + 2 * t) * TILE + r;
    col[0] = acc[m][0];
    col[TILE] = acc[m][1];
    col[8] = acc[m][2];
    col[TILE + 8] = acc[m][3];
  }
  if (S > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }
  const int rank = S > 1 ? (int)cluster_ctarank() : 0;
  const int units = p.M * (TILE / 4), per = (units + S - 1) / S, u1 = min(units, (rank + 1) * per);
  for (int u = rank * per + threadIdx.x; u < u1; u += THREADS) {
    const int m = u / (TILE / 4), q = u % (TILE / 4);
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int src = 0; src < S; ++src) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* at = red + (h * TOK + m) * TILE + 4 * q;
        const float4 v = S > 1 ? ld_cluster_f4(smem_addr(at), src) : *reinterpret_cast<const float4*>(at);
        sum.x += v.x;
        sum.y += v.y;
        sum.z += v.z;
        sum.w += v.w;
      }
    }
    const i64 o = (i64)m * p.rows + tile * TILE + 4 * q;
    if (FMT == FMT_BF16) {
      *reinterpret_cast<float4*>(static_cast<float*>(p.out) + o) = sum;
    } else {
      *reinterpret_cast<uint2*>(static_cast<u16*>(p.out) + o) = make_uint2(bf16x2(sum.x, sum.y), bf16x2(sum.z, sum.w));
    }
  }
  if (S > 1) cluster_sync();  // no CTA leaves while the others read its shared memory
}

// Registers: up to 85 a thread for 8 tokens of bf16 weights (3 CTAs an SM), else 128 up to 32
// tokens (2 CTAs), more for 64.
#define MIN_CTAS(FMT, MT) (FMT == FMT_BF16 && MT == 1 ? 3 : MT <= 4 ? 2 : 1)
// One kernel per K split S: a thread-block cluster of S CTAs (none for S = 1).
#define DSUF_GEMV_SPLIT(name, FMT, MT, S, CLUSTER)                                                          \
  extern "C" __global__ void CLUSTER __launch_bounds__(THREADS, MIN_CTAS(FMT, MT)) name##_s##S(const __grid_constant__ GemvParams p) { \
    pdl_begin();                                                                                            \
    gemv_body<FMT, MT, S>(p);                                                                               \
  }
#define DSUF_GEMV(name, FMT, MT)                                      \
  DSUF_GEMV_SPLIT(name, FMT, MT, 1, )                                 \
  DSUF_GEMV_SPLIT(name, FMT, MT, 2, __cluster_dims__(2, 1, 1))        \
  DSUF_GEMV_SPLIT(name, FMT, MT, 4, __cluster_dims__(4, 1, 1))        \
  DSUF_GEMV_SPLIT(name, FMT, MT, 8, __cluster_dims__(8, 1, 1))

DSUF_GEMV(gemv_bf16_m8, FMT_BF16, 1)
DSUF_GEMV(gemv_bf16_m16, FMT_BF16, 2)
DSUF_GEMV(gemv_bf16_m32, FMT_BF16, 4)
DSUF_GEMV(gemv_bf16_m64, FMT_BF16, 8)
// e4m3 weights with 128x128 E8M0 scales, bf16 out.
DSUF_GEMV(gemv_fp8_m8, FMT_FP8, 1)
DSUF_GEMV(gemv_fp8_m16, FMT_FP8, 2)
DSUF_GEMV(gemv_fp8_m32, FMT_FP8, 4)
DSUF_GEMV(gemv_fp8_m64, FMT_FP8, 8)
