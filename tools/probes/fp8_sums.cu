// tools/fp8-sums-probe: D[64x8] = sum over k-steps of A_s (64x32 e4m3) B_s (32x8 e4m3), three ways.
#include "common.cuh"

DSUF_DEVICE void wg(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc, int acc) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %9, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(acc));
}

extern "C" __global__ void __launch_bounds__(128) probe(const u8* A, const u8* B, float* D, int steps, int mode) {
  __shared__ __align__(128) u8 bs[16][256];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  A += (i64)blockIdx.x * steps * 64 * 32;
  B += (i64)blockIdx.x * steps * 8 * 32;
  for (int e = tid; e < steps * 256; e += blockDim.x) {
    const int s = e >> 8, r = e & 255, half = r >> 7, n = (r >> 4) & 7, kk = r & 15;
    bs[s][r] = B[(s * 8 + n) * 32 + half * 16 + kk];
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, d[4] = {0.f, 0.f, 0.f, 0.f};
  const int r0 = 16 * warp + g;
  for (int s = 0; s < steps; ++s) {
    const u8* a = A + s * 64 * 32;
    u32 a0 = *(const u32*)(a + r0 * 32 + 4 * t), a1 = *(const u32*)(a + (r0 + 8) * 32 + 4 * t);
    u32 a2 = *(const u32*)(a + r0 * 32 + 16 + 4 * t), a3 = *(const u32*)(a + (r0 + 8) * 32 + 16 + 4 * t);
    if (mode == 2) {
      const u32 b0 = *(const u32*)&bs[s][g * 16 + 4 * t], b1 = *(const u32*)&bs[s][128 + g * 16 + 4 * t];
      mma_e4m3_acc(d, a0, a1, a2, a3, b0, b1);
    } else {
      const u64 desc = (u64)((smem_addr(&bs[s][0]) >> 4) & 0x3fff) | ((u64)(128 >> 4) << 16) | ((u64)(256 >> 4) << 32);
      float r[4] = {0.f, 0.f, 0.f, 0.f};
      float* dst = mode == 0 ? d : r;
      asm volatile("" : "+f"(dst[0]), "+f"(dst[1]), "+f"(dst[2]), "+f"(dst[3]), "+r"(a0), "+r"(a1), "+r"(a2), "+r"(a3)::"memory");
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
      wg(dst, a0, a1, a2, a3, desc, mode == 0 && s > 0);
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      asm volatile("" : "+f"(dst[0]), "+f"(dst[1]), "+f"(dst[2]), "+f"(dst[3]), "+r"(a0), "+r"(a1), "+r"(a2), "+r"(a3)::"memory");
      if (mode == 1) acc[0] += r[0], acc[1] += r[1], acc[2] += r[2], acc[3] += r[3];
    }
  }
  if (mode == 1) d[0] = acc[0], d[1] = acc[1], d[2] = acc[2], d[3] = acc[3];
  float* o = D + (i64)blockIdx.x * 64 * 8;
  o[r0 * 8 + 2 * t] = d[0], o[r0 * 8 + 2 * t + 1] = d[1], o[(r0 + 8) * 8 + 2 * t] = d[2], o[(r0 + 8) * 8 + 2 * t + 1] = d[3];
}
