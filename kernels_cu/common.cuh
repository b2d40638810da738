// Shared device helpers for the dsuf kernels. Self-contained (no CUDA headers), so NVRTC needs no
// include path: bf16/e4m3 conversions go through PTX `cvt`, scales are built from their bits.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define DSUF_DEVICE __device__ __forceinline__

// Programmatic dependent launch: every kernel is launched so that it may be scheduled while the
// kernel before it on the stream is still running (runtime.py). Each begins here: wait until the
// kernel before has finished and its writes are visible, then allow the next kernel to be
// scheduled in turn, so that one kernel's launch overlaps the tail of the one before. Hence a
// kernel that has started finds every kernel before its predecessor finished (the predecessor
// allowed it only after its own wait): what those wrote (a decode step's indices, made at the
// step's start) may be read before pdl_begin, its latency hidden behind the predecessor's.
DSUF_DEVICE void pdl_begin() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Float32-rounded 1/448 (0x3b124925): the reference multiplies amax by this rather than dividing.
#define FP8_MAX 448.0f
#define FP8_MAX_INV __int_as_float(0x3b124925)
#define FP8_AMAX_FLOOR 1e-4f

DSUF_DEVICE float bf16_to_f32(u16 h) { return __int_as_float(((u32)h) << 16); }

DSUF_DEVICE u16 f32_to_bf16(float f) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// Two floats to two e4m3 bytes, round-to-nearest-even, saturating at ±448: lo goes to the low byte.
DSUF_DEVICE u32 f32x2_to_e4m3x2(float lo, float hi) {
  u16 d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

// E8M0 scale byte to 2**(code - 127); code 0 is the float32 subnormal 2**-127.
DSUF_DEVICE float e8m0_to_f32(u32 code) {
  return __int_as_float(code ? (code << 23) : 0x00400000u);
}

// DeepSeek's activation scale: 2**ceil(log2(max(amax, 1e-4) * f32(1/448))), exponent read from
// the bits (a float log can land on the wrong side of a power of two). Returns the exponent.
DSUF_DEVICE int act_scale_exponent(float amax) {
  u32 bits = __float_as_uint(fmaxf(amax, FP8_AMAX_FLOOR) * FP8_MAX_INV);
  return (int)((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffff) != 0);
}

DSUF_DEVICE float pow2f(int e) { return __int_as_float((u32)(e + 127) << 23); }

// Quantise 4 floats with the power-of-two scale 2**e: round_e4m3(clamp(x * 2**-e, ±448)).
// Scaling by a power of two is exact, so this equals the reference's division.
DSUF_DEVICE u32 quant4_e4m3(float a, float b, float c, float d, int e) {
  float inv = pow2f(-e);
  u32 lo = f32x2_to_e4m3x2(a * inv, b * inv);
  u32 hi = f32x2_to_e4m3x2(c * inv, d * inv);
  return lo | (hi << 16);
}

DSUF_DEVICE float warp_max(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

DSUF_DEVICE double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// 16-byte streaming load of data read once (weights): skip L1. Not volatile: the data is
// constant during a launch, so the compiler may hoist these loads for more bytes in flight.
DSUF_DEVICE uint4 ld_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16-byte load of data no kernel writes during this one (activations of the kernel before).
DSUF_DEVICE uint4 ld_nc16(const void* p) {
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

DSUF_DEVICE uint2 ld_nc8(const void* p) {
  uint2 v;
  asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

DSUF_DEVICE u32 word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

DSUF_DEVICE u32 mul_bf16x2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// e4m3 bytes 1 and 3 of q as bf16x2 (byte 1 low), exactly: sign and the 7 magnitude bits slide
// into bf16's fields, which reads them with bias 127 instead of 7 (e4m3 subnormals land on bf16
// subnormals); the multiply by 2**120 restores the value.
DSUF_DEVICE u32 e4m3_odd_to_bf16x2(u32 q) {
  return mul_bf16x2((q & 0x80008000u) | ((q & 0x7f007f00u) >> 4), 0x7b807b80u);
}

DSUF_DEVICE u32 e4m3_even_to_bf16x2(u32 q) { return e4m3_odd_to_bf16x2(q << 8); }

// The bf16 A fragments of four m16n8k16 MMAs from a 16x64 e4m3 tile: w0 holds a lane's 16 bytes
// of row g, w1 of row g + 8; a[s] covers bytes 4s..4s+3 of both (even bytes, then odd).
DSUF_DEVICE void e4m3_a_fragments(u32 a[4][4], uint4 w0, uint4 w1) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const u32 q0 = word(w0, s), q1 = word(w1, s);
    a[s][0] = e4m3_even_to_bf16x2(q0);
    a[s][1] = e4m3_even_to_bf16x2(q1);
    a[s][2] = e4m3_odd_to_bf16x2(q0);
    a[s][3] = e4m3_odd_to_bf16x2(q1);
  }
}

// D = A(16x32 e4m3, row) * B(32x8 e4m3, col) + 0, fp32 result (see fragment layout in gemm.cuh).
DSUF_DEVICE void mma_e4m3(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %10, %10, %10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
}

DSUF_DEVICE void mma_e4m3_acc(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four e4m3 bytes to two f16 pairs: lo = bytes 0-1, hi = bytes 2-3 (exact: f16 holds every e4m3).
struct F16Quad {
  u32 lo, hi;
};
DSUF_DEVICE F16Quad e4m3x4_to_f16(u32 v) {
  F16Quad h;
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(h.lo), "=r"(h.hi)
      : "r"(v));
  return h;
}

// mma_e4m3 with B already in f16: sm_90 runs an e4m3 mma.sync as two m16n8k16 f16 products of
// its operands converted to f16 (k bytes 0-1 of each register, then bytes 2-3); doing the same
// here gives the same bits, and lets B be converted once for all the warps that share it:
// b = {b0 bytes 0-1, b1 bytes 0-1, b0 bytes 2-3, b1 bytes 2-3} as f16 pairs.
DSUF_DEVICE void mma_e4m3_f16b(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, const uint4& b) {
  const F16Quad h0 = e4m3x4_to_f16(a0), h1 = e4m3x4_to_f16(a1), h2 = e4m3x4_to_f16(a2), h3 = e4m3x4_to_f16(a3);
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %10, %10, %10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(h0.lo), "r"(h1.lo), "r"(h2.lo), "r"(h3.lo), "r"(b.x), "r"(b.y), "f"(0.0f));
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(h0.hi), "r"(h1.hi), "r"(h2.hi), "r"(h3.hi), "r"(b.z), "r"(b.w));
}

// B of mma_e4m3 (b0, b1: e4m3 quads) in mma_e4m3_f16b's form.
DSUF_DEVICE uint4 e4m3_b_to_f16(u32 b0, u32 b1) {
  const F16Quad h0 = e4m3x4_to_f16(b0), h1 = e4m3x4_to_f16(b1);
  return make_uint4(h0.lo, h1.lo, h0.hi, h1.hi);
}

// One 128-byte K block of a 16-row e4m3 weight tile times 8 e4m3 token columns, fp32 result (the
// FP8 linears' fragments, lane = 4g + t): w[0], w[1] = row g's 16 bytes at 16t and 64 + 16t,
// w[2], w[3] = row g + 8's; x[0], x[1] = token g's at the same offsets. Step s uses words 2s,
// 2s + 1 of each 32 bytes.
DSUF_DEVICE void mma_e4m3_kblock(float d[4], const uint4 (&w)[4], const uint4 (&x)[2]) {
  mma_e4m3(d, w[0].x, w[2].x, w[0].y, w[2].y, x[0].x, x[0].y);
  mma_e4m3_acc(d, w[0].z, w[2].z, w[0].w, w[2].w, x[0].z, x[0].w);
  mma_e4m3_acc(d, w[1].x, w[3].x, w[1].y, w[3].y, x[1].x, x[1].y);
  mma_e4m3_acc(d, w[1].z, w[3].z, w[1].w, w[3].w, x[1].z, x[1].w);
}

// mma_e4m3_kblock with the activations as mma_e4m3_f16b's B, x[i] for the i-th of the four
// mmas: the same products and additions (sm_90's e4m3 mma adds a fresh product to the accumulator).
DSUF_DEVICE void mma_e4m3_kblock_f16b(float d[4], const uint4 (&w)[4], const uint4 (&x)[4]) {
  float e[4];
  mma_e4m3_f16b(d, w[0].x, w[2].x, w[0].y, w[2].y, x[0]);
#pragma unroll
  for (int i = 1; i < 4; ++i) {
    const uint4& wa = w[i >> 1];
    const uint4& wb = w[2 + (i >> 1)];
    if (i & 1) {
      mma_e4m3_f16b(e, wa.z, wb.z, wa.w, wb.w, x[i]);
    } else {
      mma_e4m3_f16b(e, wa.x, wb.x, wa.y, wb.y, x[i]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) d[j] += e[j];
  }
}

// D += A(16x16 bf16, row) * B(16x8 bf16, col), fp32 accumulators. Fragments (PTX ISA), lane = 4g + t:
// a0 = (row g, k 2t..2t+1), a1 = (row g+8, same k), a2 = (row g, k 2t+8..), a3 = (row g+8, k 2t+8..);
// b0 = (k 2t..2t+1, column g), b1 = (k 2t+8.., column g); d0, d1 = (row g, columns 2t, 2t+1),
// d2, d3 = (row g+8, same columns).
DSUF_DEVICE void mma_bf16(float d[4], const u32 a[4], u32 b0, u32 b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

DSUF_DEVICE u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Four 8x8 b16 matrices from shared memory; lane i gives the address of row i % 8 of matrix i / 8,
// and receives (row g, elements 2t, 2t+1) of each matrix (.trans: (rows 2t, 2t+1, element g)).
DSUF_DEVICE void ldmatrix_x4(u32 r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

DSUF_DEVICE void ldmatrix_x4_trans(u32 r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// Two e4m3 bytes (low byte first) to two floats, exactly (through f16, which holds every e4m3).
DSUF_DEVICE void e4m3x2_to_f32x2(u32 v, float& lo, float& hi) {
  u32 h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((u16)v));
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}"
      : "=f"(lo), "=f"(hi)
      : "r"(h2));
}

// silu in float64, rounded to float32 (the reference's f64(F.silu, gate)).
DSUF_DEVICE float silu_f64(float g) {
  const double x = g;
  return (float)(x / (1.0 + exp(-x)));
}

// One element of layers.Expert's SwiGLU: up clamped to [-limit, limit], gate to at most limit
// (limit > 0), silu(gate) in float64 rounded to float32, times up, times the routing weight w
// (w_row: null for none), each product rounded to float32.
DSUF_DEVICE float swiglu_value(float gate, float up, const float* w_row, float limit) {
  if (limit > 0.0f) {
    up = fminf(fmaxf(up, -limit), limit);
    gate = fminf(gate, limit);
  }
  return w_row ? *w_row * (silu_f64(gate) * up) : silu_f64(gate) * up;
}

DSUF_DEVICE u32 bf16x2(float lo, float hi) { return f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16); }

// The 2N bf16 values packed in N words as floats (low half first), and their largest magnitude.
template <int N>
DSUF_DEVICE float unpack_bf16_amax(const u32 (&w)[N], float (&v)[2 * N]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    v[2 * i] = bf16_to_f32(w[i] & 0xffff);
    v[2 * i + 1] = bf16_to_f32(w[i] >> 16);
    amax = fmaxf(amax, fmaxf(fabsf(v[2 * i]), fabsf(v[2 * i + 1])));
  }
  return amax;
}

// RoPE (layers.Rope.apply, GPT-J pairs) on the trailing 2 * ROPE_PAIRS dims of a head: the pair
// (x0, x1) of bf16x2 v -> (x0 c - x1 s, x0 s + x1 c), each product and sum rounded to float32 (no
// FMA), back to bf16; s negated is the inverse rotation.
#define ROPE_PAIRS 32
DSUF_DEVICE u32 rotate_pair(u32 v, float c, float s) {
  const float x0 = bf16_to_f32(v & 0xffff), x1 = bf16_to_f32(v >> 16);
  return bf16x2(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)), __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
}

// ---- thread-block clusters: rank, barrier, reads of another CTA's shared memory ----

DSUF_DEVICE u32 cluster_ctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster: shared-memory writes before it are visible after it.
DSUF_DEVICE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

DSUF_DEVICE u32 cluster_addr(u32 addr, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}

// 16 bytes at a shared-memory address of CTA `rank` of the cluster.
DSUF_DEVICE float4 ld_cluster_f4(u32 addr, u32 rank) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(cluster_addr(addr, rank))
               : "memory");
  return v;
}

// A double at a shared-memory address of CTA `rank` of the cluster.
DSUF_DEVICE double ld_cluster_f64(u32 addr, u32 rank) {
  double v;
  asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(cluster_addr(addr, rank)) : "memory");
  return v;
}

// A float into shared memory at an address of CTA `rank` of the cluster.
DSUF_DEVICE void st_cluster_f32(u32 addr, u32 rank, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(cluster_addr(addr, rank)), "f"(v) : "memory");
}

// A double into shared memory at an address of CTA `rank` of the cluster.
DSUF_DEVICE void st_cluster_f64(u32 addr, u32 rank, double v) {
  asm volatile("st.shared::cluster.f64 [%0], %1;" ::"r"(cluster_addr(addr, rank)), "d"(v) : "memory");
}

// ---- warpgroup mma (sm_90a only: Blackwell has none) ----

// Shared-memory matrix descriptor without swizzle: the start address, LBO (bytes between core
// matrices adjacent in K) and SBO (adjacent in M or N); a core matrix is 8 rows of 16 bytes, 128
// contiguous bytes.
DSUF_DEVICE u64 wgmma_desc(const void* p, u32 lbo, u32 sbo) {
  return (u64)((smem_addr(p) >> 4) & 0x3fff) | ((u64)((lbo >> 4) & 0x3fff) << 16) | ((u64)((sbo >> 4) & 0x3fff) << 32);
}

// Warpgroup mma, issued in a group: wgmma_fence() (the register operands are written), then
// wgmma_e4m3<ACC>: D (+)= A (64x32 e4m3 of the warpgroup, each warp's 16 rows in registers as
// mma_e4m3's A) times B (32x8 e4m3 in shared memory, K-major: desc_b), fp32, D as mma_e4m3's per
// warp, the warpgroup's four warps together; then wgmma_wait() for the group's products, after
// which pin() each register operand so that the compiler kept it unchanged while the tensor cores
// read it. The three calls of wgmma_e4m3_rs in one.
DSUF_DEVICE void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

template <bool ACC>
DSUF_DEVICE void wgmma_e4m3(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %9, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "n"(ACC ? 1 : 0));
#else
  __trap();  // the host picks the wgmma kernels on sm_90a only
#endif
}

DSUF_DEVICE void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

// Until at most N committed groups of this warpgroup are still running.
template <int N>
DSUF_DEVICE void wgmma_wait_for() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}

DSUF_DEVICE void wgmma_wait() { wgmma_commit(), wgmma_wait_for<0>(); }

template <int N>
DSUF_DEVICE void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
DSUF_DEVICE void pin(u32& a) { asm volatile("" : "+r"(a)::"memory"); }
DSUF_DEVICE void pin(uint4& a) { asm volatile("" : "+r"(a.x), "+r"(a.y), "+r"(a.z), "+r"(a.w)::"memory"); }

DSUF_DEVICE void wgmma_e4m3_rs(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc_b) {
  float r[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  wgmma_fence();
  wgmma_e4m3<false>(r, a0, a1, a2, a3, desc_b);
  wgmma_wait();
  pin(r), pin(a0), pin(a1), pin(a2), pin(a3);
  d[0] = r[0], d[1] = r[1], d[2] = r[2], d[3] = r[3];
}

// D (+)= A (64x32 e4m3, registers as wgmma_e4m3's) times B (32xN e4m3, shared memory: desc_b),
// fp32: per warp d[4j .. 4j + 3] = mma_e4m3's D of columns 8j .. 8j + 7 (N/2 floats). Only
// issued: the caller fences before it, commits, waits (wgmma_wait_for<N>) and then pins D and the
// register operands, which the tensor cores use until then.
template <bool ACC>
DSUF_DEVICE void wgmma_e4m3_n16_issue(float (&d)[8], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "n"(ACC ? 1 : 0));
#else
  __trap();  // the host picks the wgmma kernels on sm_90a only
#endif
}

template <bool ACC>
DSUF_DEVICE void wgmma_e4m3_n32_issue(float (&d)[16], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %21, 0;\n wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "n"(ACC ? 1 : 0));
#else
  __trap();  // the host picks the wgmma kernels on sm_90a only
#endif
}

template <bool ACC>
DSUF_DEVICE void wgmma_e4m3_n64_issue(float (&d)[32], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "n"(ACC ? 1 : 0));
#else
  __trap();  // the host picks the wgmma kernels on sm_90a only
#endif
}

template <bool ACC>
DSUF_DEVICE void wgmma_e4m3_n128_issue(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "n"(ACC ? 1 : 0));
#else
  __trap();  // the host picks the wgmma kernels on sm_90a only
#endif
}

// Generic-proxy shared-memory writes made visible to the tensor cores' (async proxy) reads.
DSUF_DEVICE void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---- bulk copies global -> shared memory, completed on an mbarrier (sm_90) ----

// One thread: n barriers each expecting `arrivals` (the thread that posts the copies), made
// visible to the copy engine by one fence; the CTA synchronises before anyone waits on them.
DSUF_DEVICE void mbar_init(u64* bars, int n = 1, int arrivals = 1) {
  for (int b = 0; b < n; ++b) asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&bars[b])), "r"(arrivals) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The posting thread: the barrier's phase completes once `bytes` have landed.
DSUF_DEVICE void mbar_expect_bytes(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// One of the arrivals a barrier expects.
DSUF_DEVICE void mbar_arrive(u64* bar) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory"); }

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to this CTA's shared memory.
DSUF_DEVICE void bulk_copy(void* dst, const void* src, u32 bytes, u64* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// The L2 policy of data a decode step reads once: its lines are evicted first, so that what the
// step reads again (the kernels' code, activations, caches) stays in L2 while a layer's ~130 MB
// of weights pass through its 50 MB.
DSUF_DEVICE u64 l2_evict_first() {
  u64 policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// bulk_copy of weights a decode step reads once, evicted first from L2: the copies of the FP8
// linears' rows (fp8_rows.cu) and of the mHC sites' fn. (The GEMMs' register loads, ld_stream,
// keep the default policy: evict-first there made batch 8 slower, BENCHMARKS milestone 19.)
DSUF_DEVICE void bulk_stream(void* dst, const void* src, u32 bytes, u64* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(l2_evict_first())
               : "memory");
}

// A TMA tensor map (CUtensorMap, made on the host by cuTensorMapEncodeTiled): kept in a
// __grid_constant__ kernel parameter, whose address the copies take.
struct __align__(64) TensorMap {
  u64 opaque[16];
};

// The box at column x (bytes), row y of a 2D tensor map into this CTA's shared memory, row after row.
DSUF_DEVICE void tma_copy_2d(void* dst, const TensorMap* map, int x, int y, u64* bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               ::"r"(smem_addr(dst)), "l"(map), "r"(x), "r"(y), "r"(smem_addr(bar))
               : "memory");
}

DSUF_DEVICE void mbar_wait(u64* bar, u32 parity) {
  u32 done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
}
