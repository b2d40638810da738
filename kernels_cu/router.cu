// The MoE router at decode, as layers.MoE.route computes it:
//   router_scores: s[t, e] = f32(sqrt(softplus(z))) in float64, z = f32(x_t . W_e) (bf16 x and W,
//     products exact in float32, summed in float64). grid (E / 4, T), 4 warps, a warp per expert.
//   router_select: idx = the top-k experts by s + bias (ties to the lower expert), or the hash
//     table's row for the token (tid2eid); weights = s[idx] / f32(sum_f64 s[idx] + eps) * scale.
//     grid (T), one warp per token.
#include "common.cuh"

#define ROUTER_MAX_EXPERTS 512
#define ROUTER_MAX_TOPK 16

extern "C" __global__ void __launch_bounds__(128) router_scores(
    const u16* __restrict__ x, const u16* __restrict__ w, float* __restrict__ scores, int tokens, int experts, int D) {
  pdl_begin();
  const int lane = threadIdx.x & 31;
  const int e = blockIdx.x * 4 + (threadIdx.x >> 5), tok = blockIdx.y;
  if (e >= experts || tok >= tokens) return;
  const u16* we = w + (i64)e * D;
  const u16* xt = x + (i64)tok * D;
  // Four chunks in flight a lane, each with its own float64 sum.
  double part[4] = {0.0, 0.0, 0.0, 0.0};
  for (int d0 = 8 * lane; d0 < D; d0 += 1024) {
    uint4 wv[4], xv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {  // D is a multiple of 256: zeros past the end add nothing
      const bool in = d0 + 256 * u < D;
      wv[u] = in ? *reinterpret_cast<const uint4*>(we + d0 + 256 * u) : make_uint4(0, 0, 0, 0);
      xv[u] = in ? *reinterpret_cast<const uint4*>(xt + d0 + 256 * u) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const u32 ww[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w}, xx[4] = {xv[u].x, xv[u].y, xv[u].z, xv[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        part[u] += (double)(bf16_to_f32(xx[i] & 0xffff) * bf16_to_f32(ww[i] & 0xffff));
        part[u] += (double)(bf16_to_f32(xx[i] >> 16) * bf16_to_f32(ww[i] >> 16));
      }
    }
  }
  double acc = (part[0] + part[1]) + (part[2] + part[3]);
  acc = warp_sum(acc);
  if (lane == 0) {
    const double z = (double)(float)acc;
    const double softplus = z > 20.0 ? z : log1p(exp(z));  // torch's softplus (threshold 20)
    scores[(i64)tok * experts + e] = (float)sqrt(softplus);
  }
}

extern "C" __global__ void __launch_bounds__(32) router_select(
    const float* __restrict__ scores, const float* __restrict__ bias, const int* __restrict__ tid2eid,
    const i64* __restrict__ ids, int* __restrict__ idx, float* __restrict__ weights, int experts, int topk,
    double route_eps, float route_scale) {
  pdl_begin();
  __shared__ float biased[ROUTER_MAX_EXPERTS];
  __shared__ int pick[ROUTER_MAX_TOPK];
  const int tok = blockIdx.x, lane = threadIdx.x;
  const float* s = scores + (i64)tok * experts;
  if (tid2eid) {
    if (lane < topk) pick[lane] = tid2eid[ids[tok] * topk + lane];
  } else {
    for (int e = lane; e < experts; e += 32) biased[e] = bias ? s[e] + bias[e] : s[e];
    __syncwarp();
    for (int r = 0; r < topk; ++r) {
      float best = __int_as_float(0xff800000);
      int best_e = experts;
      for (int e = lane; e < experts; e += 32)
        if (biased[e] > best) best = biased[e], best_e = e;  // ascending e: ties keep the lower
#pragma unroll
      for (int o = 16; o; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
        if (ob > best || (ob == best && oe < best_e)) best = ob, best_e = oe;
      }
      if (lane == 0) {
        pick[r] = best_e;
        biased[best_e] = __int_as_float(0xff800000);
      }
      __syncwarp();
    }
  }
  __syncwarp();
  if (lane == 0) {
    double sum = 0.0;
    for (int r = 0; r < topk; ++r) sum += (double)s[pick[r]];
    const float denom = (float)(sum + route_eps);
    for (int r = 0; r < topk; ++r) {
      idx[tok * topk + r] = pick[r];
      weights[tok * topk + r] = s[pick[r]] / denom * route_scale;
    }
  }
}
