// V4-Flash KV-cache entries (model.md §5): 584 bytes per entry, one entry per token (window ring)
// or per compressed group:
//   bytes [0, 448)    the 448 "nope" dims in e4m3, one power-of-two scale per 64 dims
//   bytes [448, 576)  the 64 rope dims as bf16, unquantised
//   bytes [576, 583)  the 7 scales as UE8M0 exponent bytes (code 127 = 1.0)
//   byte  583         zero padding
// The values are the reference's KV fake-quant (quant.act_quant_fp8 on the nope dims, block 64:
// scale = 2**ceil(log2(max(amax, 1e-4) / 448)), round-to-nearest-even e4m3), so the entry decodes
// to exactly the bf16 row the reference keeps in its cache.
//
// kv_pack_fp8: x bf16 [rows, 512] (after kv_norm and RoPE) -> pool[slot[row]] (slot < 0: skipped;
// slots null: row i goes to entry i). One warp per row: lanes 0..27 own 16 nope dims each (four
// lanes share a scale block), lanes 28..31 copy 16 rope dims each.
#include "common.cuh"

#define KV_ENTRY 584
#define KV_NOPE 448
#define KV_SCALES 576

extern "C" __global__ void __launch_bounds__(256) kv_pack_fp8(
    const u16* __restrict__ x, const int* __restrict__ slots, u8* __restrict__ pool, int rows) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (row >= rows) return;  // whole warps leave together
  const int slot = slots ? slots[row] : row;
  if (slot < 0) return;
  const u16* src = x + (i64)row * 512 + 16 * lane;
  u8* entry = pool + (i64)slot * KV_ENTRY;
  const uint4 a = *reinterpret_cast<const uint4*>(src);
  const uint4 b = *reinterpret_cast<const uint4*>(src + 8);
  if (lane >= 28) {  // rope dims 448 + 16 (lane - 28) ...: copied as they are
    uint2* dst = reinterpret_cast<uint2*>(entry + KV_NOPE + 32 * (lane - 28));
    dst[0] = make_uint2(a.x, a.y);
    dst[1] = make_uint2(a.z, a.w);
    dst[2] = make_uint2(b.x, b.y);
    dst[3] = make_uint2(b.z, b.w);
    if (lane == 31) entry[KV_ENTRY - 1] = 0;
  }
  const u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  float v[16];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = bf16_to_f32(w[i] & 0xffff);
    v[2 * i + 1] = bf16_to_f32(w[i] >> 16);
    amax = fmaxf(amax, fmaxf(fabsf(v[2 * i]), fabsf(v[2 * i + 1])));
  }
  // The four lanes of a 64-dim block share its amax (every lane takes part in the shuffles).
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  if (lane >= 28) return;
  const int e = act_scale_exponent(amax);
  uint2* dst = reinterpret_cast<uint2*>(entry + 16 * lane);  // entries are only 8-byte aligned
  dst[0] = make_uint2(quant4_e4m3(v[0], v[1], v[2], v[3], e), quant4_e4m3(v[4], v[5], v[6], v[7], e));
  dst[1] = make_uint2(quant4_e4m3(v[8], v[9], v[10], v[11], e), quant4_e4m3(v[12], v[13], v[14], v[15], e));
  if ((lane & 3) == 0) entry[KV_SCALES + (lane >> 2)] = (u8)(e + 127);
}
