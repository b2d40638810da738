// GPT-J style rotary embedding on the trailing 64 dims of each head, in place, as layers.Rope.apply
// computes it: pairs (x[2i], x[2i+1]) -> (x0 cos - x1 sin, x0 sin + x1 cos) in float32, each
// product and sum rounded (no FMA), back to bf16; the inverse rotation negates sin.
// x bf16 [rows, heads, dim]; cos / sin float32 [rows, 32] (the row's position). One thread a pair.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) rope_bf16(
    u16* __restrict__ x, const float* __restrict__ cos_t, const float* __restrict__ sin_t, int rows, int heads,
    int dim, int inverse) {
  pdl_begin();
  const i64 i = (i64)blockIdx.x * 256 + threadIdx.x;
  if (i >= (i64)rows * heads * ROPE_PAIRS) return;
  const int pair = (int)(i % ROPE_PAIRS);
  const i64 head = i / ROPE_PAIRS;
  const int row = (int)(head / heads);
  u32* p = reinterpret_cast<u32*>(x + head * dim + dim - 2 * ROPE_PAIRS + 2 * pair);
  const float s = sin_t[row * ROPE_PAIRS + pair];
  *p = rotate_pair(*p, cos_t[row * ROPE_PAIRS + pair], inverse ? -s : s);
}
