// FP4 expert weights in the kernels' layout (dsuf.gpu.moe.permute_fp4): loads and the conversion
// to e4m3, shared by the decode GEMMs (gemm.cu) and the prompt-chunk GEMM (moe_prefill.cu).
#pragma once
#include "common.cuh"

DSUF_DEVICE u32 ld_nc4(const void* p) {
  u32 v;
  asm("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// A kernel-layout FP4 word (dsuf.gpu.moe.permute_fp4) to two words of e4m3 bytes: byte j of
// `even` from the even element of the checkpoint word's byte j, of `odd` from its odd element.
// The word holds the even elements' 3-bit magnitudes in nibbles 0-3 and the odd ones' in nibbles
// 4-7, each a byte-permute selector into an 8-byte table of the magnitudes' e4m3 bytes (lo:
// magnitudes 0-3, hi: 4-7); the even elements' signs sit at bits 8j + 7, where `even` needs them,
// the odd ones' at 8j + 3, four bits below. Seven operations a word, whatever the table holds.
DSUF_DEVICE u32 prmt(u32 lo, u32 hi, u32 selector) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(selector));
  return r;
}
DSUF_DEVICE void fp4_e4m3(u32 w, u32 lo, u32 hi, u32& even, u32& odd) {
  const u32 mag = w & 0x77777777u;  // (a selector's bit 3 would replicate the byte's sign)
  even = prmt(lo, hi, mag) | (w & 0x80808080u);
  odd = prmt(lo, hi, mag >> 16) | ((w << 4) & 0x80808080u);
}

// The table of e2m1 magnitudes 0, 0.5, 1, 1.5 | 2, 3, 4, 6 times 2**-6 as e4m3 (exact; 0.5 * 2**-6
// is the subnormal 0x04), and the same times 2**o, o in 0..12, exactly: a normal byte's exponent
// field grows by o (at most 3 + 12: no NaN, no carry into the sign), the subnormal becomes the
// normal 2**(o - 7) when o > 0, zero stays.
#define FP4_E4M3_LO 0x0c080400u
#define FP4_E4M3_HI 0x1c181410u
DSUF_DEVICE void fp4_e4m3_table(u32 o, u32& lo, u32& hi) {
  const u32 o8 = o << 3;
  lo = (FP4_E4M3_LO & 0xffff00ffu) + o8 * 0x01010000u + (max(o8, 4u) << 8);  // byte 1: the subnormal's place
  hi = FP4_E4M3_HI + o8 * 0x01010101u;
}

// fp4_e4m3 by the table of o = 0 (the decode GEMMs scale each 32-element step in fp32) with its
// two words made at each use, for kernels capped at 64 registers (4 CTAs an SM): held in
// registers across their loop, the table spills them.
DSUF_DEVICE void fp4_e4m3_unscaled(u32 w, u32& even, u32& odd) {
  u32 lo, hi;
  asm volatile("mov.b32 %0, %1;" : "=r"(lo) : "n"(FP4_E4M3_LO));
  asm volatile("mov.b32 %0, %1;" : "=r"(hi) : "n"(FP4_E4M3_HI));
  fp4_e4m3(w, lo, hi, even, odd);
}

// Byte I (compile-time) of four E8M0 codes as float: e8m0_to_f32's value (code 0: 2**-127).
template <int I>
DSUF_DEVICE float e8m0_byte(u32 s) {
  const u32 bits = (I < 3 ? s << (23 - 8 * I) : s >> 1) & 0x7f800000u;
  return __int_as_float(max(bits, 0x00400000u));
}
