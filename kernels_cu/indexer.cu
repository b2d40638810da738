// The lightning indexer at decode: scores of every compressed index key, then their top-k.
//
// index_scores: score[row, j] = bf16( sum_h f32(relu(bf16(q_h . k_j)) * w_h) ) as the reference
// (layers.IndexScorer.scores in reference numerics) computes it: dots exact in float64 rounded to
// float32 then bf16, the head sum in float64 rounded to float32 then bf16. Queries and keys are
// FP4 (e2m1) with a UE8M0 scale per 32 dims: q arrives as its e2m1 grid values in e4m3 with float
// scales [rows, 64, 4]; a key is the V4 68-byte entry (64 bytes of e2m1, even element in the low
// nibble, then 4 scale bytes). One mma m16n8k32 (e4m3) per 32-dim block: 16 keys x 8 heads, exact
// (e2m1 products summed over 32 fit the tensor cores' fp32 accumulation); the blocks are scaled
// and summed in float32 where that is exact too (their scales close together, as after the
// Hadamard rotation: see FAST_SPREAD), else in float64. A lane feeds the mma the bytes it loaded
// itself: the order of k inside one mma is free as long as A and B agree (as in gemm.cu). grid
// (CTAs, rows), 8 warps; CTA b takes the row's 128-key blocks b, b + CTAs, .. (the row's keys
// spread over all CTAs however few they are), each warp 16 keys at a time; keys past the row's
// count get -inf.
//
// fp4_quant_rows: the FP4 fake-quant of queries and keys (see below), as e4m3 values + scales or
// as 68-byte entries; index_query_fp4: a query's RoPE, Hadamard rotation and FP4 fake-quant.
//
// topk_select: per row, the indices of the k largest scores among its first n, ties to the lower
// index (the reference's stable descending sort), written in ascending index order plus an offset
// (a pool entry); slots past min(k, n) get -1. Radix select on order-preserving 32-bit keys, 8 bits
// a round, then one pass in index order. One CTA per row (256 of its threads up to 2048 keys); its
// keys are staged in shared memory when they fit. A long row (1M context: 262,144 keys) takes two
// passes: CTAs of slices of the row each pick their slice's top k, then one CTA picks the top k of
// those (the top k of the union of the slices' top k: a key the row takes is among its slice's,
// ties included, since a slice keeps its lowest indices first).
#include "cache_entries.cuh"

#define IDX_HEADS 64
#define NEG_INF __int_as_float(0xff800000)

struct IndexParams {
  const u8* q;           // [rows, 64, 128] e4m3: the FP4 queries' e2m1 values
  const float* q_scale;  // [rows, 64, 4] their scales
  const float* w;        // [rows, 64] head weights, rows w_stride floats apart: weights_proj(x), scaled below
  const u8* keys;        // index-key pool [entries, 68]
  const int* key_start;  // [rows] pool entry of the row's key 0
  const int* n_keys;     // [rows] keys of the row
  float* scores;         // [rows, stride]
  int stride;
  long long w_stride;
  float w_scale;         // head weight = f32(w) * w_scale, or f32(bf16(w)) * w_scale with w_bf16
  int w_bf16;            //   (the reference's weights_proj output is bf16: (128 * 64) ** -0.5 after)
};

DSUF_DEVICE u32 ldg_u32(const void* p) {
  u32 v;
  asm("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// e2m1 codes to e4m3 bytes holding value * 2**-6 (see gemm.cu).
DSUF_DEVICE u32 e2m1_lo(u32 w) { return ((w & 0x08080808u) << 4) | ((w & 0x07070707u) << 2); }
DSUF_DEVICE u32 e2m1_hi(u32 w) { return (w & 0x80808080u) | ((w & 0x70707070u) >> 2); }

DSUF_DEVICE float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// A key's block scales (4 E8M0 bytes, exponent + 127) -> their smallest and largest.
DSUF_DEVICE void key_scale_range(u32 s, int& lowest, int& highest) {
  const int e0 = s & 0xff, e1 = (s >> 8) & 0xff, e2 = (s >> 16) & 0xff, e3 = s >> 24;
  lowest = min(min(e0, e1), min(e2, e3));
  highest = max(max(e0, e1), max(e2, e3));
}

// The 32-dim blocks' dot products of one (key, head) are integers times 2**-8 of at most 13 bits
// (sums of 32 e2m1 x e2m1 products); scaled by powers of two whose exponents lie within
// FAST_SPREAD of each other, their sum of four is exact in float32 (13 + 8 + 2 carry bits), as in
// float64, and so is its rounding to float32, as long as the scales stay well inside float32's
// range. FAST: the warp's keys and the row's queries allow that; the float64 path takes the rest.
#define FAST_SPREAD 8

template <bool FAST>
DSUF_DEVICE void score_keys(const u32 (&wa)[4], const u32 (&wb)[4], u32 sa, u32 sb, const uint4 (*qb_s)[4][32],
                            const double* qs_s, const float* qf_s, const float* w_s, double& score_a, double& score_b) {
  const int t = threadIdx.x & 3;
  double ska[4], skb[4];
  float fka[4], fkb[4];
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    fka[b] = e8m0_to_f32((sa >> (8 * b)) & 0xff);
    fkb[b] = e8m0_to_f32((sb >> (8 * b)) & 0xff);
    ska[b] = fka[b], skb[b] = fkb[b];
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int h0 = 8 * nt + 2 * t, h1 = h0 + 1;
    double dot[4] = {0.0, 0.0, 0.0, 0.0};  // (ja, h0), (ja, h1), (jb, h0), (jb, h1)
    float dof[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      float d[4];
      mma_e4m3_f16b(d, e2m1_lo(wa[b]), e2m1_lo(wb[b]), e2m1_hi(wa[b]), e2m1_hi(wb[b]), qb_s[nt][b][threadIdx.x & 31]);
      if (FAST) {  // every product and partial sum exact: fused or not, the same value
        const float q0 = qf_s[h0 * 4 + b], q1 = qf_s[h1 * 4 + b];
        dof[0] = fmaf(d[0], q0 * fka[b], dof[0]);
        dof[1] = fmaf(d[1], q1 * fka[b], dof[1]);
        dof[2] = fmaf(d[2], q0 * fkb[b], dof[2]);
        dof[3] = fmaf(d[3], q1 * fkb[b], dof[3]);
      } else {
        const double q0 = qs_s[h0 * 4 + b], q1 = qs_s[h1 * 4 + b];
        dot[0] += (double)d[0] * (q0 * ska[b]);
        dot[1] += (double)d[1] * (q1 * ska[b]);
        dot[2] += (double)d[2] * (q0 * skb[b]);
        dot[3] += (double)d[3] * (q1 * skb[b]);
      }
    }
    float f[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = FAST ? dof[i] : (float)dot[i];
    // relu(bf16(f32(dot))) * w_h in float32, summed in float64.
    score_a += (double)(fmaxf(bf16_round(f[0]), 0.0f) * w_s[h0]);
    score_a += (double)(fmaxf(bf16_round(f[1]), 0.0f) * w_s[h1]);
    score_b += (double)(fmaxf(bf16_round(f[2]), 0.0f) * w_s[h0]);
    score_b += (double)(fmaxf(bf16_round(f[3]), 0.0f) * w_s[h1]);
  }
}

// Two CTAs an SM (128 registers, a few spilled): at long context a row's 256 CTAs then run in one wave.
extern "C" __global__ void __launch_bounds__(256, 2) index_scores(const __grid_constant__ IndexParams p) {
  pdl_begin();
  __shared__ double qs_s[IDX_HEADS * 4];  // q scale * 64 (undoes the 2**-6 of the key bytes)
  __shared__ float qf_s[IDX_HEADS * 4];   // the same in float32
  __shared__ float w_s[IDX_HEADS];
  __shared__ uint4 qb_s[8][4][32];  // the row's queries as mma_e4m3_f16b's B: head tile, block, lane
  __shared__ int q_spread, q_lowest, q_highest, q_pow2;  // over the row's 64 heads: a head's largest exponent spread, the smallest and largest exponent, all powers of two
  const int row = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n = p.n_keys[row];
  float* out = p.scores + (i64)row * p.stride;
  // Keys past the row's count (a prompt's early rows, a long cache's short rows) are -inf without
  // any products; a CTA with none of the row's keys is done before it loads the queries.
  for (int lo = blockIdx.x * 128; lo < p.stride; lo += gridDim.x * 128)
    for (int j = max(lo, n) + threadIdx.x; j < min(p.stride, lo + 128); j += blockDim.x) out[j] = NEG_INF;
  if (blockIdx.x * 128 >= n) return;
  if (threadIdx.x == 0) q_spread = 0, q_lowest = 255, q_highest = 0, q_pow2 = 1;
  __syncthreads();
  for (int i = threadIdx.x; i < IDX_HEADS * 4; i += blockDim.x) {
    const float qs = 64.0f * p.q_scale[(i64)row * IDX_HEADS * 4 + i];
    qs_s[i] = qs;
    qf_s[i] = qs;
    const u32 bits = __float_as_uint(qs);
    if (bits & 0x807fffffu) atomicAnd(&q_pow2, 0);  // not a positive normal power of two
    atomicMin(&q_lowest, (int)(bits >> 23));
    atomicMax(&q_highest, (int)(bits >> 23));
  }
  if (threadIdx.x < IDX_HEADS) {
    const float w = p.w[(i64)row * p.w_stride + threadIdx.x];
    w_s[threadIdx.x] = __fmul_rn(p.w_bf16 ? bf16_round(w) : w, p.w_scale);
  }
  __syncthreads();
  if (threadIdx.x < IDX_HEADS) {  // a head's 4 block scales: their exponent spread
    int hi = 0, lo = 255;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int e = (int)(__float_as_uint(qf_s[threadIdx.x * 4 + b]) >> 23);
      hi = max(hi, e), lo = min(lo, e);
    }
    atomicMax(&q_spread, hi - lo);
  }

  // B fragments of all 64 heads (8 tiles of 8) x 4 blocks, converted once for the CTA's keys: lane
  // 4 g' + t' of tile nt, block b holds head 8 nt + g', elements 32 b + 8 t' .. (even ones at k
  // slots 4t' .., odd ones at 16 + 4t' ..), as the key's nibbles lie in the lane's word.
  const u8* q = p.q + (i64)row * IDX_HEADS * IDX_DIM;
  for (int i = threadIdx.x; i < 8 * 4 * 32; i += blockDim.x) {
    const int nt = i >> 7, b = (i >> 5) & 3, l = i & 31;
    const uint2 x = *reinterpret_cast<const uint2*>(q + (8 * nt + (l >> 2)) * IDX_DIM + 32 * b + 8 * (l & 3));
    qb_s[nt][b][l] = e4m3_b_to_f16(__byte_perm(x.x, x.y, 0x6420), __byte_perm(x.x, x.y, 0x7531));
  }
  __syncthreads();
  // The scales' exponents (q scale's + key scale's) between -87 and 100: products, terms and sums
  // all normal float32 values with room to spare.
  const int q_low = q_pow2 ? q_lowest - 127 : -1000, q_high = q_highest - 127, q_width = q_spread;

  const u8* keys = p.keys + (i64)p.key_start[row] * IDX_ENTRY;
  for (int k0 = blockIdx.x * 128 + 16 * warp; k0 < n; k0 += gridDim.x * 128) {
    const int ja = k0 + g, jb = k0 + g + 8;
    u32 wa[4] = {0, 0, 0, 0}, wb[4] = {0, 0, 0, 0}, sa = 0x7f7f7f7fu, sb = 0x7f7f7f7fu;
    if (ja < n) {
      const u8* k = keys + (i64)ja * IDX_ENTRY;
#pragma unroll
      for (int b = 0; b < 4; ++b) wa[b] = ldg_u32(k + 16 * b + 4 * t);
      sa = ldg_u32(k + 64);
    }
    if (jb < n) {
      const u8* k = keys + (i64)jb * IDX_ENTRY;
#pragma unroll
      for (int b = 0; b < 4; ++b) wb[b] = ldg_u32(k + 16 * b + 4 * t);
      sb = ldg_u32(k + 64);
    }
    int low_a, high_a, low_b, high_b;
    key_scale_range(sa, low_a, high_a);
    key_scale_range(sb, low_b, high_b);
    const bool fits = q_width + max(high_a - low_a, high_b - low_b) <= FAST_SPREAD && q_low + min(low_a, low_b) - 127 >= -87 &&
                      q_high + max(high_a, high_b) - 127 <= 100;
    double score_a = 0.0, score_b = 0.0;
    if (__all_sync(0xffffffffu, fits)) {
      score_keys<true>(wa, wb, sa, sb, qb_s, qs_s, qf_s, w_s, score_a, score_b);
    } else {
      score_keys<false>(wa, wb, sa, sb, qb_s, qs_s, qf_s, w_s, score_a, score_b);
    }
    score_a += __shfl_xor_sync(0xffffffffu, score_a, 1);
    score_a += __shfl_xor_sync(0xffffffffu, score_a, 2);
    score_b += __shfl_xor_sync(0xffffffffu, score_b, 1);
    score_b += __shfl_xor_sync(0xffffffffu, score_b, 2);
    if (t == 0) {
      if (ja < n) out[ja] = bf16_round((float)score_a);
      if (jb < n) out[jb] = bf16_round((float)score_b);
    }
  }
}

// ---- FP4 quantisation of queries and keys -------------------------------------------------------

// fp4_quant_rows: the reference's FP4 fake-quant (quant.fp4_fake_quant_ue8m0, block 32) of bf16
// rows [rows, 128] (cache_entries.cuh fp4_quant4). Writes, where the pointer is not null, the grid
// values as e4m3 [rows, 128] and the scales as float [rows, 4] (queries), and/or the 68-byte entry
// at pool row dst[row] (keys). One warp per row, 4 dims a lane.
extern "C" __global__ void __launch_bounds__(256) fp4_quant_rows(
    const u16* __restrict__ x, int rows, u8* __restrict__ q, float* __restrict__ q_scale, u8* __restrict__ pool,
    const i64* __restrict__ dst) {
  pdl_begin();
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (row >= rows) return;  // whole warps leave together
  const uint2 raw = *reinterpret_cast<const uint2*>(x + (i64)row * IDX_DIM + 4 * lane);
  const float v[4] = {bf16_to_f32(raw.x & 0xffff), bf16_to_f32(raw.x >> 16), bf16_to_f32(raw.y & 0xffff), bf16_to_f32(raw.y >> 16)};
  u32 code[4];
  float grid[4];
  const int e = fp4_quant4(v, code, grid);
  if (q) {
    *reinterpret_cast<u32*>(q + (i64)row * IDX_DIM + 4 * lane) = f32x2_to_e4m3x2(grid[0], grid[1]) | (f32x2_to_e4m3x2(grid[2], grid[3]) << 16);
    if ((lane & 7) == 0) q_scale[(i64)row * 4 + (lane >> 3)] = pow2f(e);
  }
  if (pool) index_entry_fp4(pool + dst[row] * IDX_ENTRY, code, e, lane);
}

// index_query_fp4: an indexer query head from wq_b to what index_scores reads, in one launch (the
// reference: RoPE on the trailing 64 dims, quant.hadamard_transform, then the FP4 fake-quant).
// The rotation is the compressor's for index keys: the signed sums of the 128 bf16 values are
// exact in float64 (a Walsh-Hadamard butterfly, in whatever order), times f32(128**-0.5), rounded
// to float32 then bf16 (the reference's float32 matmul rounds its running sums: it differs from
// the exact rotation by a bf16 rounding now and then). x bf16 [rows * heads, 128]; cos / sin
// float32 [rows, 32]; writes the grid values as e4m3 and the scales as fp4_quant_rows does. One
// warp a head, 4 dims a lane.
extern "C" __global__ void __launch_bounds__(256) index_query_fp4(
    const u16* __restrict__ x, const float* __restrict__ cos_t, const float* __restrict__ sin_t, int rows, int heads,
    u8* __restrict__ q, float* __restrict__ q_scale) {
  pdl_begin();
  const int lane = threadIdx.x & 31;
  const int head = blockIdx.x * 8 + (threadIdx.x >> 5), row = head / heads;
  if (row >= rows) return;  // whole warps leave together
  uint2 raw = *reinterpret_cast<const uint2*>(x + (i64)head * IDX_DIM + 4 * lane);
  if (lane >= 16) {  // dims 64 .. 127: pairs 2 lane - 32, 2 lane - 31 of the row's rotation
    const int pair = 2 * lane - 32;
    raw.x = rotate_pair(raw.x, cos_t[row * ROPE_PAIRS + pair], sin_t[row * ROPE_PAIRS + pair]);
    raw.y = rotate_pair(raw.y, cos_t[row * ROPE_PAIRS + pair + 1], sin_t[row * ROPE_PAIRS + pair + 1]);
  }
  // y_j = sum_i (-1)^popc(i & j) x_i over i = 4 lane + k: the index's two low bits within the lane,
  // its five high bits across lanes.
  double v[4] = {bf16_to_f32(raw.x & 0xffff), bf16_to_f32(raw.x >> 16), bf16_to_f32(raw.y & 0xffff), bf16_to_f32(raw.y >> 16)};
#pragma unroll
  for (int bit = 1; bit < 4; bit <<= 1)
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (!(k & bit)) {
        const double a = v[k], b = v[k | bit];
        v[k] = a + b, v[k | bit] = a - b;
      }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const double other = __shfl_xor_sync(0xffffffffu, v[k], m);
      v[k] = lane & m ? other - v[k] : v[k] + other;
    }
  float y[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) y[k] = bf16_to_f32(f32_to_bf16((float)(v[k] * (double)HADAMARD_SCALE)));
  u32 code[4];
  float grid[4];
  const int e = fp4_quant4(y, code, grid);
  *reinterpret_cast<u32*>(q + (i64)head * IDX_DIM + 4 * lane) = f32x2_to_e4m3x2(grid[0], grid[1]) | (f32x2_to_e4m3x2(grid[2], grid[3]) << 16);
  if ((lane & 7) == 0) q_scale[(i64)head * 4 + (lane >> 3)] = pow2f(e);
}

// ---- top-k -----------------------------------------------------------------------------------

struct TopkParams {
  const float* scores;   // [rows, stride]
  const int* n_keys;     // [rows] candidates of each row: its first n scores
  const int* offset;     // [rows] added to every index written, or null
  int* out;              // [rows, out_stride], written at columns [out_col, out_col + k) (+ k * slice number)
  int stride, out_stride, out_col, k;
  int cache;             // scores a row may stage in shared memory (dynamic smem / 4)
  int slice;             // > 0: CTA (row, s) takes the row's scores [s * slice, +slice) only (the first pass of a long row)
  const int* cand;       // or null: the keys are scores[cand[row, i]], i < cand_stride (-1: none; the second pass)
  int cand_stride;
  int cand_slice;        // with cand: the first pass's slice length (the candidates of slices past the row's keys are skipped)
};

// Order-preserving key of a float: larger float, larger key; -0 counts as +0.
DSUF_DEVICE u32 order_key(float f) {
  u32 u = __float_as_uint(f);
  if ((u << 1) == 0) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#define TOPK_UNROLL 16  // keys a thread has in flight in a pass over a long row

// body(m, at) over at = start, start + TOPK_UNROLL * step, .. < limit, m = the positions at,
// at + step, .. below limit that a call takes (at most TOPK_UNROLL, their loads in flight
// together): the work follows the row's length, not a fixed TOPK_UNROLL x the CTA's threads. m is
// warp-uniform where start and limit are.
template <class Body>
DSUF_DEVICE void in_groups(int start, int step, int limit, Body body) {
  for (int at = start; at < limit; at += TOPK_UNROLL * step) body(min(TOPK_UNROLL, (limit - at + step - 1) / step), at);
}

// keys[u] = the key of index base + u * step for u < m (0 for the others), from the staged keys or
// from the scores (through cand: a first pass's picks, -1 none, below every key). No branch between
// the loads: all are in flight before the first is used.
template <bool STAGED>
DSUF_DEVICE void load_keys(u32 (&keys)[TOPK_UNROLL], int m, const float* scores, const u32* cached, const int* cand, int base, int step) {
  int at[TOPK_UNROLL];
#pragma unroll
  for (int u = 0; u < TOPK_UNROLL; ++u) at[u] = u < m && !STAGED && cand ? __ldg(cand + base + u * step) : base + u * step;
#pragma unroll
  for (int u = 0; u < TOPK_UNROLL; ++u) {
    u32 key = 0;
    if (u < m && at[u] >= 0) key = STAGED ? cached[at[u]] : order_key(__ldg(scores + at[u]));
    keys[u] = key;
  }
}

// The keys of CTA (row, blockIdx.y): a row's first n scores; with p.slice, slice blockIdx.y of them;
// with p.cand, the candidates of the row's non-empty slices.
DSUF_DEVICE int topk_keys(const TopkParams& p, int row_n) {
  if (p.cand) return min(p.cand_stride, (row_n + p.cand_slice - 1) / p.cand_slice * p.k);
  return p.slice ? max(0, min(p.slice, row_n - (int)blockIdx.y * p.slice)) : row_n;
}

// The CTA's first THREADS threads (named barrier 1: the others may have left).
template <int THREADS>
DSUF_DEVICE void topk_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
}

// One CTA of THREADS threads a row (or a slice of one).
template <int THREADS>
DSUF_DEVICE void topk_rows(const TopkParams& p) {
  extern __shared__ u32 cached[];
  __shared__ int hist[256];
  __shared__ int warp_gt[THREADS / 32], warp_eq[THREADS / 32], warp_at[THREADS / 32], warp_eq_before[THREADS / 32];
  __shared__ u32 pick_bin;
  __shared__ int pick_above, pick_all, odd_keys;
  const int row = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // The keys of this CTA: a row's first n scores; with p.slice, slice blockIdx.y of them (its picks
  // go to the slice's k columns); with p.cand, the scores a first pass picked (in index order).
  const int first = p.slice ? blockIdx.y * p.slice : 0;
  const int* cand = p.cand ? p.cand + (i64)row * p.cand_stride : nullptr;
  const int row_n = p.n_keys[row];
  const int n = topk_keys(p, row_n);
  const int kk = min(p.k, cand ? row_n : n);
  const float* scores = p.scores + (i64)row * p.stride;
  int* out = p.out + (i64)row * p.out_stride + p.out_col + blockIdx.y * p.k;
  const int add = p.offset ? p.offset[row] : 0;
  const bool in_smem = n <= p.cache;
  const float* keys_from = scores + first;  // (first is 0 with cand: cand indexes the whole row)
  auto index_of = [&](int i) { return cand ? cand[i] : first + i; };

  for (int i = kk + tid; i < p.k; i += THREADS) out[i] = -1;
  if (kk == 0) return;

  // Radix select of the kk-th largest key: `prefix` holds its bits found so far (under `mask`),
  // `need` how many keys sharing that prefix still belong to the top kk; done early when the bin
  // picked holds exactly those. A thread counts a run of keys of one bin before it adds the run
  // to the histogram (bf16 scores crowd into a few bins of the top byte: an atomic a key would
  // serialise on them). (kk == n: every key is taken, no search.) Where every score is a bf16 value
  // (the decode indexer's are), a key's low 16 bits follow from its sign: two rounds find it.
  u32 prefix = 0, mask = 0;
  int need = kk;
  if (tid == 0) odd_keys = 0;
  for (int shift = 24; shift >= 0 && kk < n; shift -= 8) {
    for (int i = tid; i < 256; i += THREADS) hist[i] = 0;
    topk_sync<THREADS>();
    int run_bin = 256, run = 0;  // the run of keys this thread has counted, not yet added
    u32 odd = 0;                 // (first round) low bits of a key that no bf16 score has
    in_groups(tid, THREADS, n, [&](int m, int c) {
      u32 keys[TOPK_UNROLL];
      if (in_smem && shift < 24) {
        load_keys<true>(keys, m, keys_from, cached, cand, c, THREADS);
      } else {
        load_keys<false>(keys, m, keys_from, cached, cand, c, THREADS);
        if (in_smem) {  // (the first round stages them)
#pragma unroll
          for (int u = 0; u < TOPK_UNROLL; ++u)
            if (u < m) cached[c + u * THREADS] = keys[u];
        }
      }
#pragma unroll
      for (int u = 0; u < TOPK_UNROLL; ++u) {
        if (u >= m) break;
        if (shift == 24 && keys[u]) odd |= (keys[u] ^ ((keys[u] >> 31) - 1)) & 0xffffu;  // bf16: 0 (positive) or 0xffff
        if ((keys[u] & mask) != prefix) continue;
        const int bin = (keys[u] >> shift) & 0xff;
        if (bin != run_bin) {
          if (run) atomicAdd(&hist[run_bin], run);
          run_bin = bin, run = 0;
        }
        ++run;
      }
    });
    if (run) atomicAdd(&hist[run_bin], run);
    if (odd) odd_keys = 1;
    topk_sync<THREADS>();
    if (tid < 32) {  // lane L scans bins 255 - 8L down to 248 - 8L; suffix sums across lanes
      int local = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) local += hist[255 - 8 * tid - i];
      int incl = local;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, incl, o);
        if (tid >= o) incl += u;
      }
      int above = incl - local;  // keys in higher bins (lower lanes)
      if (above < need && incl >= need) {
        for (int i = 0; i < 8; ++i) {
          const int bin = 255 - 8 * tid - i;
          if (above + hist[bin] >= need) {
            pick_bin = bin;
            pick_above = above;
            pick_all = above + hist[bin] == need;
            break;
          }
          above += hist[bin];
        }
      }
    }
    topk_sync<THREADS>();
    prefix |= pick_bin << shift;
    mask |= 0xffu << shift;
    need -= pick_above;
    const bool done = pick_all || (shift == 16 && !odd_keys);
    if (done && !pick_all) prefix |= (prefix >> 31) ? 0u : 0xffffu, mask = ~0u;  // the bf16 key's low bits
    topk_sync<THREADS>();  // pick_* are rewritten next round
    if (done) break;
  }

  // The keys at or above prefix (under mask) are the top kk: take every larger one and the first
  // `need` equal ones, in index order. Warp w owns keys [w * seg, (w + 1) * seg): it counts its
  // larger and equal keys, the warps' counts are scanned once, then each warp writes its picks in
  // order (ballots).
  const int seg = ((n + THREADS - 1) / THREADS) * 32, lo = warp * seg, hi = min(n, lo + seg);
  const bool staged = in_smem && kk < n;
  auto segment_keys = [&](u32 (&keys)[TOPK_UNROLL], int m, int j) {  // the warp's keys from j, 32 a slot, masked (0 past hi)
    const int lane_m = min(m, (hi - j - lane + 31) / 32);
    if (staged) {
      load_keys<true>(keys, lane_m, keys_from, cached, cand, j + lane, 32);
    } else {
      load_keys<false>(keys, lane_m, keys_from, cached, cand, j + lane, 32);
    }
#pragma unroll
    for (u32& key : keys) key &= mask;
  };
  int gt = 0, eq = 0;
  in_groups(lo, 32, hi, [&](int m, int j) {
    u32 keys[TOPK_UNROLL];
    segment_keys(keys, m, j);
#pragma unroll
    for (int u = 0; u < TOPK_UNROLL; ++u) {
      if (u >= m) break;
      const bool in = j + 32 * u + lane < hi;
      gt += in && keys[u] > prefix;
      eq += in && keys[u] == prefix;
    }
  });
#pragma unroll
  for (int o = 16; o; o >>= 1) gt += __shfl_xor_sync(0xffffffffu, gt, o), eq += __shfl_xor_sync(0xffffffffu, eq, o);
  if (lane == 0) warp_gt[warp] = gt, warp_eq[warp] = eq;
  topk_sync<THREADS>();
  if (tid == 0) {  // each warp's first output slot and the equal keys before its segment
    int at = 0, eq_before = 0;
    for (int w = 0; w < THREADS / 32; ++w) {
      warp_at[w] = at, warp_eq_before[w] = eq_before;
      at += warp_gt[w] + max(0, min(warp_eq[w], need - eq_before));
      eq_before += warp_eq[w];
    }
  }
  topk_sync<THREADS>();
  int at = warp_at[warp], eq_seen = warp_eq_before[warp];
  const u32 below = (1u << lane) - 1;
  in_groups(lo, 32, hi, [&](int m, int j) {
    u32 keys[TOPK_UNROLL];
    segment_keys(keys, m, j);
#pragma unroll
    for (int u = 0; u < TOPK_UNROLL; ++u) {
      if (u >= m) break;
      const int i = j + 32 * u + lane;
      const bool is_eq = i < hi && keys[u] == prefix;
      const u32 eqs = __ballot_sync(0xffffffffu, is_eq);
      const bool take = i < hi && (keys[u] > prefix || (is_eq && eq_seen + __popc(eqs & below) < need));
      const u32 takes = __ballot_sync(0xffffffffu, take);
      if (take) out[at + __popc(takes & below)] = index_of(i) + add;
      at += __popc(takes);
      eq_seen += __popc(eqs);
    }
  });
}

// A CTA of 1024 threads; rows (slices, candidate lists) of up to 2048 keys are searched by its first
// 256 alone: fewer warps to wait for at each of the search's barriers. topk_select_short: launches
// whose rows all have at most 2048 keys (a prompt chunk's thousands of rows), 256 threads a CTA
// and several CTAs an SM.
extern "C" __global__ void __launch_bounds__(1024, 1) topk_select(const __grid_constant__ TopkParams p) {
  pdl_begin();
  if (topk_keys(p, p.n_keys[blockIdx.x]) > 2048) {
    topk_rows<1024>(p);
  } else if (threadIdx.x < 256) {
    topk_rows<256>(p);
  }
}

extern "C" __global__ void __launch_bounds__(256, 4) topk_select_short(const __grid_constant__ TopkParams p) {
  pdl_begin();
  topk_rows<256>(p);
}
