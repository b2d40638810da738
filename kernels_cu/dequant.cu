// The prefill path's bf16 copies of quantised weights, and its SwiGLU: a prompt chunk of thousands
// of rows is compute-bound, so its matmuls run on cuBLAS / CUTLASS tensor-core GEMMs over bf16
// weights dequantised once per chunk (the decode kernels would re-read the FP8 / FP4 weights for
// every few rows). Exact: an e4m3 or e2m1 value times a power-of-two E8M0 scale is a bf16 value.
#include "common.cuh"

// e4m3 w [N, K] with E8M0 scales [N/128, K/128] -> bf16 out [N, K]; a thread converts 8 elements.
extern "C" __global__ void __launch_bounds__(256) fp8_weight_bf16(const u8* __restrict__ w, const u8* __restrict__ s,
                                                                  u16* __restrict__ out, int N, int K) {
  pdl_begin();
  const i64 at = ((i64)blockIdx.x * 256 + threadIdx.x) * 8;
  if (at >= (i64)N * K) return;
  const int row = (int)(at / K), col = (int)(at % K);
  const float scale = e8m0_to_f32(s[(i64)(row >> 7) * (K >> 7) + (col >> 7)]);
  const uint2 raw = *reinterpret_cast<const uint2*>(w + at);
  float v[8];
  e4m3x2_to_f32x2(raw.x, v[0], v[1]);
  e4m3x2_to_f32x2(raw.x >> 16, v[2], v[3]);
  e4m3x2_to_f32x2(raw.y, v[4], v[5]);
  e4m3x2_to_f32x2(raw.y >> 16, v[6], v[7]);
  uint4 o;
  o.x = bf16x2(v[0] * scale, v[1] * scale);
  o.y = bf16x2(v[2] * scale, v[3] * scale);
  o.z = bf16x2(v[4] * scale, v[5] * scale);
  o.w = bf16x2(v[6] * scale, v[7] * scale);
  *reinterpret_cast<uint4*>(out + at) = o;
}

// An e2m1 code's value: sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
DSUF_DEVICE float e2m1_value(u32 code) {
  const u32 e = (code >> 1) & 3, m = code & 1;
  const float mag = e ? (1.0f + 0.5f * m) * (float)(1 << (e - 1)) : 0.5f * m;
  return code & 8 ? -mag : mag;
}

// A kernel-layout FP4 word's codes (moe.permute_fp4) as the checkpoint's byte j holds them: the
// even element's code (low nibble) and the odd element's (high nibble).
DSUF_DEVICE u32 fp4_even_code(u32 w, int j) { return ((w >> (4 * j)) & 7) | ((w >> (8 * j + 4)) & 8); }
DSUF_DEVICE u32 fp4_odd_code(u32 w, int j) { return ((w >> (16 + 4 * j)) & 7) | ((w >> (8 * j)) & 8); }

// Stacked FP4 experts in the MoE kernels' layout (moe.fp4_kernel_layout: in each 64-byte chunk of a
// row, new word 4t + i holds old word 4i + t, its bits placed anew; chunk c of rows 128j..128j + 127
// at (j * K/128 + c) * 8 KB, a row's 64 bytes 64 apart), with E8M0 scales [rows, K/32] -> bf16. Row
// r (expert r / N, row r % N of it) goes to out + (r / N) * out_stride + (r % N) * K, so two
// experts' matrices can be written side by side (w1 and w3 into one [E, 2N, K] buffer). A thread
// converts four consecutive words (one 16-byte load, in the layout's order), each 8 consecutive
// elements; the codes' values come from a table in shared memory (the conversion is otherwise ALU-bound).
extern "C" __global__ void __launch_bounds__(256) fp4_weight_bf16(const u8* __restrict__ w, const u8* __restrict__ s,
                                                                  u16* __restrict__ out, i64 rows, int N, int K,
                                                                  i64 out_stride) {
  pdl_begin();
  __shared__ float value[16];
  if (threadIdx.x < 16) value[threadIdx.x] = e2m1_value(threadIdx.x);
  __syncthreads();
  const i64 quad = (i64)blockIdx.x * 256 + threadIdx.x;
  if (quad >= rows * (K / 32)) return;
  const i64 in_tile = quad % (4 * K);  // a tile of 128 rows: K/128 chunks of 512 loads, 4 a row
  const i64 r = quad / (4 * K) * 128 + ((in_tile & 511) >> 2);
  const uint4 packed = reinterpret_cast<const uint4*>(w)[quad];
  const u8* scales = s + r * (K / 32);
  u16* row_out = out + (r / N) * out_stride + (r % N) * (i64)K;
  const int first = (int)(in_tile >> 9) * 16 + (int)(in_tile & 3) * 4;  // the row's word index of packed.x
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int in_row = first + q, chunk = in_row >> 4, moved = in_row & 15;
    const int col = chunk * 128 + ((moved & 3) * 4 + (moved >> 2)) * 8;  // new word 4t + i held old word 4i + t
    const u32 word = q == 0 ? packed.x : q == 1 ? packed.y : q == 2 ? packed.z : packed.w;
    const float scale = e8m0_to_f32(scales[col / 32]);
    u32 o[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) o[b] = bf16x2(value[fp4_even_code(word, b)] * scale, value[fp4_odd_code(word, b)] * scale);
    *reinterpret_cast<uint4*>(row_out + col) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// The experts' SwiGLU as layers.Expert computes it (common.cuh swiglu_value), rounded to bf16.
// gate_up [P, 2I]: gate in columns [0, I), up in [I, 2I); float32 (cuBLAS, moe_prefill_fp4) or
// bf16 (routed experts by torch._grouped_mm, which writes bf16).
template <typename T>
DSUF_DEVICE float load_f32(const T* p);
template <>
DSUF_DEVICE float load_f32<float>(const float* p) { return *p; }
template <>
DSUF_DEVICE float load_f32<u16>(const u16* p) { return bf16_to_f32(*p); }

template <typename T>
DSUF_DEVICE void swiglu(const T* gate_up, const float* weight, u16* h, i64 pairs, int I, float limit) {
  const i64 at = ((i64)blockIdx.x * 256 + threadIdx.x) * 2;
  if (at >= pairs * I) return;
  const i64 p = at / I;
  const int j = (int)(at % I);
  float out[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    out[k] = swiglu_value(load_f32(gate_up + p * 2 * I + j + k), load_f32(gate_up + p * 2 * I + I + j + k), weight ? weight + p : nullptr, limit);
  }
  *reinterpret_cast<u32*>(h + at) = bf16x2(out[0], out[1]);
}

extern "C" __global__ void __launch_bounds__(256) swiglu_f32(const float* gate_up, const float* weight, u16* h, i64 pairs, int I, float limit) {
  pdl_begin();
  swiglu(gate_up, weight, h, pairs, I, limit);
}

extern "C" __global__ void __launch_bounds__(256) swiglu_bf16(const u16* gate_up, const float* weight, u16* h, i64 pairs, int I, float limit) {
  pdl_begin();
  swiglu(gate_up, weight, h, pairs, I, limit);
}
