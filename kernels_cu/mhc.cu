// Manifold-constrained hyper-connections (mHC) at decode, as layers.HyperConnection and
// layers.hc_expand compute them (n = 4 streams of D):
//   hc_mixes:        mix[t, r] = f32(flat_t . fn_r) * f32(1 / sqrt(mean(flat_t^2) + eps)), flat_t
//                    the n*D stream values, float64 sums; grid (rows of fn, token groups), 512
//                    threads. Each CTA has the copy engine bring its row of fn into shared memory
//                    before it waits for the kernel before it (the weights are constant), so the
//                    row's 64 KB arrive while that kernel still runs; then it takes tokens
//                    blockIdx.y, + gridDim.y, ...
//   hc_coefficients: pre = f32(sigmoid(mix * scale0 + base)) + hc_eps; post = 2 f32(sigmoid(..));
//                    comb = Sinkhorn of softmax(logits) in float64 (row/column normalisation,
//                    `iters` rounds in all); grid (T / 2), a half-warp a token (lane 4j + k
//                    of it holds comb[j, k]).
//   hc_expand:       X'_k = f32(post_k * out) + f32(sum_j comb[j, k] X_j (float64)), to bf16;
//                    grid (D / 2048, T), 256 threads x 8 dims.
//   hc_chunk_mixes:  hc_mixes for a prompt chunk (64 tokens a CTA, on the float64 tensor cores);
//                    hc_chunk_mixes_s2/_s4/_s8: the same over clusters of 2, 4 or 8 CTAs, each
//                    with a share of the n*D values (a chunk of few tiles fills the SMs).
// At decode a site's block input rms_norm(hc_collapse(X, pre)) needs only the mixes and pre:
// rmsnorm.cu's hc_block_input_bf16 makes the mixes and the block input in one launch (up to 8
// tokens; beyond, hc_mixes and hc_pre_collapse_rmsnorm_bf16, which forms pre from the mixes), while
// hc_coefficients makes post and comb (used only at the site's expand) on another stream.
// Float32 products and sums are written with __fmul_rn / __fadd_rn so that none is contracted to
// an FMA: the reference rounds each of them.
#include "mhc.cuh"

#define MIX_THREADS 512
#define MIX_UNROLL 4  // chunks of 8 a thread has in flight

extern "C" __global__ void __launch_bounds__(MIX_THREADS) hc_mixes(
    const u16* __restrict__ x, const float* __restrict__ fn, float* __restrict__ mix, int D, int T, double eps) {
  extern __shared__ __align__(16) float fs[];  // the CTA's row of fn [n * D]
  __shared__ u64 bar;
  __shared__ double part[2][MIX_THREADS / 32];
  const int r = blockIdx.x, rows = gridDim.x, len = HC_N * D;
  if (threadIdx.x == 0) {
    mbar_init(&bar);
    mbar_expect_bytes(&bar, len * 4);
    bulk_stream(fs, fn + (i64)r * len, len * 4, &bar);
  }
  pdl_begin();
  __syncthreads();
  mbar_wait(&bar, 0);
  for (int tok = blockIdx.y; tok < T; tok += gridDim.y) {
    const u16* xt = x + (i64)tok * len;
    double dot = 0.0, sq = 0.0;
    for (int i0 = 8 * threadIdx.x; i0 < len; i0 += 8 * MIX_THREADS * MIX_UNROLL) {
      uint4 xv[MIX_UNROLL];
#pragma unroll
      for (int u = 0; u < MIX_UNROLL; ++u) {  // every load of the round issued before any math
        const int i = i0 + 8 * MIX_THREADS * u;
        xv[u] = i < len ? *reinterpret_cast<const uint4*>(xt + i) : make_uint4(0, 0, 0, 0);  // zeros add nothing
      }
#pragma unroll
      for (int u = 0; u < MIX_UNROLL; ++u) {
        const int i = i0 + 8 * MIX_THREADS * u;
        if (i >= len) break;
        hc_mix_add8(xv[u], fs + i, dot, sq);
      }
    }
    const float m = hc_mix_total(dot, sq, part, len, eps);
    if (threadIdx.x == 0) mix[(i64)tok * rows + r] = m;
    __syncthreads();  // part is read before the next token writes it
  }
}

// hc_chunk_mixes: a prompt chunk's mixes on the float64 tensor cores (mma m16n8k16 f64: every
// product of a bf16 stream value and a float32 fn value is exact in float64, and so are the sums
// as far as the float32 result can tell: the sums of hc_mixes in another order). x [T, L] bf16
// (L = n*D, a multiple of CM_CHUNK), fn [HC_MIXES, L]; grid (T / CM_TOKENS rounded up), 256
// threads: warp w takes tokens 16 (w % 4) .. +16 (two 8-token tiles) of the CTA's 64 and all 24
// rows of fn (three 8-row tiles), over half of each chunk of CM_CHUNK values (w / 4); the halves
// are added at the end. Each 32-value group is one 16-byte load a lane of each tile's stream values
// (lane l: token l/4, values 8c .. 8c+7, c = l%4), and of the group's two k-steps of 16, step s
// gives the lane's k c + 4q value 8c + 4s + q: A and B agree on that order, and the dot product
// does not care. fn comes through shared memory as
// float64, a chunk at a time in that fragment order (conflict-free 16-byte loads), converted once
// a CTA. A lane also sums its values' squares (the RMS statistic), in float64 as hc_mixes.
// With S > 1 the S CTAs of a cluster (grid y) take consecutive S-ths of the chunks, and rank 0
// reads the others' sums from their shared memory and adds them in rank order.
#define CM_WARPS 8
#define CM_TOKENS 64
#define CM_CHUNK 128
#define CM_GROUPS (CM_CHUNK / 32)
#define CM_FN_PER_THREAD (HC_MIXES * CM_CHUNK / (32 * CM_WARPS))

// D += A B, m16n8k16 in float64 (sm_90): lane 4g + t holds A rows g (even i) and g + 8 (odd i)
// at k t + 4 (i / 2), B column g at k t + 4 i, D rows g (0, 1) and g + 8 (2, 3) at columns 2t, 2t + 1.
DSUF_DEVICE void dmma_m16n8k16(double (&d)[4], const double (&a)[8], const double (&b)[4]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, {%0, %1, %2, %3};"
               : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
               : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]), "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
}

DSUF_DEVICE void bf16x8_to_f64(const uint4 v, double (&a)[8]) {
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 8; ++j) a[j] = bf16_to_f32(j & 1 ? w[j >> 1] >> 16 : w[j >> 1] & 0xffff);
}

template <int S>
DSUF_DEVICE void chunk_mixes(const u16* __restrict__ x, const float* __restrict__ fn, float* __restrict__ mix, int L, int T, double eps) {
  // fs[buf][((nt * CM_GROUPS + g) * 4 + i) * 32 + lane]: values 8c + 2i, +1 of group g for the
  // lane (row 8 nt + l/4, c = l%4): a lane's 16-byte loads of one i are consecutive (48 KB in
  // all: the static limit). After the loop the same memory holds the second halves' sums:
  // halves[mp][token][row], then their squares, then (S > 1) the CTA's sums, its squares in
  // column HC_MIXES, for rank 0 of the cluster to read.
  __shared__ __align__(16) double2 fs[2][3 * CM_GROUPS * 4 * 32];
  auto halves = reinterpret_cast<double(*)[16][HC_MIXES + 1]>(&fs[0][0]);
  auto half_sq = reinterpret_cast<double(*)[16]>(halves + 4);
  auto sums = reinterpret_cast<double(*)[16][HC_MIXES + 1]>(half_sq + 4);
  static_assert(sizeof(fs) >= sizeof(double) * 4 * 16 * (2 * (HC_MIXES + 1) + 1), "the sums fit where fn was staged");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c = lane & 3, mp = warp & 3, half = warp >> 2;
  const int part = S > 1 ? (int)cluster_ctarank() : 0;
  pdl_begin();
  // This thread's share of fn's chunk: rows e / CM_CHUNK, values e % CM_CHUNK (coalesced).
  float fv[CM_FN_PER_THREAD];
  auto load_fn = [&](int chunk) {
#pragma unroll
    for (int u = 0; u < CM_FN_PER_THREAD; ++u) {
      const int e = threadIdx.x + u * 32 * CM_WARPS;
      fv[u] = fn[(i64)(e / CM_CHUNK) * L + (i64)chunk * CM_CHUNK + e % CM_CHUNK];
    }
  };
  auto store_fn = [&](int buf) {
#pragma unroll
    for (int u = 0; u < CM_FN_PER_THREAD; ++u) {
      const int e = threadIdx.x + u * 32 * CM_WARPS, n = e / CM_CHUNK, k = e % CM_CHUNK, kk = k & 31, j = kk & 7;
      const int at = (((n >> 3) * CM_GROUPS + (k >> 5)) * 4 + (j >> 1)) * 32 + 4 * (n & 7) + (kk >> 3);
      reinterpret_cast<double*>(&fs[buf][at])[j & 1] = fv[u];
    }
  };
  const int tok0 = blockIdx.x * CM_TOKENS + 16 * mp + (lane >> 2);
  const u16* xt[2];
  bool in[2];
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    in[m] = tok0 + 8 * m < T;
    xt[m] = x + (i64)min(tok0 + 8 * m, T - 1) * L + 8 * c + 64 * half;
  }
  double acc[3][4] = {}, sq[2] = {0.0, 0.0};  // per 8-row tile of fn: tokens g (0, 1) and g + 8 (2, 3)
  const int first = part * (L / CM_CHUNK) / S, chunks = (part + 1) * (L / CM_CHUNK) / S;  // this rank's chunks: first .. chunks - 1
  uint4 xv[2][2], xn[2][2];  // this half's two groups of the chunk's stream values, and the next chunk's
  auto load_x = [&](uint4 (&v)[2][2], int chunk) {
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int g = 0; g < 2; ++g) v[m][g] = in[m] ? *reinterpret_cast<const uint4*>(xt[m] + (i64)chunk * CM_CHUNK + 32 * g) : make_uint4(0, 0, 0, 0);
  };
  load_fn(first);
  load_x(xn, first);
  for (int chunk = first; chunk < chunks; ++chunk) {
    const int buf = (chunk - first) & 1;
    store_fn(buf);
#pragma unroll
    for (int m = 0; m < 2; ++m) xv[m][0] = xn[m][0], xv[m][1] = xn[m][1];
    if (chunk + 1 < chunks) {  // in flight while this chunk is multiplied
      load_fn(chunk + 1);
      load_x(xn, chunk + 1);
    }
    __syncthreads();  // the chunk's fn is staged (and the buffer staged next is no longer read)
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      double a[2][8];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        bf16x8_to_f64(xv[m][g], a[m]);
#pragma unroll
        for (int j = 0; j < 8; ++j) sq[m] += a[m][j] * a[m][j];
      }
#pragma unroll
      for (int step = 0; step < 2; ++step) {  // values 8c + 4 step + q of the lane's at k c + 4q
        const double as[8] = {a[0][4 * step], a[1][4 * step], a[0][4 * step + 1], a[1][4 * step + 1],
                              a[0][4 * step + 2], a[1][4 * step + 2], a[0][4 * step + 3], a[1][4 * step + 3]};
#pragma unroll
        for (int nt = 0; nt < 3; ++nt) {
          const double2* b2 = fs[buf] + ((nt * CM_GROUPS + 2 * half + g) * 4 + 2 * step) * 32 + lane;
          const double2 b01 = b2[0], b23 = b2[32];
          dmma_m16n8k16(acc[nt], as, {b01.x, b01.y, b23.x, b23.y});
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < 2; ++m) {  // the token's four lanes
    sq[m] += __shfl_xor_sync(0xffffffffu, sq[m], 1);
    sq[m] += __shfl_xor_sync(0xffffffffu, sq[m], 2);
  }
  __syncthreads();  // fn's buffers are no longer read
  if (half) {  // the second half's sums to shared memory; the first half adds them
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int i = 0; i < 2; ++i) halves[mp][8 * m + (lane >> 2)][nt * 8 + 2 * c + i] = acc[nt][2 * m + i];
      if (c == 0) half_sq[mp][8 * m + (lane >> 2)] = sq[m];
    }
  }
  __syncthreads();
  if (!half) {  // this CTA's sums: the first half's plus the second's
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const int t = 8 * m + (lane >> 2);
      sq[m] += half_sq[mp][t];
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int i = 0; i < 2; ++i) acc[nt][2 * m + i] += halves[mp][t][nt * 8 + 2 * c + i];
      if (S > 1 && part > 0) {  // for rank 0 to read
#pragma unroll
        for (int nt = 0; nt < 3; ++nt)
#pragma unroll
          for (int i = 0; i < 2; ++i) sums[mp][t][nt * 8 + 2 * c + i] = acc[nt][2 * m + i];
        if (c == 0) sums[mp][t][HC_MIXES] = sq[m];
      }
    }
  }
  if (S > 1) cluster_sync();  // every rank's sums are in its shared memory
  if (!half && part == 0) {
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const int t = 8 * m + (lane >> 2);
      if (!in[m]) continue;
      for (int p = 1; p < S; ++p) {
        sq[m] += ld_cluster_f64(smem_addr(&sums[mp][t][HC_MIXES]), p);
#pragma unroll
        for (int nt = 0; nt < 3; ++nt)
#pragma unroll
          for (int i = 0; i < 2; ++i) acc[nt][2 * m + i] += ld_cluster_f64(smem_addr(&sums[mp][t][nt * 8 + 2 * c + i]), p);
      }
      const float rs = (float)(1.0 / sqrt(sq[m] / L + eps));
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int i = 0; i < 2; ++i) mix[(i64)(tok0 + 8 * m) * HC_MIXES + nt * 8 + 2 * c + i] = __fmul_rn((float)acc[nt][2 * m + i], rs);
    }
  }
  if (S > 1) cluster_sync();  // rank 0 has read the others' shared memory, which goes with their CTAs
}

extern "C" __global__ void __launch_bounds__(32 * CM_WARPS, 1) hc_chunk_mixes(
    const u16* __restrict__ x, const float* __restrict__ fn, float* __restrict__ mix, int L, int T, double eps) {
  chunk_mixes<1>(x, fn, mix, L, T, eps);
}

#define CHUNK_MIXES_CLUSTER(S)                                                                                          \
  extern "C" __global__ void __cluster_dims__(1, S, 1) __launch_bounds__(32 * CM_WARPS, 1) hc_chunk_mixes_s##S(         \
      const u16* __restrict__ x, const float* __restrict__ fn, float* __restrict__ mix, int L, int T, double eps) {    \
    chunk_mixes<S>(x, fn, mix, L, T, eps);                                                                              \
  }
CHUNK_MIXES_CLUSTER(2)
CHUNK_MIXES_CLUSTER(4)
CHUNK_MIXES_CLUSTER(8)

extern "C" __global__ void __launch_bounds__(32) hc_coefficients(
    const float* __restrict__ mix, const float* __restrict__ scale, const float* __restrict__ base,
    float* __restrict__ pre, float* __restrict__ post, float* __restrict__ comb, float hc_eps, int iters, int T) {
  pdl_begin();
  const int tok = min(2 * blockIdx.x + (threadIdx.x >> 4), T - 1), lane = threadIdx.x & 15;  // a half-warp a token
  const bool mine = 2 * blockIdx.x + (threadIdx.x >> 4) < T;  // (an odd T's last half-warp repeats its twin's token, unwritten)
  const float* m = mix + (i64)tok * HC_MIXES;
  if (lane < HC_N) {
    if (mine) pre[tok * HC_N + lane] = hc_pre_value(m[lane], scale[0], base[lane], hc_eps);
  } else if (lane < 2 * HC_N && mine) {
    const float z = __fadd_rn(__fmul_rn(m[lane], scale[1]), base[lane]);
    post[tok * HC_N + lane - HC_N] = 2.0f * (float)sigmoid_f64(z);
  }
  const int c = lane;  // comb[j, k], j = c / 4, k = c % 4; the shuffles below stay within the half-warp
  const double logit = __fadd_rn(__fmul_rn(m[2 * HC_N + c], scale[2]), base[2 * HC_N + c]);
  const double eps = hc_eps;
  double mx = fmax(logit, __shfl_xor_sync(0xffffffffu, logit, 1));
  mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  double v = exp(logit - mx);
  double row = v + __shfl_xor_sync(0xffffffffu, v, 1);
  row += __shfl_xor_sync(0xffffffffu, row, 2);
  v = v / row + eps;  // softmax over k, + eps
  double col = v + __shfl_xor_sync(0xffffffffu, v, 4);
  col += __shfl_xor_sync(0xffffffffu, col, 8);
  v = v / (col + eps);
  for (int it = 1; it < iters; ++it) {
    row = v + __shfl_xor_sync(0xffffffffu, v, 1);
    row += __shfl_xor_sync(0xffffffffu, row, 2);
    v = v / (row + eps);
    col = v + __shfl_xor_sync(0xffffffffu, v, 4);
    col += __shfl_xor_sync(0xffffffffu, col, 8);
    v = v / (col + eps);
  }
  if (mine) comb[tok * HC_N * HC_N + c] = (float)v;
}

extern "C" __global__ void __launch_bounds__(256) hc_expand(
    const u16* __restrict__ out, const u16* __restrict__ x, const float* __restrict__ post,
    const float* __restrict__ comb, u16* __restrict__ y, int D) {
  pdl_begin();
  const int tok = blockIdx.y, d = (blockIdx.x * 256 + threadIdx.x) * 8;
  if (d >= D) return;
  float o[8];
  const uint4 ov = *reinterpret_cast<const uint4*>(out + (i64)tok * D + d);
  const u32 ow[4] = {ov.x, ov.y, ov.z, ov.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = bf16_to_f32(i & 1 ? ow[i >> 1] >> 16 : ow[i >> 1] & 0xffff);
  hc_expand8(o, x, post, comb, y, tok, d, D);
}
