// Per-row, per-128 FP8 activation quantisation (DeepSeek's act_quant, the reference's
// quant.act_quant_fp8): x bf16 [M, K] -> xq e4m3 [M, K] and sx float32 [M, K/128], with
// x ~= xq * sx. One warp per 128-element block; each lane owns 4 consecutive elements.
// act_fake_quant_bf16 writes the quantised values themselves, xq * sx, as bf16 (exact): the
// input of the prefill path's bf16 GEMMs. swiglu_act_quant_f32 quantises the experts' SwiGLU
// (dequant.cu's swiglu_f32) of float32 gate_up [P, 2I] as act_quant_bf16 quantises its bf16
// output, without writing that output.
#include "common.cuh"

struct Block {
  uint2 raw;  // the lane's 4 bf16 inputs
  i64 at;     // their offset
  int index;  // the block's index, row * (K / 128) + kb
};

// The lane's share of its warp's block; false for warps past the end.
DSUF_DEVICE bool load_block(const u16* x, int rows, int K, Block& b) {
  const int lane = threadIdx.x & 31;
  const int kb_count = K >> 7;
  b.index = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (b.index >= rows * kb_count) return false;
  const int row = b.index / kb_count, kb = b.index - row * kb_count;
  b.at = (i64)row * K + kb * 128 + lane * 4;
  b.raw = *reinterpret_cast<const uint2*>(x + b.at);
  return true;
}

// The block's scale exponent and the lane's 4 values as e4m3 bytes.
DSUF_DEVICE u32 quant_block(const Block& b, int& e) {
  const float v0 = bf16_to_f32(b.raw.x & 0xffff), v1 = bf16_to_f32(b.raw.x >> 16);
  const float v2 = bf16_to_f32(b.raw.y & 0xffff), v3 = bf16_to_f32(b.raw.y >> 16);
  const float amax = warp_max(fmaxf(fmaxf(fabsf(v0), fabsf(v1)), fmaxf(fabsf(v2), fabsf(v3))));
  e = act_scale_exponent(amax);
  return quant4_e4m3(v0, v1, v2, v3, e);
}

extern "C" __global__ void __launch_bounds__(256) act_quant_bf16(
    const u16* __restrict__ x, u8* __restrict__ xq, float* __restrict__ sx, int rows, int K) {
  pdl_begin();
  Block b;
  if (!load_block(x, rows, K, b)) return;
  int e;
  *reinterpret_cast<u32*>(xq + b.at) = quant_block(b, e);
  if ((threadIdx.x & 31) == 0) sx[b.index] = pow2f(e);
}

extern "C" __global__ void __launch_bounds__(256) act_fake_quant_bf16(const u16* __restrict__ x, u16* __restrict__ out, int rows, int K) {
  pdl_begin();
  Block b;
  if (!load_block(x, rows, K, b)) return;
  int e;
  const u32 q = quant_block(b, e);
  const float scale = pow2f(e);
  float v[4];
  e4m3x2_to_f32x2(q, v[0], v[1]);
  e4m3x2_to_f32x2(q >> 16, v[2], v[3]);
  *reinterpret_cast<uint2*>(out + b.at) = make_uint2(bf16x2(v[0] * scale, v[1] * scale), bf16x2(v[2] * scale, v[3] * scale));
}

extern "C" __global__ void __launch_bounds__(256) swiglu_act_quant_f32(
    const float* __restrict__ gate_up, const float* __restrict__ weight, u8* __restrict__ hq, float* __restrict__ sh, int pairs, int I, float limit) {
  pdl_begin();
  const int lane = threadIdx.x & 31, kb_count = I >> 7;
  Block b;
  b.index = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (b.index >= pairs * kb_count) return;
  const int p = b.index / kb_count, j = (b.index - p * kb_count) * 128 + lane * 4;
  b.at = (i64)p * I + j;
  const float4 g = *reinterpret_cast<const float4*>(gate_up + (i64)p * 2 * I + j);
  const float4 u = *reinterpret_cast<const float4*>(gate_up + (i64)p * 2 * I + I + j);
  const float* w = weight ? weight + p : nullptr;
  b.raw = make_uint2(bf16x2(swiglu_value(g.x, u.x, w, limit), swiglu_value(g.y, u.y, w, limit)),
                     bf16x2(swiglu_value(g.z, u.z, w, limit), swiglu_value(g.w, u.w, w, limit)));
  int e;
  *reinterpret_cast<u32*>(hq + b.at) = quant_block(b, e);
  if (lane == 0) sh[b.index] = pow2f(e);
}
