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
//   hc_chunk_mixes:  hc_mixes for a prompt chunk (8 tokens a CTA).
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

// hc_chunk_mixes: a prompt chunk's mixes, the sums of hc_mixes (float64 products of the bf16
// stream values and float32 fn, and of their squares) in another order. x [T, L] bf16 (L = n*D, a
// multiple of CM_CHUNK), fn [HC_MIXES, L]; grid (T / CM_TOKENS rounded up), 128 threads: warp w
// takes fn rows CM_ROWS w .. + CM_ROWS for the CTA's tokens, staged as double in shared memory
// CM_CHUNK values at a time, and the squares of tokens 2w, 2w + 1.
#define CM_TOKENS 8
#define CM_CHUNK 256
#define CM_ROWS (HC_MIXES / 4)
// Where value i of a token's chunk sits: each 16-value block's order XOR-ed with the block's
// number, so that the staging stores (a thread writes 16 consecutive values) and the loads (a
// lane reads every 32nd) both spread over the banks.
#define CM_AT(i) ((i) ^ (((i) >> 4) & 15))

extern "C" __global__ void __launch_bounds__(128) hc_chunk_mixes(
    const u16* __restrict__ x, const float* __restrict__ fn, float* __restrict__ mix, int L, int T, double eps) {
  __shared__ double xs[CM_TOKENS][CM_CHUNK];
  __shared__ double ssq[CM_TOKENS];
  pdl_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t0 = blockIdx.x * CM_TOKENS;
  const float* fw = fn + (i64)CM_ROWS * warp * L;
  double acc[CM_TOKENS][CM_ROWS], sq[2] = {0.0, 0.0};
#pragma unroll
  for (int t = 0; t < CM_TOKENS; ++t)
#pragma unroll
    for (int r = 0; r < CM_ROWS; ++r) acc[t][r] = 0.0;
  const int st = threadIdx.x >> 4, se = (threadIdx.x & 15) * 16;  // staging: token st, values se ..
  for (int c0 = 0; c0 < L; c0 += CM_CHUNK) {
    uint4 v[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};  // past T: zeros
    if (t0 + st < T) {
      const u16* src = x + (i64)(t0 + st) * L + c0 + se;
      v[0] = *reinterpret_cast<const uint4*>(src);
      v[1] = *reinterpret_cast<const uint4*>(src + 8);
    }
    __syncthreads();  // the previous chunk is no longer read
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u32 w[4] = {v[h].x, v[h].y, v[h].z, v[h].w};
#pragma unroll
      for (int k = 0; k < 8; ++k) xs[st][CM_AT(se + 8 * h + k)] = bf16_to_f32(k & 1 ? w[k >> 1] >> 16 : w[k >> 1] & 0xffff);
    }
    __syncthreads();
#pragma unroll 2
    for (int e = 0; e < CM_CHUNK / 32; ++e) {
      const int i = 32 * e + lane, at = CM_AT(i);
      double f[CM_ROWS];
#pragma unroll
      for (int r = 0; r < CM_ROWS; ++r) f[r] = fw[(i64)r * L + c0 + i];
#pragma unroll
      for (int t = 0; t < CM_TOKENS; ++t) {
        const double xv = xs[t][at];
#pragma unroll
        for (int r = 0; r < CM_ROWS; ++r) acc[t][r] += xv * f[r];
      }
      sq[0] += xs[2 * warp][at] * xs[2 * warp][at];
      sq[1] += xs[2 * warp + 1][at] * xs[2 * warp + 1][at];
    }
  }
  sq[0] = warp_sum(sq[0]);
  sq[1] = warp_sum(sq[1]);
  if (lane == 0) ssq[2 * warp] = sq[0], ssq[2 * warp + 1] = sq[1];
  __syncthreads();
#pragma unroll
  for (int t = 0; t < CM_TOKENS; ++t) {
    const float rs = (float)(1.0 / sqrt(ssq[t] / L + eps));
#pragma unroll
    for (int r = 0; r < CM_ROWS; ++r) {
      const double d = warp_sum(acc[t][r]);
      if (lane == 0 && t0 + t < T) mix[(i64)(t0 + t) * HC_MIXES + CM_ROWS * warp + r] = __fmul_rn((float)d, rs);
    }
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
