// tools/fp8-sums-probe: D[64x8] = sum over k-steps of A_s (64x32 e4m3) B_s (32x8 e4m3), three
// ways (mode): 0 wgmma with one accumulator chained over the steps, 1 wgmma a step at a time
// summed in fp32, 2 mma.sync. One warpgroup a trial (grid = trials); B staged as the decode
// kernels stage it (k halves 128 bytes apart, 8 columns of 16 bytes).
#include "common.cuh"

#define MAX_STEPS 16

extern "C" __global__ void __launch_bounds__(128) probe(const u8* A, const u8* B, float* D, int steps, int mode) {
  __shared__ __align__(128) u8 bs[MAX_STEPS][256];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  A += (i64)blockIdx.x * steps * 64 * 32;
  B += (i64)blockIdx.x * steps * 8 * 32;
  for (int e = tid; e < steps * 256; e += blockDim.x) {
    const int s = e >> 8, r = e & 255, half = r >> 7, n = (r >> 4) & 7, kk = r & 15;
    bs[s][r] = B[(s * 8 + n) * 32 + half * 16 + kk];
  }
  fence_proxy_async_smem();
  __syncthreads();
  float sum[4] = {0.f, 0.f, 0.f, 0.f}, d[4] = {0.f, 0.f, 0.f, 0.f};
  const int r0 = 16 * warp + g;
  for (int s = 0; s < steps; ++s) {
    const u8* a = A + s * 64 * 32;
    const u32 a0 = *(const u32*)(a + r0 * 32 + 4 * t), a1 = *(const u32*)(a + (r0 + 8) * 32 + 4 * t);
    const u32 a2 = *(const u32*)(a + r0 * 32 + 16 + 4 * t), a3 = *(const u32*)(a + (r0 + 8) * 32 + 16 + 4 * t);
    if (mode == 2) {
      mma_e4m3_acc(d, a0, a1, a2, a3, *(const u32*)&bs[s][g * 16 + 4 * t], *(const u32*)&bs[s][128 + g * 16 + 4 * t]);
    } else if (mode == 1) {
      wgmma_e4m3_rs(d, a0, a1, a2, a3, wgmma_desc(&bs[s][0], 128, 256));
      sum[0] += d[0], sum[1] += d[1], sum[2] += d[2], sum[3] += d[3];
    } else {
      wgmma_fence();
      if (s == 0) {
        wgmma_e4m3<false>(d, a0, a1, a2, a3, wgmma_desc(&bs[s][0], 128, 256));
      } else {
        wgmma_e4m3<true>(d, a0, a1, a2, a3, wgmma_desc(&bs[s][0], 128, 256));
      }
      wgmma_wait();
      pin(d);
    }
  }
  if (mode == 1) d[0] = sum[0], d[1] = sum[1], d[2] = sum[2], d[3] = sum[3];
  float* o = D + (i64)blockIdx.x * 64 * 8;
  o[r0 * 8 + 2 * t] = d[0], o[r0 * 8 + 2 * t + 1] = d[1], o[(r0 + 8) * 8 + 2 * t] = d[2], o[(r0 + 8) * 8 + 2 * t + 1] = d[3];
}
