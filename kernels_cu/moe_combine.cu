// The MoE output of each token, as the reference MoE sums it: the routed experts' bf16 outputs
// added in float32 in ascending expert order (starting from zero), then the shared expert's,
// rounded once to bf16. routed [rows, D]: pair t*topk + j (token t's j-th expert) at row
// row_of[pair], or at row pair where row_of is null; shared [T, D], expert [T*topk]; out [T, D].
// grid = (D / 2048, T), 256 threads x 8 elements. With `to` (a tensor-parallel rank's peers), out
// is this rank's part of the all-reduce that follows, pushed to the peers as it is written.
#include "peers.cuh"

#define MAX_TOPK 16

extern "C" __global__ void __launch_bounds__(256) moe_combine_bf16(
    const u16* __restrict__ routed, const int* __restrict__ row_of, const u16* __restrict__ shared,
    const int* __restrict__ expert, u16* __restrict__ out, int D, int topk, const __grid_constant__ Peers to) {
  pdl_begin();
  __shared__ i64 row[MAX_TOPK];  // the token's routed rows in ascending expert order
  const int tok = blockIdx.y;
  if (threadIdx.x < topk) {
    const int pair = tok * topk + threadIdx.x, mine = expert[pair];
    int rank = 0;
    for (int j = 0; j < topk; ++j) rank += expert[tok * topk + j] < mine;
    row[rank] = row_of ? row_of[pair] : pair;
  }
  __syncthreads();

  const int d = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (d >= D) return;
  // Every row's vector requested before any is added, so their latencies overlap.
  uint4 v[MAX_TOPK + 1];
#pragma unroll
  for (int r = 0; r <= MAX_TOPK; ++r) {
    if (r <= topk) {
      const u16* src = r < topk ? routed + row[r] * D : shared + (i64)tok * D;
      v[r] = *reinterpret_cast<const uint4*>(src + d);
    }
  }
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int r = 0; r <= MAX_TOPK; ++r) {
    if (r > topk) break;
    const u32 w[4] = {v[r].x, v[r].y, v[r].z, v[r].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] += bf16_to_f32(w[i] & 0xffff);
      acc[2 * i + 1] += bf16_to_f32(w[i] >> 16);
    }
  }
  u32 o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = f32_to_bf16(acc[2 * i]) | ((u32)f32_to_bf16(acc[2 * i + 1]) << 16);
  const uint4 sum = make_uint4(o[0], o[1], o[2], o[3]);
  *reinterpret_cast<uint4*>(out + (i64)tok * D + d) = sum;
  send_vec(to, ((i64)tok * D + d) / 8, sum);
}
