// Manifold-constrained hyper-connections (mHC) at decode, as layers.HyperConnection and
// layers.hc_expand compute them (n = 4 streams of D):
//   hc_mixes:        mix[t, r] = f32(flat_t . fn_r) * f32(1 / sqrt(mean(flat_t^2) + eps)), flat_t
//                    the n*D stream values, float64 sums; grid (rows of fn, T), 512 threads.
//   hc_coefficients: pre = f32(sigmoid(mix * scale0 + base)) + hc_eps; post = 2 f32(sigmoid(..));
//                    comb = Sinkhorn of softmax(logits) in float64 (row/column normalisation,
//                    `iters` rounds in all); grid (T), one warp (lane 4j + k holds comb[j, k]).
//   hc_expand:       X'_k = f32(post_k * out) + f32(sum_j comb[j, k] X_j (float64)), to bf16;
//                    grid (D / 2048, T), 256 threads x 8 dims.
//   hc_pre:          the mixes, pre and the block input rms_norm(hc_collapse(X, pre)) in one launch
//                    (below); post and comb, needed only at the site's expand, come from
//                    hc_coefficients on another stream meanwhile.
// Float32 products and sums are written with __fmul_rn / __fadd_rn so that none is contracted to
// an FMA: the reference rounds each of them.
#include "hc_expand.cuh"

#define MIX_THREADS 512
#define MIX_UNROLL 4  // chunks of 8 a thread has in flight

extern "C" __global__ void __launch_bounds__(MIX_THREADS) hc_mixes(
    const u16* __restrict__ x, const float* __restrict__ fn, float* __restrict__ mix, int D, double eps) {
  pdl_begin();
  __shared__ double part[2][MIX_THREADS / 32];
  const int r = blockIdx.x, tok = blockIdx.y, rows = gridDim.x, len = HC_N * D;
  const u16* xt = x + (i64)tok * len;
  const float* f = fn + (i64)r * len;
  double dot = 0.0, sq = 0.0;
  for (int i0 = 8 * threadIdx.x; i0 < len; i0 += 8 * MIX_THREADS * MIX_UNROLL) {
    uint4 xv[MIX_UNROLL];
    float4 f0[MIX_UNROLL], f1[MIX_UNROLL];
#pragma unroll
    for (int u = 0; u < MIX_UNROLL; ++u) {  // every load of the round issued before any math
      const int i = i0 + 8 * MIX_THREADS * u;
      const bool in = i < len;  // zeros past the end add nothing
      xv[u] = in ? *reinterpret_cast<const uint4*>(xt + i) : make_uint4(0, 0, 0, 0);
      f0[u] = in ? *reinterpret_cast<const float4*>(f + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      f1[u] = in ? *reinterpret_cast<const float4*>(f + i + 4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < MIX_UNROLL; ++u) {
      const u32 xw[4] = {xv[u].x, xv[u].y, xv[u].z, xv[u].w};
      const float fv[8] = {f0[u].x, f0[u].y, f0[u].z, f0[u].w, f1[u].x, f1[u].y, f1[u].z, f1[u].w};
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
}

DSUF_DEVICE double sigmoid_f64(double z) { return 1.0 / (1.0 + exp(-z)); }

// pre_i from the site's mix i (i < n).
DSUF_DEVICE float hc_pre_value(float mix, float scale0, float base, float hc_eps) {
  const float z = __fadd_rn(__fmul_rn(mix, scale0), base);
  return __fadd_rn((float)sigmoid_f64(z), hc_eps);
}

extern "C" __global__ void __launch_bounds__(32) hc_coefficients(
    const float* __restrict__ mix, const float* __restrict__ scale, const float* __restrict__ base,
    float* __restrict__ pre, float* __restrict__ post, float* __restrict__ comb, float hc_eps, int iters) {
  pdl_begin();
  const int tok = blockIdx.x, lane = threadIdx.x;
  const float* m = mix + (i64)tok * (2 + HC_N) * HC_N;
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

// hc_pre: a cluster of PRE_CLUSTER CTAs per token (tokens blockIdx.y, + gridDim.y, ...).
//  1. Before waiting for the kernel before it, each CTA has the copy engine bring its slice of fn
//     (the 24 rows x len / PRE_CLUSTER of the flattened streams) into shared memory: the weights
//     are constant, so their 1.5 MB arrive while the previous kernel still runs.
//  2. Partial dot products and the sum of squares over the slice in float64; the CTAs exchange
//     their partials through distributed shared memory and every CTA sums them in rank order, so
//     all hold the same mixes; pre from the first n.
//  3. Each CTA collapses D / PRE_CLUSTER dims (float64 sums, rounded to float32 then bf16), the
//     sum of squares goes round the cluster the same way, and it writes its dims of
//     y = bf16(w * (y * r)), as hc_collapse_rmsnorm_bf16 does. The mixes go to `mix` for
//     hc_coefficients.
#define PRE_CLUSTER 8
#define PRE_THREADS 256
#define PRE_MIXES ((2 + HC_N) * HC_N)

struct HcPreParams {
  const u16* x;         // [T, n, D] bf16 streams
  const float* fn;      // [24, n * D]
  const float* scale;   // [3]
  const float* base;    // [24]
  const float* norm_w;  // [D]
  u16* y;               // [T, D] bf16: the block's input
  float* mix;           // [T, 24]
  double mix_eps;
  float norm_eps, hc_eps;
  int D, T;
};

extern "C" __global__ void __cluster_dims__(PRE_CLUSTER, 1, 1) __launch_bounds__(PRE_THREADS, 1)
    hc_pre(const __grid_constant__ HcPreParams p) {
  extern __shared__ __align__(16) float fs[];  // [24][slice]
  __shared__ u64 bar;
  __shared__ double red[PRE_THREADS / 32][PRE_MIXES + 1];
  __shared__ double part[PRE_MIXES + 1], total[PRE_MIXES + 1], part_ss;
  __shared__ float pre[HC_N];
  const u32 rank = cluster_ctarank();
  const int len = HC_N * p.D, slice = len / PRE_CLUSTER, dims = p.D / PRE_CLUSTER;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    mbar_init(&bar);
    mbar_expect_bytes(&bar, PRE_MIXES * slice * 4);
    for (int r = 0; r < PRE_MIXES; ++r) bulk_copy(fs + r * slice, p.fn + (i64)r * len + rank * slice, slice * 4, &bar);
  }
  pdl_begin();
  __syncthreads();
  mbar_wait(&bar, 0);

  for (int tok = blockIdx.y; tok < p.T; tok += gridDim.y) {
    const u16* xt = p.x + (i64)tok * len;
    double dot[PRE_MIXES], sq = 0.0;
#pragma unroll
    for (int r = 0; r < PRE_MIXES; ++r) dot[r] = 0.0;
    for (int i = 8 * threadIdx.x; i < slice; i += 8 * PRE_THREADS) {
      const uint4 raw = *reinterpret_cast<const uint4*>(xt + rank * slice + i);
      const u32 q[4] = {raw.x, raw.y, raw.z, raw.w};
      double v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        v[k] = bf16_to_f32(k & 1 ? q[k >> 1] >> 16 : q[k >> 1] & 0xffff);
        sq += v[k] * v[k];
      }
#pragma unroll
      for (int r = 0; r < PRE_MIXES; ++r) {
        const float4 a = *reinterpret_cast<const float4*>(fs + r * slice + i);
        const float4 b = *reinterpret_cast<const float4*>(fs + r * slice + i + 4);
        const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) dot[r] += v[k] * (double)f[k];
      }
    }
#pragma unroll
    for (int r = 0; r < PRE_MIXES; ++r) dot[r] = warp_sum(dot[r]);
    sq = warp_sum(sq);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < PRE_MIXES; ++r) red[warp][r] = dot[r];
      red[warp][PRE_MIXES] = sq;
    }
    __syncthreads();
    if (threadIdx.x <= PRE_MIXES) {
      double s = 0.0;
      for (int w = 0; w < PRE_THREADS / 32; ++w) s += red[w][threadIdx.x];
      part[threadIdx.x] = s;
    }
    cluster_sync();
    if (threadIdx.x <= PRE_MIXES) {
      double s = 0.0;
      for (int src = 0; src < PRE_CLUSTER; ++src) s += ld_cluster_f64(smem_addr(&part[threadIdx.x]), src);
      total[threadIdx.x] = s;
    }
    __syncthreads();
    if (threadIdx.x < PRE_MIXES) {
      const float rs = (float)(1.0 / sqrt(total[PRE_MIXES] / len + p.mix_eps));
      const float m = __fmul_rn((float)total[threadIdx.x], rs);
      if (rank == 0) p.mix[(i64)tok * PRE_MIXES + threadIdx.x] = m;
      if (threadIdx.x < HC_N) pre[threadIdx.x] = hc_pre_value(m, p.scale[0], p.base[threadIdx.x], p.hc_eps);
    }
    __syncthreads();

    const int d = rank * dims + 8 * threadIdx.x;
    const bool mine = 8 * threadIdx.x < dims;
    float y[8];
    double ss = 0.0;
    if (mine) {
      double s[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
#pragma unroll
      for (int i = 0; i < HC_N; ++i) {
        const double w = pre[i];
        const uint4 raw = *reinterpret_cast<const uint4*>(xt + (i64)i * p.D + d);
        const u32 q[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) s[k] += w * (double)bf16_to_f32(k & 1 ? q[k >> 1] >> 16 : q[k >> 1] & 0xffff);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        y[k] = bf16_to_f32(f32_to_bf16((float)s[k]));
        ss += (double)y[k] * (double)y[k];
      }
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp][0] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
      double s = 0.0;
      for (int w = 0; w < PRE_THREADS / 32; ++w) s += red[w][0];
      part_ss = s;
    }
    cluster_sync();
    double all = 0.0;
    for (int src = 0; src < PRE_CLUSTER; ++src) all += ld_cluster_f64(smem_addr(&part_ss), src);
    const float r = (float)(1.0 / sqrt(all / p.D + (double)p.norm_eps));
    if (mine) {
      u32 o[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float a = p.norm_w[d + 2 * k] * (y[2 * k] * r), b = p.norm_w[d + 2 * k + 1] * (y[2 * k + 1] * r);
        o[k] = f32_to_bf16(a) | ((u32)f32_to_bf16(b) << 16);
      }
      *reinterpret_cast<uint4*>(p.y + (i64)tok * p.D + d) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  cluster_sync();  // no CTA leaves while another still reads its shared memory
}
