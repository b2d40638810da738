// A decode step's indices (dsuf.gpu.layer.step_index, which specifies them: every field here
// equals its, bit for bit) for every kind of layer in one launch, where the torch ops took ~60.
// Rows b: slot slots[b], position pos[b] (int64, the step's device inputs). For kind k (a layer
// kind: ratio 0, 4 or 128), with stride = ring + n_max and base = slot * stride:
//   attn_idx[b, c < W]: the window's position q = pos - (W - 1) + c at base + q % ring (q < 0: -1);
//   attn_idx[b, W + e]: ratio 4: -1 (the top-k fills them); ratio 128: entry e at base + ring + e
//     while e < (pos + 1) / ratio, else -1;
//   window_slot = base + pos % ring; comp_base = base + ring; comp_slot = comp_base + pos / ratio;
//   attn_used = W + min((pos + 1) / ratio, topk (ratio 4) or n_max); key_start = slot * n_max,
//   key_row = key_start + pos / 4 (int64), n_keys = (pos + 1) / 4 (ratio 4).
// And per RoPE table r (0: the window layers', 1: the compressed layers'): cos, sin [B, 32] of the
// angle f32(f32(pos) * freq_i), taken in float64 and rounded (layers.Rope.cos_sin); positions
// [B] int32. grid (column blocks, B, kinds), 256 threads.
#include "common.cuh"

#define STEP_KINDS 3
#define ROPE_PAIRS 32

struct StepKind {
  int* attn_idx;     // [B, cols]
  int* window_slot;  // [B]
  int* comp_slot;    // [B] (ratio > 0)
  int* comp_base;
  int* attn_used;
  int* key_start;    // [B] (ratio 4)
  int* n_keys;
  i64* key_row;
  int ratio, n_max, cols;
};

struct StepIndexParams {
  const i64* slots;  // [B]
  const i64* pos;    // [B]
  int* positions;    // [B]
  const float* freqs[2];
  float* cos[2];     // [B, 32]
  float* sin[2];
  StepKind kind[STEP_KINDS];
  int window, ring, topk, kinds;
};

extern "C" __global__ void __launch_bounds__(256) step_indices(const __grid_constant__ StepIndexParams p) {
  pdl_begin();
  const int b = blockIdx.y, col = blockIdx.x * blockDim.x + threadIdx.x;
  const StepKind& k = p.kind[blockIdx.z];
  const int pos = (int)p.pos[b], slot = (int)p.slots[b], W = p.window, ring = p.ring;
  const int base = slot * (ring + k.n_max), visible = k.ratio ? (pos + 1) / k.ratio : 0;
  if (col < W) {
    const int q = pos - (W - 1) + col;
    k.attn_idx[(i64)b * k.cols + col] = q >= 0 ? base + q % ring : -1;
  } else if (col < k.cols) {
    const int e = col - W;
    k.attn_idx[(i64)b * k.cols + col] = k.ratio != 4 && e < visible ? base + ring + e : -1;
  }
  if (col == 0) {
    k.window_slot[b] = base + pos % ring;
    if (k.ratio) {
      k.comp_base[b] = base + ring;
      k.comp_slot[b] = base + ring + pos / k.ratio;
      k.attn_used[b] = W + min(visible, k.ratio == 4 ? p.topk : k.n_max);
    }
    if (k.ratio == 4) {
      k.key_start[b] = slot * k.n_max;
      k.key_row[b] = (i64)slot * k.n_max + pos / 4;
      k.n_keys[b] = visible;
    }
  }
  if (blockIdx.z == 0 && blockIdx.x == 0 && threadIdx.x < 2 * ROPE_PAIRS) {  // the RoPE tables, once
    const int r = threadIdx.x / ROPE_PAIRS, i = threadIdx.x % ROPE_PAIRS;
    if (r == 0 && i == 0) p.positions[b] = pos;
    if (p.freqs[r]) {
      const double angle = __fmul_rn((float)pos, p.freqs[r][i]);
      p.cos[r][b * ROPE_PAIRS + i] = (float)cos(angle);
      p.sin[r][b * ROPE_PAIRS + i] = (float)sin(angle);
    }
  }
}
