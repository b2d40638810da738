// tools/chain-probe: what one dependency of a decode step's chain costs on this GPU. A chain of
// `steps` steps of `ctas` CTAs, where every CTA of a step reads the values of all CTAs of the step
// before (a thread each), sums them and writes its own, run two ways: chain_step, a kernel a step
// (launched with programmatic dependent launch, as the decode kernels are, in one CUDA graph), and
// chain_persistent, one kernel whose CTAs stay resident and meet at an arrival counter a step.
#include "common.cuh"

#define CHAIN_THREADS 256  // at least ctas

DSUF_DEVICE float step_value(const float* prev, int ctas) {
  __shared__ float part[CHAIN_THREADS / 32];
  float v = 0.0f;  // (from L2: the producers are other SMs)
  if (threadIdx.x < ctas) asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(prev + threadIdx.x) : "memory");
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < CHAIN_THREADS / 32; ++w) total += part[w];
  return total * (0.5f / ctas) + (float)blockIdx.x;  // bounded, and every CTA's value its own
}

// vals [steps + 1][ctas]: step s reads row s - 1 and writes row s.
extern "C" __global__ void __launch_bounds__(CHAIN_THREADS) chain_step(float* vals, int step, int ctas) {
  pdl_begin();
  const float v = step_value(vals + (i64)(step - 1) * ctas, ctas);
  if (threadIdx.x == 0) vals[(i64)step * ctas + blockIdx.x] = v;
}

// arrived [steps + 1], zero at the start: a CTA adds 1 to arrived[s] once its value of step s is
// written (release); step s + 1 begins when arrived[s] reaches ctas (acquire). Needs every CTA
// resident at once (ctas <= the SMs).
extern "C" __global__ void __launch_bounds__(CHAIN_THREADS) chain_persistent(float* vals, u32* arrived, int steps, int ctas) {
  pdl_begin();
  for (int s = 1; s <= steps; ++s) {
    if (threadIdx.x == 0) {
      const u32* at = arrived + s - 1;
      u32 n;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(n) : "l"(at) : "memory");
      } while (s > 1 && n < (u32)ctas);
    }
    __syncthreads();
    const float v = step_value(vals + (i64)(s - 1) * ctas, ctas);
    if (threadIdx.x == 0) {
      vals[(i64)s * ctas + blockIdx.x] = v;
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(arrived + s) : "memory");
    }
    __syncthreads();  // part[] is reused by the next step
  }
}
