// Manifold-constrained hyper-connections (mHC) at decode, as layers.HyperConnection and
// layers.hc_expand compute them (n = 4 streams of D):
//   hc_mixes:        mix[t, r] = f32(flat_t . fn_r) * f32(1 / sqrt(mean(flat_t^2) + eps)), flat_t
//                    the n*D stream values, float64 sums; grid (rows of fn, token groups), 512
//                    threads. Each CTA has the copy engine bring its row of fn into shared memory
//                    before it waits for the kernel before it (the weights are constant), so the
//                    row's 64 KB arrive while that kernel still runs; then it takes tokens
//                    blockIdx.y, + gridDim.y, ...
//   hc_coefficients: pre = f32(sigmoid(mix * scale0 + base)) + hc_eps; post = 2 f32(sigmoid(..));
//                    comb = Sinkhorn of softmax(logits) in float64 (row/column normalisation,
//                    `iters` rounds in all); grid (T), one warp (lane 4j + k holds comb[j, k]).
//   hc_expand:       X'_k = f32(post_k * out) + f32(sum_j comb[j, k] X_j (float64)), to bf16;
//                    grid (D / 2048, T), 256 threads x 8 dims.
//   hc_sum_squares:  a prompt chunk's sum(flat_t^2) in float64 (its dots: a float64 matmul).
// At decode a site's block input rms_norm(hc_collapse(X, pre)) needs only the mixes and pre:
// rmsnorm.cu's hc_pre_collapse_rmsnorm_bf16 takes the mixes and forms pre itself, while
// hc_coefficients makes post and comb (used only at the site's expand) on another stream.
// Float32 products and sums are written with __fmul_rn / __fadd_rn so that none is contracted to
// an FMA: the reference rounds each of them.
#include "mhc.cuh"

#define MIX_THREADS 512
#define MIX_UNROLL 4  // chunks of 8 a thread has in flight

extern "C" __global__ void __launch_bounds__(MIX_THREADS) hc_mixes(
    const u16* __restrict__ x, const float* __restrict__ fn, float* __restrict__ mix, int D, int T, double eps) {
  extern __shared__ __align__(16) float fs[];  // the CTA's row of fn [n * D]
  __shared__ u64 bar;
  __shared__ double part[2][MIX_THREADS / 32];
  const int r = blockIdx.x, rows = gridDim.x, len = HC_N * D;
  if (threadIdx.x == 0) {
    mbar_init(&bar);
    mbar_expect_bytes(&bar, len * 4);
    bulk_copy(fs, fn + (i64)r * len, len * 4, &bar);
  }
  pdl_begin();
  __syncthreads();
  mbar_wait(&bar, 0);
  for (int tok = blockIdx.y; tok < T; tok += gridDim.y) {
    const u16* xt = x + (i64)tok * len;
    double dot = 0.0, sq = 0.0;
    for (int i0 = 8 * threadIdx.x; i0 < len; i0 += 8 * MIX_THREADS * MIX_UNROLL) {
      uint4 xv[MIX_UNROLL];
#pragma unroll
      for (int u = 0; u < MIX_UNROLL; ++u) {  // every load of the round issued before any math
        const int i = i0 + 8 * MIX_THREADS * u;
        xv[u] = i < len ? *reinterpret_cast<const uint4*>(xt + i) : make_uint4(0, 0, 0, 0);  // zeros add nothing
      }
#pragma unroll
      for (int u = 0; u < MIX_UNROLL; ++u) {
        const int i = i0 + 8 * MIX_THREADS * u;
        if (i >= len) break;
        const u32 xw[4] = {xv[u].x, xv[u].y, xv[u].z, xv[u].w};
        const float4 f0 = *reinterpret_cast<const float4*>(fs + i), f1 = *reinterpret_cast<const float4*>(fs + i + 4);
        const float fv[8] = {f0.x, f0.y, f0.z, f0.w, f1.x, f1.y, f1.z, f1.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const double v = bf16_to_f32(k & 1 ? xw[k >> 1] >> 16 : xw[k >> 1] & 0xffff);
          dot += v * (double)fv[k];
          sq += v * v;
        }
      }
    }
    dot = warp_sum(dot);
    sq = warp_sum(sq);
    if ((threadIdx.x & 31) == 0) {
      part[0][threadIdx.x >> 5] = dot;
      part[1][threadIdx.x >> 5] = sq;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double d = 0.0, s = 0.0;
      for (int w = 0; w < MIX_THREADS / 32; ++w) d += part[0][w], s += part[1][w];
      const float rs = (float)(1.0 / sqrt(s / len + eps));
      mix[(i64)tok * rows + r] = __fmul_rn((float)d, rs);
    }
    __syncthreads();  // part is read before the next token writes it
  }
}

// A prompt chunk's RMS statistic of the mixes: ssq[t] = sum of x[t, :]^2 over the n*D stream
// values in float64 (their dot products with fn are a float64 matmul); x [T, L] bf16, L % 8 == 0;
// grid (T), 256 threads. (The reference squares a float64 copy of the streams, then averages.)
extern "C" __global__ void __launch_bounds__(256) hc_sum_squares(const u16* __restrict__ x, double* __restrict__ ssq, int L) {
  __shared__ double part[8];
  pdl_begin();
  const u16* row = x + (i64)blockIdx.x * L;
  double s = 0.0;
  for (int i = 8 * threadIdx.x; i < L; i += 8 * 256) {
    const uint4 v = *reinterpret_cast<const uint4*>(row + i);
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const double f = bf16_to_f32(k & 1 ? w[k >> 1] >> 16 : w[k >> 1] & 0xffff);
      s += f * f;
    }
  }
  s = warp_sum(s);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int w = 0; w < 8; ++w) t += part[w];
    ssq[blockIdx.x] = t;
  }
}

extern "C" __global__ void __launch_bounds__(32) hc_coefficients(
    const float* __restrict__ mix, const float* __restrict__ scale, const float* __restrict__ base,
    float* __restrict__ pre, float* __restrict__ post, float* __restrict__ comb, float hc_eps, int iters) {
  pdl_begin();
  const int tok = blockIdx.x, lane = threadIdx.x;
  const float* m = mix + (i64)tok * HC_MIXES;
  if (lane < HC_N) {
    pre[tok * HC_N + lane] = hc_pre_value(m[lane], scale[0], base[lane], hc_eps);
  } else if (lane < 2 * HC_N) {
    const float z = __fadd_rn(__fmul_rn(m[lane], scale[1]), base[lane]);
    post[tok * HC_N + lane - HC_N] = 2.0f * (float)sigmoid_f64(z);
  }
  const int c = lane & 15;  // comb[j, k], j = c / 4, k = c % 4
  const double logit = __fadd_rn(__fmul_rn(m[2 * HC_N + c], scale[2]), base[2 * HC_N + c]);
  const double eps = hc_eps;
  double mx = fmax(logit, __shfl_xor_sync(0xffffffffu, logit, 1));
  mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  double v = exp(logit - mx);
  double row = v + __shfl_xor_sync(0xffffffffu, v, 1);
  row += __shfl_xor_sync(0xffffffffu, row, 2);
  v = v / row + eps;  // softmax over k, + eps
  double col = v + __shfl_xor_sync(0xffffffffu, v, 4);
  col += __shfl_xor_sync(0xffffffffu, col, 8);
  v = v / (col + eps);
  for (int it = 1; it < iters; ++it) {
    row = v + __shfl_xor_sync(0xffffffffu, v, 1);
    row += __shfl_xor_sync(0xffffffffu, row, 2);
    v = v / (row + eps);
    col = v + __shfl_xor_sync(0xffffffffu, v, 4);
    col += __shfl_xor_sync(0xffffffffu, col, 8);
    v = v / (col + eps);
  }
  if (lane < 16) comb[tok * HC_N * HC_N + c] = (float)v;
}

extern "C" __global__ void __launch_bounds__(256) hc_expand(
    const u16* __restrict__ out, const u16* __restrict__ x, const float* __restrict__ post,
    const float* __restrict__ comb, u16* __restrict__ y, int D) {
  pdl_begin();
  const int tok = blockIdx.y, d = (blockIdx.x * 256 + threadIdx.x) * 8;
  if (d >= D) return;
  float o[8];
  const uint4 ov = *reinterpret_cast<const uint4*>(out + (i64)tok * D + d);
  const u32 ow[4] = {ov.x, ov.y, ov.z, ov.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = bf16_to_f32(i & 1 ? ow[i >> 1] >> 16 : ow[i >> 1] & 0xffff);
  hc_expand8(o, x, post, comb, y, tok, d, D);
}
