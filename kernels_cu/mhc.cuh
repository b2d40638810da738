// mHC device code shared by mhc.cu, rmsnorm.cu and collective.cu.
//
// The mHC stream update of 8 consecutive dims of one token (layers.hc_expand):
//   X'_k = f32(post_k * out) + f32(sum_j comb[j, k] X_j (float64)), to bf16,
// given the sublayer output `o` (8 floats, already rounded to bf16 values) at dims d .. d + 7.
// (mhc.cu's hc_expand and collective.cu's all-reduce fused with it).
#pragma once
#include "common.cuh"

#define HC_N 4
#define HC_MIXES ((2 + HC_N) * HC_N)  // a site's mixes: pre, post, then the n x n comb logits

DSUF_DEVICE double sigmoid_f64(double z) { return 1.0 / (1.0 + exp(-z)); }

// pre_i from the site's mix i (i < n): f32(sigmoid(mix * scale0 + base)) + hc_eps.
DSUF_DEVICE float hc_pre_value(float mix, float scale0, float base, float hc_eps) {
  const float z = __fadd_rn(__fmul_rn(mix, scale0), base);
  return __fadd_rn((float)sigmoid_f64(z), hc_eps);
}

// A site's mix (hc_mixes, hc_block_input_bf16): a thread's share of flat . fn_r and of flat^2 in
// float64, 8 stream values x (bf16) against their 8 fn values f (float32) at a time ...
DSUF_DEVICE void hc_mix_add8(const uint4& x, const float* f, double& dot, double& sq) {
  const u32 xw[4] = {x.x, x.y, x.z, x.w};
  const float4 f0 = *reinterpret_cast<const float4*>(f), f1 = *reinterpret_cast<const float4*>(f + 4);
  const float fv[8] = {f0.x, f0.y, f0.z, f0.w, f1.x, f1.y, f1.z, f1.w};
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const double v = bf16_to_f32(k & 1 ? xw[k >> 1] >> 16 : xw[k >> 1] & 0xffff);
    dot += v * (double)fv[k];
    sq += v * v;
  }
}

// ... then the CTA's sums (part: WARPS x 2 doubles of shared memory), returned to thread 0 (the
// others get 0) ...
template <int WARPS>
DSUF_DEVICE double2 hc_mix_sums(double dot, double sq, double (&part)[2][WARPS]) {
  dot = warp_sum(dot);
  sq = warp_sum(sq);
  if ((threadIdx.x & 31) == 0) {
    part[0][threadIdx.x >> 5] = dot;
    part[1][threadIdx.x >> 5] = sq;
  }
  __syncthreads();
  double d = 0.0, s = 0.0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < WARPS; ++w) d += part[0][w], s += part[1][w];
  }
  return make_double2(d, s);
}

// ... and the mix from the sums over len values: f32(dot) * f32(1 / sqrt(mean + eps)).
DSUF_DEVICE float hc_mix_value(double dot, double sq, int len, double eps) { return __fmul_rn((float)dot, (float)(1.0 / sqrt(sq / len + eps))); }

// hc_mix_sums and hc_mix_value in one: the mix to thread 0 (the others get 0).
template <int WARPS>
DSUF_DEVICE float hc_mix_total(double dot, double sq, double (&part)[2][WARPS], int len, double eps) {
  const double2 sums = hc_mix_sums(dot, sq, part);
  return threadIdx.x ? 0.0f : hc_mix_value(sums.x, sums.y, len, eps);
}

DSUF_DEVICE void hc_expand8(const float o[8], const u16* __restrict__ x, const float* __restrict__ post,
                            const float* __restrict__ comb, u16* __restrict__ y, int tok, int d, int D) {
  float cm[HC_N][HC_N], pk[HC_N];
#pragma unroll
  for (int j = 0; j < HC_N; ++j) {
    pk[j] = post[tok * HC_N + j];
#pragma unroll
    for (int k = 0; k < HC_N; ++k) cm[j][k] = comb[(tok * HC_N + j) * HC_N + k];
  }
  float xs[HC_N][8];
#pragma unroll
  for (int j = 0; j < HC_N; ++j) {
    const uint4 xv = *reinterpret_cast<const uint4*>(x + ((i64)tok * HC_N + j) * D + d);
    const u32 xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) xs[j][i] = bf16_to_f32(i & 1 ? xw[i >> 1] >> 16 : xw[i >> 1] & 0xffff);
  }
#pragma unroll
  for (int k = 0; k < HC_N; ++k) {
    float r[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      double mixed = 0.0;
#pragma unroll
      for (int j = 0; j < HC_N; ++j) mixed += (double)cm[j][k] * (double)xs[j][i];
      r[i] = __fadd_rn(__fmul_rn(pk[k], o[i]), (float)mixed);
    }
    *reinterpret_cast<uint4*>(y + ((i64)tok * HC_N + k) * D + d) =
        make_uint4(bf16x2(r[0], r[1]), bf16x2(r[2], r[3]), bf16x2(r[4], r[5]), bf16x2(r[6], r[7]));
  }
}
