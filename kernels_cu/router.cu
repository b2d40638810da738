// The MoE router at decode, as layers.MoE.route computes it:
//   router_scores: s[t, e] = f32(sqrt(softplus(z))) in float64, z = f32(x_t . W_e) (bf16 x and W,
//     products exact in float32, summed in float64). grid (E, T), 128 threads: a CTA per expert,
//     each thread's 32 elements loaded at once (a warp per expert, four rounds of loads, took
//     8.8 µs at batch 1 on H200).
//   router_select: idx = the top-k experts by s + bias (ties to the lower expert), or the hash
//     table's row for the token (tid2eid); weights = s[idx] / f32(sum_f64 s[idx] + eps) * scale.
//     grid (T), one warp per token.
#include "common.cuh"

#define ROUTER_MAX_EXPERTS 512
#define ROUTER_MAX_TOPK 16
#define SCORE_THREADS 128

extern "C" __global__ void __launch_bounds__(SCORE_THREADS) router_scores(
    const u16* __restrict__ x, const u16* __restrict__ w, float* __restrict__ scores, int tokens, int experts, int D) {
  pdl_begin();
  __shared__ double part[SCORE_THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int e = blockIdx.x, tok = blockIdx.y;
  const u16* we = w + (i64)e * D;
  const u16* xt = x + (i64)tok * D;
  // Every load of the row issued at once (D <= 4096: one round), each with its own float64 sum.
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  for (int d0 = 8 * threadIdx.x; d0 < D; d0 += 32 * SCORE_THREADS) {
    uint4 wv[4], xv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {  // D is a multiple of 256: zeros past the end add nothing
      const int d = d0 + 8 * SCORE_THREADS * u;
      wv[u] = d < D ? *reinterpret_cast<const uint4*>(we + d) : make_uint4(0, 0, 0, 0);
      xv[u] = d < D ? *reinterpret_cast<const uint4*>(xt + d) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const u32 ww[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w}, xx[4] = {xv[u].x, xv[u].y, xv[u].z, xv[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[u] += (double)(bf16_to_f32(xx[i] & 0xffff) * bf16_to_f32(ww[i] & 0xffff));
        acc[u] += (double)(bf16_to_f32(xx[i] >> 16) * bf16_to_f32(ww[i] >> 16));
      }
    }
  }
  const double sum = warp_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  if (lane == 0) part[warp] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
#pragma unroll
    for (int i = 0; i < SCORE_THREADS / 32; ++i) total += part[i];
    const double z = (double)(float)total;
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
  __shared__ float picked[ROUTER_MAX_TOPK];  // the scores of the picks
  const int tok = blockIdx.x, lane = threadIdx.x;
  const float* s = scores + (i64)tok * experts;
  if (tid2eid) {
    if (lane < topk) {
      pick[lane] = tid2eid[ids[tok] * topk + lane];
      picked[lane] = s[pick[lane]];
    }
  } else {
    // Unrolled: the lane's loads are in flight together (experts <= 512: 16 a lane).
#pragma unroll
    for (int i = 0; i < ROUTER_MAX_EXPERTS / 32; ++i) {
      const int e = lane + 32 * i;
      if (e < experts) biased[e] = bias ? s[e] + bias[e] : s[e];
    }
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
    if (lane < topk) picked[lane] = s[pick[lane]];  // the lanes' loads in flight together
  }
  __syncwarp();
  if (lane == 0) {
    double sum = 0.0;
    for (int r = 0; r < topk; ++r) sum += (double)picked[r];
    const float denom = (float)(sum + route_eps);
    for (int r = 0; r < topk; ++r) {
      idx[tok * topk + r] = pick[r];
      weights[tok * topk + r] = picked[r] / denom * route_scale;
    }
  }
}
