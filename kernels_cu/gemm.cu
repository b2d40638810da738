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
//        k-steps of the chunk: new[16t + 4i + b] = old[16i + 4t + b].
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
#include "common.cuh"

struct GemmParams {
  const u8* w[2];         // weights of mat 0 (or the gate) and mat 1 (the up projection)
  const u8* ws[2];        // their E8M0 scales
  const int* expert;      // [items] expert of each item (FP4), or null
  const u8* xq;           // [rows, K] e4m3 activations
  const float* sx;        // [rows, K/128] activation scales
  const int* x_row;       // [items] activation row of each item's first column, or null (= item)
  const float* route_w;   // [items] weight multiplied into the SwiGLU output, or null (= 1)
  void* out;              // STORE: bf16 [rows_out, N]; SWIGLU: e4m3 [rows_out, N]
  float* out_scale;       // SWIGLU: [rows_out, N/128] scales of `out`
  float* partial;         // split-K partials [items, N/128, mats, splits, cols, 128]
  int* counter;           // [items, N/128] arrivals; zero between launches (the last CTA resets)
  int N, K, cols, splits; // cols: activation rows per item (tokens), at most 8 * MT
  float limit;            // SwiGLU clamp (<= 0: none)
};

enum { FMT_FP8 = 0, FMT_FP4 = 1 };
enum { EPI_STORE_BF16 = 0, EPI_SWIGLU = 1 };

DSUF_DEVICE uint4 ld_nc16(const void* p) {
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

DSUF_DEVICE uint2 ld_nc8(const void* p) {
  uint2 v;
  asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

DSUF_DEVICE u32 ld_nc4(const void* p) {
  u32 v;
  asm("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

DSUF_DEVICE u32 word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// e2m1 codes to e4m3 bytes holding value * 2**-6 (exact: the 3 magnitude bits slide into the
// e4m3 exponent/mantissa fields, subnormals included). Low nibbles (even elements) and high
// nibbles (odd elements) go to separate words.
DSUF_DEVICE u32 e2m1_lo_to_e4m3(u32 w) { return ((w & 0x08080808u) << 4) | ((w & 0x07070707u) << 2); }
DSUF_DEVICE u32 e2m1_hi_to_e4m3(u32 w) { return (w & 0x80808080u) | ((w & 0x70707070u) >> 2); }

// FP8 weights: warp rows [row0, row0 + 16), K blocks [kb0, kb1). acc[j] holds columns j*8 + ...
template <int MT>
DSUF_DEVICE void fp8_tile(const GemmParams& p, const u8* w, const u8* ws_row, int row0, int kb0,
                          int kb1, int x0, float acc[MT][4]) {
  constexpr int U = MT == 1 ? 3 : MT == 2 ? 2 : 1;  // K blocks in flight per lane
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int K = p.K, KB = K >> 7;
  const u8* wa = w + (i64)(row0 + g) * K + 16 * t;
  const u8* wb = wa + 8 * (i64)K;
  for (int kb = kb0; kb < kb1; kb += U) {
    uint4 A[U][4], X[U][MT][2];
    float sxa[U][MT], sxb[U][MT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (kb + u >= kb1) break;
      const i64 off = (i64)(kb + u) * 128;
      A[u][0] = ld_stream(wa + off);
      A[u][1] = ld_stream(wa + off + 64);
      A[u][2] = ld_stream(wb + off);
      A[u][3] = ld_stream(wb + off + 64);
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        const int c = j * 8 + g, ca = j * 8 + 2 * t;
        X[u][j][0] = X[u][j][1] = make_uint4(0, 0, 0, 0);
        if (c < p.cols) {
          const u8* xp = p.xq + (i64)(x0 + c) * K + off + 16 * t;
          X[u][j][0] = ld_nc16(xp);
          X[u][j][1] = ld_nc16(xp + 64);
        }
        sxa[u][j] = ca < p.cols ? p.sx[(i64)(x0 + ca) * KB + kb + u] : 0.0f;
        sxb[u][j] = ca + 1 < p.cols ? p.sx[(i64)(x0 + ca + 1) * KB + kb + u] : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (kb + u >= kb1) break;
      const float sw = e8m0_to_f32(ws_row[kb + u]);
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        float d[4];
        // Step s uses words 2s, 2s+1 of the lane's 32 bytes (16 at +16t, 16 at +64+16t).
        mma_e4m3(d, A[u][0].x, A[u][2].x, A[u][0].y, A[u][2].y, X[u][j][0].x, X[u][j][0].y);
        mma_e4m3_acc(d, A[u][0].z, A[u][2].z, A[u][0].w, A[u][2].w, X[u][j][0].z, X[u][j][0].w);
        mma_e4m3_acc(d, A[u][1].x, A[u][3].x, A[u][1].y, A[u][3].y, X[u][j][1].x, X[u][j][1].y);
        mma_e4m3_acc(d, A[u][1].z, A[u][3].z, A[u][1].w, A[u][3].w, X[u][j][1].z, X[u][j][1].w);
        const float s0 = sw * sxa[u][j], s1 = sw * sxb[u][j];
        acc[j][0] += d[0] * s0;
        acc[j][1] += d[1] * s1;
        acc[j][2] += d[2] * s0;
        acc[j][3] += d[3] * s1;
      }
    }
  }
}

// FP4 weights (permuted chunks, per-32 scales): warp rows [row0, row0 + 16), 128-element chunks
// [kc0, kc1). A fresh mma per 32-element k-step, since every step has its own weight scale.
template <int MT>
DSUF_DEVICE void fp4_tile(const GemmParams& p, const u8* w, const u8* ws, int row0, int kc0,
                          int kc1, int x0, float acc[MT][4]) {
  constexpr int U = 4;  // 128-element chunks in flight per lane
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int K = p.K, KB = K >> 7;
  const u8* wa = w + (i64)(row0 + g) * (K >> 1) + 16 * t;
  const u8* wb = wa + 8 * (i64)(K >> 1);
  const u8* sa = ws + (i64)(row0 + g) * (K >> 5);
  const u8* sb = sa + 8 * (i64)(K >> 5);
  for (int kc = kc0; kc < kc1; kc += U) {
    uint4 A[U][2];
    u32 S[U][2];
    uint2 X[U][MT][4];
    float sxa[U][MT], sxb[U][MT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (kc + u >= kc1) break;
      A[u][0] = ld_stream(wa + (i64)(kc + u) * 64);
      A[u][1] = ld_stream(wb + (i64)(kc + u) * 64);
      S[u][0] = ld_nc4(sa + (kc + u) * 4);
      S[u][1] = ld_nc4(sb + (kc + u) * 4);
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        const int c = j * 8 + g, ca = j * 8 + 2 * t;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          X[u][j][i] = make_uint2(0, 0);
          if (c < p.cols) X[u][j][i] = ld_nc8(p.xq + (i64)(x0 + c) * K + (kc + u) * 128 + 32 * i + 8 * t);
        }
        sxa[u][j] = ca < p.cols ? 64.0f * p.sx[(i64)(x0 + ca) * KB + kc + u] : 0.0f;
        sxb[u][j] = ca + 1 < p.cols ? 64.0f * p.sx[(i64)(x0 + ca + 1) * KB + kc + u] : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (kc + u >= kc1) break;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 wg = word(A[u][0], i), wg8 = word(A[u][1], i);
        const u32 a0 = e2m1_lo_to_e4m3(wg), a1 = e2m1_lo_to_e4m3(wg8);
        const u32 a2 = e2m1_hi_to_e4m3(wg), a3 = e2m1_hi_to_e4m3(wg8);
        const float swg = e8m0_to_f32((S[u][0] >> (8 * i)) & 0xff);
        const float swg8 = e8m0_to_f32((S[u][1] >> (8 * i)) & 0xff);
#pragma unroll
        for (int j = 0; j < MT; ++j) {
          float d[4];
          // Logical k 4t+b <-> element 8t+2b of the step (low nibbles), 16+4t+b <-> 8t+2b+1.
          const u32 b0 = __byte_perm(X[u][j][i].x, X[u][j][i].y, 0x6420);
          const u32 b1 = __byte_perm(X[u][j][i].x, X[u][j][i].y, 0x7531);
          mma_e4m3(d, a0, a1, a2, a3, b0, b1);
          acc[j][0] += d[0] * (swg * sxa[u][j]);
          acc[j][1] += d[1] * (swg * sxb[u][j]);
          acc[j][2] += d[2] * (swg8 * sxa[u][j]);
          acc[j][3] += d[3] * (swg8 * sxb[u][j]);
        }
      }
    }
  }
}

DSUF_DEVICE float silu_f64(float g) {
  const double x = g;
  return (float)(x / (1.0 + exp(-x)));
}

template <int FMT, int MT, int EPI>
DSUF_DEVICE void gemm_body(const GemmParams& p) {
  constexpr int MATS = EPI == EPI_SWIGLU ? 2 : 1;
  __shared__ float red[8 * MT * 128];  // [col][row] of this CTA's 128 x cols tile
  __shared__ int last;

  const int rb = blockIdx.x, mat = blockIdx.y / p.splits, split = blockIdx.y % p.splits;
  const int item = blockIdx.z, NB = p.N >> 7, KB = p.K >> 7;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int e = p.expert ? p.expert[item] : 0;
  const int x0 = p.x_row ? p.x_row[item] : item;
  const int kb0 = (int)((i64)split * KB / p.splits), kb1 = (int)((i64)(split + 1) * KB / p.splits);
  const int row0 = rb * 128 + warp * 16;

  float acc[MT][4];
#pragma unroll
  for (int j = 0; j < MT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  if (FMT == FMT_FP8) {
    fp8_tile<MT>(p, p.w[mat], p.ws[mat] + (i64)rb * KB, row0, kb0, kb1, x0, acc);
  } else {
    const u8* w = p.w[mat] + (i64)e * p.N * (p.K >> 1);
    const u8* ws = p.ws[mat] + (i64)e * p.N * (p.K >> 5);
    fp4_tile<MT>(p, w, ws, row0, kb0, kb1, x0, acc);
  }

  const int r = warp * 16 + g;
#pragma unroll
  for (int j = 0; j < MT; ++j) {
    const int c = j * 8 + 2 * t;
    red[c * 128 + r] = acc[j][0];
    red[(c + 1) * 128 + r] = acc[j][1];
    red[c * 128 + r + 8] = acc[j][2];
    red[(c + 1) * 128 + r + 8] = acc[j][3];
  }
  __syncthreads();

  const int parts = MATS * p.splits;
  const i64 tile = (i64)item * NB + rb;
  const i64 stride = (i64)p.cols * 128;  // one partial
  float* part = p.partial + tile * parts * stride;
  if (parts > 1) {
    float* mine = part + (i64)(mat * p.splits + split) * stride;
    for (int i = threadIdx.x; i < p.cols * 128; i += blockDim.x) mine[i] = red[i];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      last = atomicAdd(p.counter + tile, 1) == parts - 1;
      if (last) p.counter[tile] = 0;  // every other CTA has arrived: ready for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
  }

  // Epilogue: one warp per column (token); a lane owns 4 consecutive rows.
  for (int c = warp; c < p.cols; c += 8) {
    float v[MATS][4];
#pragma unroll
    for (int m = 0; m < MATS; ++m) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int rr = lane * 4 + i;
        if (parts == 1) {
          v[m][i] = red[c * 128 + rr];
        } else {
          float s = 0.0f;
          for (int k = 0; k < p.splits; ++k) s += __ldcg(part + (i64)(m * p.splits + k) * stride + c * 128 + rr);
          v[m][i] = s;
        }
      }
    }
    const int orow = item + c;
    const i64 at = (i64)orow * p.N + rb * 128 + lane * 4;
    if (EPI == EPI_STORE_BF16) {
      const u32 lo = f32_to_bf16(v[0][0]) | ((u32)f32_to_bf16(v[0][1]) << 16);
      const u32 hi = f32_to_bf16(v[0][2]) | ((u32)f32_to_bf16(v[0][3]) << 16);
      *reinterpret_cast<uint2*>(static_cast<u16*>(p.out) + at) = make_uint2(lo, hi);
    } else {
      // The reference Expert: clamp, silu(gate) * up in fp32 (silu in float64), times the routing
      // weight, rounded to bf16, then w2's per-128 act_quant, whose block is exactly this tile.
      const float rw = p.route_w ? p.route_w[item] : 1.0f;
      float h[4], amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float gate = v[0][i], up = v[1][i];
        if (p.limit > 0.0f) {
          up = fminf(fmaxf(up, -p.limit), p.limit);
          gate = fminf(gate, p.limit);
        }
        h[i] = bf16_to_f32(f32_to_bf16(rw * (silu_f64(gate) * up)));
        amax = fmaxf(amax, fabsf(h[i]));
      }
      const int ex = act_scale_exponent(warp_max(amax));
      *reinterpret_cast<u32*>(static_cast<u8*>(p.out) + at) = quant4_e4m3(h[0], h[1], h[2], h[3], ex);
      if (lane == 0) p.out_scale[(i64)orow * NB + rb] = pow2f(ex);
    }
  }
}

// Up to 128 registers a thread (2 CTAs an SM) for one token tile; more tiles need more.
#define DSUF_GEMM(name, FMT, MT, EPI)                                                  \
  extern "C" __global__ void __launch_bounds__(256, MT == 1 ? 2 : 1)                  \
      name(const __grid_constant__ GemmParams p) {                                    \
    gemm_body<FMT, MT, EPI>(p);                                                        \
  }

// Dense FP8 linears for up to 8 * MT tokens (attention projections, the shared expert's w2).
DSUF_GEMM(fp8_gemm_bf16_m8, FMT_FP8, 1, EPI_STORE_BF16)
DSUF_GEMM(fp8_gemm_bf16_m16, FMT_FP8, 2, EPI_STORE_BF16)
DSUF_GEMM(fp8_gemm_bf16_m24, FMT_FP8, 3, EPI_STORE_BF16)
DSUF_GEMM(fp8_gemm_bf16_m32, FMT_FP8, 4, EPI_STORE_BF16)
// The shared expert's w1/w3 with the SwiGLU epilogue, output ready for w2.
DSUF_GEMM(fp8_swiglu_m8, FMT_FP8, 1, EPI_SWIGLU)
DSUF_GEMM(fp8_swiglu_m16, FMT_FP8, 2, EPI_SWIGLU)
DSUF_GEMM(fp8_swiglu_m24, FMT_FP8, 3, EPI_SWIGLU)
DSUF_GEMM(fp8_swiglu_m32, FMT_FP8, 4, EPI_SWIGLU)
// Routed FP4 experts, one (expert, token) pair per item.
DSUF_GEMM(fp4_swiglu_pairs, FMT_FP4, 1, EPI_SWIGLU)
DSUF_GEMM(fp4_gemm_bf16_pairs, FMT_FP4, 1, EPI_STORE_BF16)
