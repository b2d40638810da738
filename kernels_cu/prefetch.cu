// Warm the L2 with weights that a later kernel of the step streams. Run on a side stream while the
// main stream's latency-bound kernels leave the memory system idle, so the GEMV that follows reads
// its weights from L2 rather than HBM. Each thread hands the copy engine one bulk prefetch
// (`cp.async.bulk.prefetch.L2`, no completion to wait for) per CHUNK bytes of the ranges.
#include "common.cuh"

#define PREFETCH_RANGES 8
#define PREFETCH_CHUNK (16 << 10)

struct PrefetchParams {
  const u8* ptr[PREFETCH_RANGES];  // 16-byte aligned
  u64 bytes[PREFETCH_RANGES];      // multiples of 16
  int n;
};

extern "C" __global__ void __launch_bounds__(128) l2_prefetch(const PrefetchParams p) {
  // No pdl_begin: the weights are constant, so this need not wait for the kernel before it.
  const u64 thread = (u64)blockIdx.x * blockDim.x + threadIdx.x, threads = (u64)gridDim.x * blockDim.x;
  for (int r = 0; r < p.n; ++r) {
    const u64 chunks = (p.bytes[r] + PREFETCH_CHUNK - 1) / PREFETCH_CHUNK;
    for (u64 c = thread; c < chunks; c += threads) {
      const u64 at = c * PREFETCH_CHUNK;
      const u32 size = (u32)min((u64)PREFETCH_CHUNK, p.bytes[r] - at);
#if __CUDA_ARCH__ >= 900
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p.ptr[r] + at), "r"(size) : "memory");
#endif
    }
  }
}
