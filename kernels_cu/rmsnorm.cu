// RMSNorm as the reference computes it (layers.rms_norm): the sum of squares in float64,
// r = float(1 / sqrt(mean + eps)), y = bf16(w * (x * r)) in float32; w may be absent (the V4
// per-head q norm). hc_collapse_rmsnorm first collapses the mHC streams, y = sum_i pre_i X_i in
// float64 rounded to float32 then bf16 (layers.hc_collapse), and normalises that: the pair that
// precedes every attention and MoE block. rmsnorm_rope_bf16 then rotates the last 64 dims of
// each row as layers.Rope.apply does (GPT-J pairs, products and sums rounded, on the bf16 output): the
// per-head q norm and the kv norm, each followed by RoPE. hc_pre_collapse_rmsnorm_bf16 is
// hc_collapse_rmsnorm_bf16 with pre formed from the mHC site's mixes in the kernel (a decode
// site's block input: mhc.cu makes post and comb meanwhile). One CTA of 256 threads per row, 8
// elements a thread per pass, D % 8 == 0 and D <= 8192; a thread requests all of its row's
// vectors (of all 4 streams, for a collapse) before it uses any, so their latencies overlap.
//
// Every kernel can also write its bf16 output FP8-quantised as act_quant.cu would quantise it
// (xq e4m3 [rows, D], sx float32 [rows, D/128]; D % 128 == 0): the 16 threads that hold a
// 128-block find its amax with shuffles. Where out is null only the quantised rows are written.
// This saves the FP8 linear that follows a norm its own act_quant launch.
#include "mhc.cuh"

#define VPT 4  // 16-byte vectors per thread: D <= 256 * 8 * VPT

// The 8 bf16 values o of a thread at column d of `row`, FP8-quantised with the scale of their
// 128-block (its 16 threads: the lanes of one half-warp).
DSUF_DEVICE void quantize8(const u32 (&o)[4], u8* __restrict__ xq, float* __restrict__ sx, i64 row, int d, int D) {
  float f[8];
  float amax = unpack_bf16_amax(o, f);
  const u32 half = 0xffffu << (threadIdx.x & 16);
#pragma unroll
  for (int s = 8; s; s >>= 1) amax = fmaxf(amax, __shfl_xor_sync(half, amax, s));
  const int e = act_scale_exponent(amax);
  *reinterpret_cast<uint2*>(xq + row * D + d) = make_uint2(quant4_e4m3(f[0], f[1], f[2], f[3], e), quant4_e4m3(f[4], f[5], f[6], f[7], e));
  if ((threadIdx.x & 15) == 0) sx[row * (D >> 7) + (d >> 7)] = pow2f(e);
}

// A row's input in registers: its 16-byte vectors of each of the N streams (N = 0: one plain row).
// All of them are requested before any is used, so their latencies overlap.
template <int N>
struct RowIn {
  uint4 raw[VPT][N > 0 ? N : 1];
};

// Rows are handled by TPR threads each: 256 (a CTA a row) or 32 (a warp a row, 8 rows a CTA: rows
// of D <= 32 * 8 * VPT, many of them, e.g. a prompt chunk's per-head norms).
template <int TPR>
DSUF_DEVICE int row_of_thread() { return blockIdx.x * (256 / TPR) + threadIdx.x / TPR; }

template <int N, int TPR = 256>
DSUF_DEVICE void load_row(const u16* __restrict__ x, int D, RowIn<N>& in) {
  const int row = row_of_thread<TPR>();
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int d = (threadIdx.x % TPR + v * TPR) * 8;
    if (d < D) {
#pragma unroll
      for (int i = 0; i < (N > 0 ? N : 1); ++i) in.raw[v][i] = *reinterpret_cast<const uint4*>(x + ((i64)row * (N > 0 ? N : 1) + i) * D + d);
    }
  }
}

// pre: the row's N collapse coefficients (N > 0); cos_t / sin_t [positions, 32] or null (no
// rotation); row r is at position r / per_pos. parts > 1 (TPR = 256, at most 8, D / parts a multiple
// of 128): the CTAs of ranks 0 .. parts - 1 of a cluster share the row, rank `part` taking its
// part-th range of D; their sums of squares meet in every one's shared memory and add up in rank order.
template <int N, int TPR = 256>
DSUF_DEVICE void norm_row(const RowIn<N>& in, const float* __restrict__ pre, const float* __restrict__ w, u16* __restrict__ out,
                          u8* __restrict__ xq, float* __restrict__ sx, int D, float eps,
                          const float* __restrict__ cos_t = nullptr, const float* __restrict__ sin_t = nullptr, int per_pos = 1,
                          int part = 0, int parts = 1) {
  __shared__ double partial[8], shares[8];
  const int lo = part * (D / parts), hi = lo + D / parts;
  const int row = row_of_thread<TPR>();
  float y[VPT][8];
  double ss = 0.0;
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int d = (threadIdx.x % TPR + v * TPR) * 8;
    if (d >= D) break;
    if (d < lo || d >= hi) continue;
    if (N > 0) {
      double s[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const double p = pre[i];
        const u32 q[4] = {in.raw[v][i].x, in.raw[v][i].y, in.raw[v][i].z, in.raw[v][i].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          s[2 * k] += p * (double)bf16_to_f32(q[k] & 0xffff);
          s[2 * k + 1] += p * (double)bf16_to_f32(q[k] >> 16);
        }
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) y[v][k] = bf16_to_f32(f32_to_bf16((float)s[k]));
    } else {
      const u32 q[4] = {in.raw[v][0].x, in.raw[v][0].y, in.raw[v][0].z, in.raw[v][0].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        y[v][2 * k] = bf16_to_f32(q[k] & 0xffff);
        y[v][2 * k + 1] = bf16_to_f32(q[k] >> 16);
      }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) ss += (double)y[v][k] * (double)y[v][k];
  }
  ss = warp_sum(ss);
  double total = ss;
  if (TPR == 256) {
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    total = 0.0;
#pragma unroll
    for (int i = 0; i < 8; ++i) total += partial[i];
    if (parts > 1) {
      if (threadIdx.x < parts) st_cluster_f64(smem_addr(&shares[part]), threadIdx.x, total);
      cluster_sync();
      total = 0.0;
      for (int q = 0; q < parts; ++q) total += shares[q];
    }
  }
  const float r = (float)(1.0 / sqrt(total / D + (double)eps));

#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int d = (threadIdx.x % TPR + v * TPR) * 8;
    if (d >= D) break;
    if (d < lo || d >= hi) continue;
    u32 o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float a = y[v][2 * k] * r, b = y[v][2 * k + 1] * r;
      if (w) {
        a = w[d + 2 * k] * a;
        b = w[d + 2 * k + 1] * b;
      }
      o[k] = bf16x2(a, b);
      const int pair = (d + 2 * k - (D - 2 * ROPE_PAIRS)) / 2;
      if (cos_t && pair >= 0) o[k] = rotate_pair(o[k], cos_t[(row / per_pos) * ROPE_PAIRS + pair], sin_t[(row / per_pos) * ROPE_PAIRS + pair]);
    }
    if (out) *reinterpret_cast<uint4*>(out + (i64)row * D + d) = make_uint4(o[0], o[1], o[2], o[3]);
    if (xq) quantize8(o, xq, sx, row, d, D);
  }
}

// x [rows, D] bf16, w [D] float32 or null -> out [rows, D] bf16 and / or (xq, sx).
extern "C" __global__ void __launch_bounds__(256) rmsnorm_bf16(
    const u16* x, const float* w, u16* out, u8* xq, float* sx, int D, float eps) {
  pdl_begin();
  RowIn<0> in;
  load_row(x, D, in);
  norm_row(in, nullptr, w, out, xq, sx, D, eps);
}

// x [rows, D] bf16, w [D] float32 or null -> out [rows, D] bf16, its last 64 dims rotated by
// cos / sin float32 [rows / per_pos, 32].
extern "C" __global__ void __launch_bounds__(256) rmsnorm_rope_bf16(
    const u16* x, const float* w, u16* out, int D, float eps, const float* cos_t, const float* sin_t, int per_pos) {
  pdl_begin();
  RowIn<0> in;
  load_row(x, D, in);
  norm_row(in, nullptr, w, out, nullptr, nullptr, D, eps, cos_t, sin_t, per_pos);
}

// The same two kernels with a warp a row, 8 rows a CTA (D <= 1024; rows: the row count).
extern "C" __global__ void __launch_bounds__(256) rmsnorm_warp_bf16(
    const u16* x, const float* w, u16* out, u8* xq, float* sx, int D, float eps, int rows) {
  pdl_begin();
  if (row_of_thread<32>() >= rows) return;  // a whole warp: its row is past the end
  RowIn<0> in;
  load_row<0, 32>(x, D, in);
  norm_row<0, 32>(in, nullptr, w, out, xq, sx, D, eps);
}

extern "C" __global__ void __launch_bounds__(256) rmsnorm_rope_warp_bf16(
    const u16* x, const float* w, u16* out, int D, float eps, const float* cos_t, const float* sin_t, int per_pos, int rows) {
  pdl_begin();
  if (row_of_thread<32>() >= rows) return;
  RowIn<0> in;
  load_row<0, 32>(x, D, in);
  norm_row<0, 32>(in, nullptr, w, out, nullptr, nullptr, D, eps, cos_t, sin_t, per_pos);
}

// X [rows, 4, D] bf16 streams, pre [rows, 4] float32, w [D] float32 -> out [rows, D] bf16 (and
// (xq, sx) unless null).
extern "C" __global__ void __launch_bounds__(256) hc_collapse_rmsnorm_bf16(
    const u16* x, const float* pre, const float* w, u16* out, u8* xq, float* sx, int D, float eps) {
  pdl_begin();
  RowIn<HC_N> in;
  load_row(x, D, in);
  norm_row(in, pre + (i64)blockIdx.x * HC_N, w, out, xq, sx, D, eps);
}

// X [rows, 4, D] bf16 streams, mix [rows, 24] float32 (the site's mixes), scale [3], base [24],
// w [D] float32 -> out [rows, D] bf16 (and (xq, sx) unless null).
extern "C" __global__ void __launch_bounds__(256) hc_pre_collapse_rmsnorm_bf16(
    const u16* x, const float* mix, const float* scale, const float* base, float hc_eps, const float* w, u16* out, u8* xq, float* sx,
    int D, float eps) {
  pdl_begin();
  __shared__ float pre[HC_N];
  RowIn<HC_N> in;
  load_row(x, D, in);  // in flight while pre is formed
  if (threadIdx.x < HC_N) pre[threadIdx.x] = hc_pre_value(mix[(i64)blockIdx.x * HC_MIXES + threadIdx.x], scale[0], base[threadIdx.x], hc_eps);
  __syncthreads();
  norm_row(in, pre, w, out, xq, sx, D, eps);
}

// A decode site's block input in one launch (tokens <= 8, D <= 8192): grid (T, rows * S), clusters
// of HC_N * S CTAs along y: rows 4c .. 4c + 3 of fn, each by S CTAs (rank j + HC_N h: row 4c + j,
// streams [h n / S, (h + 1) n / S) of its K), so cluster (t, 0) holds the rows of pre. A CTA sums
// its share of a mix as mhc.cu's hc_mixes does (its share of the row of fn brought into shared
// memory by the copy engine before the PDL wait; float64 sums) from the token's streams, which it
// keeps in registers (load_row); with S = 2 the second share meets the first in its CTA through
// distributed shared memory and they add up in share order. The mixes of rows 0..3 go to every
// CTA of the cluster, and each forms pre and its part of the block input from the same registers
// (norm_row over the cluster: the float64 collapse bounds a CTA, so it is spread). Every mix is
// written out for the Sinkhorn (hc_coefficients), which makes post and comb meanwhile. This is
// hc_mixes followed by hc_pre_collapse_rmsnorm_bf16 without the second launch's latency. S = 2
// (hc_block_input_split_bf16) where the SMs would otherwise idle: a few tokens.
template <int S>
DSUF_DEVICE void hc_block_input_body(const u16* x, const float* fn, float* mix, const float* scale, const float* base, float hc_eps,
                                     const float* w, u16* out, u8* xq, float* sx, int D, float eps, double mix_eps) {
  constexpr int CLUSTER = HC_N * S, SN = HC_N / S;  // CTAs a cluster, streams a CTA's share
  extern __shared__ __align__(16) float fs[];          // the CTA's share of its row of fn [SN * D]
  __shared__ u64 bar;
  __shared__ double part[2][8], other[2];
  __shared__ float pre_mix[HC_N], pre[HC_N];
  const int tok = blockIdx.x, rank = blockIdx.y % CLUSTER, h = rank / HC_N, j = rank % HC_N;
  const int r = blockIdx.y / CLUSTER * HC_N + j, len = SN * D;
  if (threadIdx.x == 0) {
    mbar_init(&bar);
    mbar_expect_bytes(&bar, len * 4);
    bulk_stream(fs, fn + ((i64)r * HC_N + h * SN) * D, len * 4, &bar);
  }
  pdl_begin();
  RowIn<HC_N> in;
  load_row(x, D, in);
  __syncthreads();  // the barrier's initialisation is visible to every thread
  mbar_wait(&bar, 0);
  double dot = 0.0, sq = 0.0;
#pragma unroll
  for (int v = 0; v < VPT; ++v) {
    const int d = (threadIdx.x + v * 256) * 8;
    if (d >= D) break;
#pragma unroll
    for (int i = 0; i < SN; ++i) hc_mix_add8(h ? in.raw[v][(i + SN) % HC_N] : in.raw[v][i], fs + i * D + d, dot, sq);  // (no dynamic index: registers)
  }
  double2 sums = hc_mix_sums(dot, sq, part);
  if (S > 1) {  // the second share to the first's CTA
    if (h == 1 && threadIdx.x == 0) {
      st_cluster_f64(smem_addr(&other[0]), j, sums.x);
      st_cluster_f64(smem_addr(&other[1]), j, sums.y);
    }
    cluster_sync();
    sums = make_double2(sums.x + other[0], sums.y + other[1]);
  }
  const float m = h == 0 && threadIdx.x == 0 ? hc_mix_value(sums.x, sums.y, HC_N * D, mix_eps) : 0.0f;
  if (h == 0 && threadIdx.x == 0) mix[(i64)tok * HC_MIXES + r] = m;
  const float m0 = __shfl_sync(0xffffffffu, m, 0);  // thread 0's mix for the lanes that send it (warp 0)
  if (r < HC_N && h == 0 && threadIdx.x < CLUSTER) st_cluster_f32(smem_addr(&pre_mix[r]), threadIdx.x, m0);
  if (r >= HC_N) return;  // (whole clusters: those of rows 4 and up synchronise no further)
  cluster_sync();         // pre_mix is complete in every rank, and no CTA writes it again
  // The block input: a part of D by each CTA of the cluster, or all of it by rank 0 where D does
  // not split into parts of whole 128-blocks.
  const int parts = D % (CLUSTER * 128) ? 1 : CLUSTER;
  if (rank >= parts) return;
  if (threadIdx.x < HC_N) pre[threadIdx.x] = hc_pre_value(pre_mix[threadIdx.x], scale[0], base[threadIdx.x], hc_eps);
  __syncthreads();
  norm_row(in, pre, w, out, xq, sx, D, eps, nullptr, nullptr, 1, rank, parts);
}

extern "C" __global__ void __cluster_dims__(1, HC_N, 1) __launch_bounds__(256) hc_block_input_bf16(
    const u16* x, const float* fn, float* mix, const float* scale, const float* base, float hc_eps, const float* w, u16* out,
    u8* xq, float* sx, int D, float eps, double mix_eps) {
  hc_block_input_body<1>(x, fn, mix, scale, base, hc_eps, w, out, xq, sx, D, eps, mix_eps);
}

extern "C" __global__ void __cluster_dims__(1, 2 * HC_N, 1) __launch_bounds__(256) hc_block_input_split_bf16(
    const u16* x, const float* fn, float* mix, const float* scale, const float* base, float hc_eps, const float* w, u16* out,
    u8* xq, float* sx, int D, float eps, double mix_eps) {
  hc_block_input_body<2>(x, fn, mix, scale, base, hc_eps, w, out, xq, sx, D, eps, mix_eps);
}
