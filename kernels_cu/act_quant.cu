// Per-row, per-128 FP8 activation quantisation (DeepSeek's act_quant, the reference's
// quant.act_quant_fp8): x bf16 [M, K] -> xq e4m3 [M, K] and sx float32 [M, K/128], with
// x ~= xq * sx. One warp per 128-element block; each lane owns 4 consecutive elements.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) act_quant_bf16(
    const u16* __restrict__ x, u8* __restrict__ xq, float* __restrict__ sx, int rows, int K) {
  pdl_begin();
  const int lane = threadIdx.x & 31;
  const int kb_count = K >> 7;
  const int block = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (block >= rows * kb_count) return;
  const int row = block / kb_count, kb = block - row * kb_count;
  const i64 at = (i64)row * K + kb * 128 + lane * 4;

  const uint2 raw = *reinterpret_cast<const uint2*>(x + at);
  const float v0 = bf16_to_f32(raw.x & 0xffff), v1 = bf16_to_f32(raw.x >> 16);
  const float v2 = bf16_to_f32(raw.y & 0xffff), v3 = bf16_to_f32(raw.y >> 16);
  const float amax = warp_max(fmaxf(fmaxf(fabsf(v0), fabsf(v1)), fmaxf(fabsf(v2), fabsf(v3))));
  const int e = act_scale_exponent(amax);
  *reinterpret_cast<u32*>(xq + at) = quant4_e4m3(v0, v1, v2, v3, e);
  if (lane == 0) sx[(i64)row * kb_count + kb] = pow2f(e);
}
