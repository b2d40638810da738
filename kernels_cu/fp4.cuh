// FP4 expert weights in the kernels' layout (dsuf.gpu.moe.permute_fp4): loads and the conversion
// to e4m3, shared by the decode GEMMs (gemm.cu) and the prompt-chunk GEMM (moe_prefill.cu).
#pragma once
#include "common.cuh"

DSUF_DEVICE u32 ld_nc4(const void* p) {
  u32 v;
  asm("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// A kernel-layout FP4 word to two words of e4m3 bytes holding value * 2**-6 (exact: an e2m1
// code's 3 magnitude bits are the e4m3 exponent's low bits and mantissa's top bit, subnormals
// included): byte j of `odd` from byte j's odd element, of `even` from its even element. The
// load-time bit layout makes `odd` one mask and `even` two rotations and masks.
DSUF_DEVICE u32 fp4_odd_e4m3(u32 w) { return w & 0x9c9c9c9cu; }
DSUF_DEVICE u32 fp4_even_e4m3(u32 w) { return (__funnelshift_l(w, w, 2) & 0x88888888u) | (__funnelshift_r(w, w, 4) & 0x14141414u); }

// Byte I (compile-time) of four E8M0 codes as float: e8m0_to_f32's value (code 0: 2**-127).
template <int I>
DSUF_DEVICE float e8m0_byte(u32 s) {
  const u32 bits = (I < 3 ? s << (23 - 8 * I) : s >> 1) & 0x7f800000u;
  return __int_as_float(max(bits, 0x00400000u));
}

// Four e4m3 bytes as fp4_*_e4m3 give them (e2m1 values times 2**-6) times 2**o, o in 0..12,
// exactly: a normal byte's exponent field grows by o (at most 3 + 12: no NaN, no carry into the
// sign); the subnormal 0.5 * 2**-6 becomes the normal 2**(o - 7) when o > 0 (sub = 2o - 1, else
// 0); zeros stay.
DSUF_DEVICE u32 e4m3_times_pow2(u32 x, u32 o, u32 sub) {
  const u32 normal = ((x & 0x18181818u) + 0x78787878u) & 0x80808080u;  // bit 7 of each byte with a nonzero exponent
  const u32 half = x & ~(normal >> 5) & 0x04040404u;                     // bit 2 of each subnormal byte
  return x + (normal >> 4) * o + half * sub;
}
