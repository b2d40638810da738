// Writing one V4-Flash cache entry with one warp, shared by the kernels that make entries
// (kv_cache.cu, indexer.cu, compressor.cu):
//
// KV entries (model.md §5): 584 bytes per entry, one entry per token (window ring) or per
// compressed group:
//   bytes [0, 448)    the 448 "nope" dims in e4m3, one power-of-two scale per 64 dims
//   bytes [448, 576)  the 64 rope dims as bf16, unquantised
//   bytes [576, 583)  the 7 scales as UE8M0 exponent bytes (code 127 = 1.0)
//   byte  583         zero padding
// The values are the reference's KV fake-quant (quant.act_quant_fp8 on the nope dims, block 64:
// scale = 2**ceil(log2(max(amax, 1e-4) / 448)), round-to-nearest-even e4m3), so the entry decodes
// to exactly the bf16 row the reference keeps in its cache.
//
// Index keys: 68 bytes, 128 e2m1 values (64 bytes, even element in the low nibble) and 4 UE8M0
// scales, one per 32 dims: the reference's FP4 fake-quant (quant.fp4_fake_quant_ue8m0, block 32).
#pragma once
#include "common.cuh"

#define KV_ENTRY 584
#define KV_NOPE 448
#define KV_SCALES 576

// The entry of the bf16 row src [512] (16-byte aligned, global or shared memory). Lanes 0..27 own
// 16 nope dims each (four lanes share a scale block), lanes 28..31 copy 16 rope dims each; every
// lane of the warp must call it.
DSUF_DEVICE void kv_entry_fp8(const u16* src, u8* entry, int lane) {
  src += 16 * lane;
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
  float amax = unpack_bf16_amax(w, v);
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

#define IDX_DIM 128
#define IDX_ENTRY 68
#define HADAMARD_SCALE ((float)0.08838834764831845)  // f32(128**-0.5): quant.hadamard_matrix(128)'s entries
#define FP4_AMAX_FLOOR __int_as_float(0x01c00000)  // 6 * 2**-126
#define FP4_MAX_INV __int_as_float(0x3e2aaaab)  // float32(1/6)

DSUF_DEVICE u32 e2m1_magnitude(float a) {  // |x| / scale in [0, 6] -> code 0..7 of 0, .5, 1, 1.5, 2, 3, 4, 6
  return (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
}

DSUF_DEVICE float e2m1_value(u32 mag) { return mag <= 4 ? 0.5f * mag : mag == 7 ? 6.0f : (float)mag - 2.0f; }

// FP4 fake-quant of a 128-dim row, one warp, dims 4 lane .. 4 lane + 3 in v: scale = 2**e with
// e = ceil(log2(max(amax, 6 * 2**-126) * f32(1/6))) per 32 dims, values rounded to the e2m1 grid
// (nearest, ties to even) after clamping x / scale to +-6. Gives the e2m1 codes and grid values;
// returns e. Every lane of the warp must call it.
DSUF_DEVICE int fp4_quant4(const float v[4], u32 code[4], float grid[4]) {
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));  // the 8 lanes of a block
  const u32 bits = __float_as_uint(fmaxf(amax, FP4_AMAX_FLOOR) * FP4_MAX_INV);
  const int e = (int)((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffff) != 0);
  const float inv = pow2f(-e);  // dividing by a power of two is exact
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float y = fminf(fmaxf(v[i] * inv, -6.0f), 6.0f);
    const u32 mag = e2m1_magnitude(fabsf(y));
    grid[i] = y < 0.0f ? -e2m1_value(mag) : e2m1_value(mag);
    code[i] = mag | (y < 0.0f && mag ? 8u : 0u);
  }
  return e;
}

// A lane's share of the 68-byte key entry: its 4 codes, and its block's scale byte.
DSUF_DEVICE void index_entry_fp4(u8* entry, const u32 code[4], int e, int lane) {
  *reinterpret_cast<u16*>(entry + 2 * lane) = (u16)(code[0] | (code[1] << 4) | (code[2] << 8) | (code[3] << 12));
  if ((lane & 7) == 0) entry[IDX_DIM / 2 + (lane >> 3)] = (u8)(e + 127);
}
