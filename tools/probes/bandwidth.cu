// tools/bandwidth-probe: how fast CTAs pull bytes from HBM, as the decode GEMVs do. Each CTA of a
// launch (one an SM, 512 threads) reads `bytes` of its own: bulk_pull by bulk copies of `piece`
// bytes into shared memory, completing on one mbarrier (fp8_rows.cu's way); load_pull by 16-byte
// register loads, eight in flight a thread (gemm.cu's way). Each writes to sink only if what it
// read says so (never, with random bytes): the reads cannot be dropped.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(512, 1) bulk_pull(const u8* src, i64 cta_stride, int bytes, int piece, int* sink) {
  extern __shared__ __align__(128) u8 smem[];
  __shared__ u64 bar;
  const u8* from = src + blockIdx.x * cta_stride;
  if (threadIdx.x == 0) {
    mbar_init(&bar);
    mbar_expect_bytes(&bar, bytes);
  }
  __syncthreads();
  for (int i = threadIdx.x; i * piece < bytes; i += blockDim.x) bulk_stream(smem + i * piece, from + (i64)i * piece, piece, &bar);
  mbar_wait(&bar, 0);
  if (threadIdx.x == 0 && smem[0] == 0xff && smem[bytes - 1] == 0xff) sink[0] = 1;
}

// (piece: unused; bulk_pull's arguments, so that the tool launches both alike)
extern "C" __global__ void __launch_bounds__(512, 1) load_pull(const u8* src, i64 cta_stride, int bytes, int piece, int* sink) {
  const uint4* from = reinterpret_cast<const uint4*>(src + blockIdx.x * cta_stride);
  const int n = bytes / 16;
  u32 acc = 0;
  for (int i0 = threadIdx.x; i0 < n; i0 += 8 * blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = i0 + u * (int)blockDim.x < n ? ld_stream(from + i0 + u * blockDim.x) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0xffffffffu) sink[0] = 1;
}
