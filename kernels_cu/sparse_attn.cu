// Sparse MQA decode for V4-Flash: per query row, 64 heads of 512 dims attend to one shared K = V
// head over a list of FP8 KV entries (kv_cache.cu's 584-byte layout) named by index (the sliding
// window plus the compressed entries a layer sees: the indexer's top-k, or every visible one),
// with per-head attention sinks. What layers.sink_attention computes in reference numerics:
//   s = (q . k) * scale; p = exp(s - max); out = sum(bf16(p) k) / (sum(p) + exp(sink - max)).
//
// Flash-decoding: grid (CTAs, rows). A row's CTAs follow the index slots it uses (`used`: a server
// sized for long contexts gives every row room for its capacity, mostly empty): attn_plan spreads
// them as dsuf.gpu.attention.choose_splits does, CTA x taking split x / groups, head group
// x % groups; the CTAs past the plan leave. CTA (split, group) takes index slots [split *
// per_split, +per_split) of its row for heads [group * head_tile, +head_tile) (a decode step's few
// rows split their heads too, so that more SMs share the step's latency; each head's arithmetic is
// the same whichever CTA does it) in tiles of 32 entries: the tile is gathered and
// dequantised to bf16 in shared memory, S = Q K^T on the tensor cores (bf16 mma, fp32
// accumulators), an online softmax in fp32 (probabilities rounded to bf16 against the running
// max, as the reference kernel does), O += P K. It writes its unnormalised O, its max and its sum
// of probabilities; sparse_attn_combine merges the splits in split order (deterministic) and adds
// the sink to the denominator. With one split a row (prompt chunks: as many rows as SMs or more)
// the CTA finishes its row itself and there is no combine.
//
// A CTA holds at most HM heads: sparse_attn_decode 64 (one CTA an SM), sparse_attn_decode_h32 32
// (half the accumulators and shared memory: two CTAs an SM, so that one's gathers and barriers
// overlap the other's tensor-core work) for a tensor-parallel rank's 32 heads or fewer and for
// prompt chunks (64 heads: two CTAs a row). Both compute every head alike, bit for bit.
//
// Warp roles (8 warps): S is the sum of two halves of the 512 dims, each a chain of 16 mma k-steps
// (half the dependent chain of one sum over all 512), added in the softmax: warp w takes a 16-head x
// 16-key tile and both halves where the CTA has 64 heads, else one (tile, half) each, so that all
// eight warps work; the softmax runs 4 threads per head; for O, warp w owns dims 64 w .. +64 of
// the CTA's heads (HM / 16 x 32 fp32 accumulators a thread).
#include "common.cuh"

#define HEADS 64               // a row's query heads (part_o's room)
#define DIM 512
#define TILE 32                // KV entries per tile
#define KV_ENTRY 584
#define ROW (DIM + 8)          // bf16 row stride of Q and K in shared memory (conflict-free ldmatrix)
#define S_ROW (TILE + 4)       // float row stride of the score tiles (one a half of the dims)
#define P_ROW (TILE + 8)       // bf16 row stride of the probability tile
#define NEG_INF __int_as_float(0xff800000)

struct AttnParams {
  const u16* q;        // [rows, heads, 512] bf16 (heads <= 64; the rest count as zero queries)
  const u8* kv;        // KV pool [entries, 584]
  const int* idx;      // [rows, n_idx] pool entries; < 0: no entry
  const float* sink;   // [heads] attention-sink logits
  float* part_o;       // [rows, splits, 64, 512] unnormalised outputs of each split
  float* part_ml;      // [rows, splits, 64, 2] (running max, sum of probabilities) of each split
  u16* out;            // [rows, heads, 512] bf16
  int n_idx;           // index slots per row
  const int* used;     // [rows] or null (n_idx each): the row's slots from used[row] on name no entry;
                       // written before the launch ahead of sparse_attn_decode's (read before its PDL wait)
  int splits;          // room for this many splits a row in part_o / part_ml
  int ctas;            // sparse_attn_decode's CTAs a row (its plan for n_idx slots)
  int sms;             // SMs the plan spreads a step's rows over
  float scale;         // softmax scale (head_dim ** -0.5)
  int heads;           // query heads a row has (a tensor-parallel rank's share of 64)
  const float* cos_t;  // [rows, 32] or null: sparse_attn_combine then rotates the output's last
  const float* sin_t;  // 64 dims back by the row's position (layers.Rope.apply's inverse, on the bf16 output)
};

// How a row's used slots are spread over the launch's CTAs (mirror of dsuf.gpu.attention.choose_splits
// with ctas = p.ctas, the CTAs planned for n_idx slots): one CTA an SM, about sms / rows splits a
// row, never more than it has tiles, none empty; where that leaves SMs idle, each split's heads
// divided among 2 or 4 CTAs (16-head MMA tiles).
struct AttnPlan {
  int splits, per_split, head_tile, groups;
};

DSUF_DEVICE int used_slots(const AttnParams& p, int row) { return p.used ? min(p.used[row], p.n_idx) : p.n_idx; }

DSUF_DEVICE AttnPlan attn_plan(const AttnParams& p, int n, int head_cap) {
  const int rows = gridDim.y, ctas = p.ctas;
  const int tiles = max(1, (n + TILE - 1) / TILE);
  const int want = max(1, min(tiles, min(ctas, p.sms / rows)));
  const int per = (tiles + want - 1) / want, splits = (tiles + per - 1) / per;
  const int head_tiles = (p.heads + 15) / 16;
  int groups = 1;
  for (int g = 4; g > 1; g >>= 1)
    if (g <= head_tiles && rows * splits * g <= p.sms && splits * g <= ctas) {
      groups = g;
      break;
    }
  groups = max(groups, (16 * head_tiles + head_cap - 1) / head_cap);  // no more heads a CTA than it holds
  const int head_tile = 16 * ((head_tiles + groups - 1) / groups);
  return {splits, per * TILE, head_tile, (p.heads + head_tile - 1) / head_tile};
}

// Shared memory of a CTA holding up to HM heads, in bytes (dsuf.gpu.attention.attention_kernel mirrors it).
template <int HM>
struct AttnSmem {
  static constexpr int q = 0;
  static constexpr int k = q + HM * ROW * 2;       // two K tiles: one multiplied while the next is stored
  static constexpr int s = k + 2 * TILE * ROW * 2;  // the two halves' scores [2][HM][S_ROW]
  static constexpr int p = s + 2 * HM * S_ROW * 4;
  static constexpr int alpha = p + HM * P_ROW * 2;
  static constexpr int idx = alpha + HM * 4;        // the two tiles' entries
  static constexpr int bytes = idx + 2 * TILE * 4;
};

// One thread's share of a tile in flight: thread (entry e = tid / 8, part j = tid % 8) loads the
// entry's 8-byte words j + 8 i (i < 7: nope dims 8 (j + 8 i) .., all in scale block i; i = 7, 8:
// rope dims 448 + 4 j and 480 + 4 j) and the word holding the 7 scales.
struct Gather {
  uint2 w[9];
  uint2 scales;
  int entry;
};

DSUF_DEVICE uint2 ld_nc_u2(const void* p) {
  uint2 v;
  asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

DSUF_DEVICE void gather_load(Gather& g, const AttnParams& p, int row, int slot, int end, int j) {
  g.entry = slot < end ? p.idx[(i64)row * p.n_idx + slot] : -1;
  if (g.entry < 0) return;
  const uint2* e = reinterpret_cast<const uint2*>(p.kv + (i64)g.entry * KV_ENTRY);
#pragma unroll
  for (int i = 0; i < 9; ++i) g.w[i] = ld_nc_u2(e + j + 8 * i);
  g.scales = ld_nc_u2(e + 72);
}

// Dequantise into the bf16 K tile (row e); missing entries become zeros (their probability is 0,
// and 0 * garbage could be NaN).
DSUF_DEVICE void gather_store(const Gather& g, u16* k_row, int* idx_s, int e, int j) {
  if (j == 0) idx_s[e] = g.entry;
  if (g.entry < 0) {
#pragma unroll
    for (int i = 0; i < 7; ++i) *reinterpret_cast<uint4*>(k_row + 8 * (j + 8 * i)) = make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint2*>(k_row + 448 + 4 * j) = make_uint2(0, 0);
    *reinterpret_cast<uint2*>(k_row + 480 + 4 * j) = make_uint2(0, 0);
    return;
  }
#pragma unroll
  for (int i = 0; i < 7; ++i) {
    const u32 code = i < 4 ? (g.scales.x >> (8 * i)) & 0xff : (g.scales.y >> (8 * (i - 4))) & 0xff;
    const float s = e8m0_to_f32(code);
    float v[8];
    e4m3x2_to_f32x2(g.w[i].x & 0xffff, v[0], v[1]);
    e4m3x2_to_f32x2(g.w[i].x >> 16, v[2], v[3]);
    e4m3x2_to_f32x2(g.w[i].y & 0xffff, v[4], v[5]);
    e4m3x2_to_f32x2(g.w[i].y >> 16, v[6], v[7]);
    // e4m3 times a power of two is exact in bf16.
    *reinterpret_cast<uint4*>(k_row + 8 * (j + 8 * i)) =
        make_uint4(bf16x2(v[0] * s, v[1] * s), bf16x2(v[2] * s, v[3] * s), bf16x2(v[4] * s, v[5] * s),
                   bf16x2(v[6] * s, v[7] * s));
  }
  *reinterpret_cast<uint2*>(k_row + 448 + 4 * j) = g.w[7];
  *reinterpret_cast<uint2*>(k_row + 480 + 4 * j) = g.w[8];
}

// Output dims d, d + 1 of a head: o / l in bf16, rotated back by the row's position where they
// are rope dims and cos_t is given.
DSUF_DEVICE u32 out_pair(const AttnParams& p, int row, int d, float o0, float o1, float l) {
  u32 v = bf16x2(o0 / l, o1 / l);
  if (p.cos_t && d >= DIM - 2 * ROPE_PAIRS) {
    const int pair = (d - (DIM - 2 * ROPE_PAIRS)) / 2;
    v = rotate_pair(v, p.cos_t[row * ROPE_PAIRS + pair], -p.sin_t[row * ROPE_PAIRS + pair]);
  }
  return v;
}

// A row of one split (a prompt chunk's rows): its output straight from the accumulators, by the
// operations sparse_attn_combine would apply to this split alone (0 + x w as its first sum
// rounds it). wl: 2 floats a head of shared memory no thread reads any more. Heads h0 .. h0+nh-1.
template <int HM>
DSUF_DEVICE void finish_row(const AttnParams& p, int row, int h0, int nh, float m_run, float l_run, const float (&acc)[HM / 16][8][4], float* wl) {
  const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2, t = tid & 3, sr = tid >> 2, sq = tid & 3;
  if (sq == 0 && sr < nh) {
    const float ref = m_run == NEG_INF ? 0.0f : m_run;
    const float w = expf(m_run - ref);
    wl[2 * sr] = w;
    wl[2 * sr + 1] = __fadd_rn(__fadd_rn(0.0f, __fmul_rn(l_run, w)), expf(p.sink[h0 + sr] - ref));
  }
  __syncthreads();
  u16* out = p.out + ((i64)row * p.heads + h0) * DIM;
#pragma unroll
  for (int mt = 0; mt < HM / 16; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int h = 16 * mt + g + 8 * half;
      if (h >= nh) continue;
      const float w = wl[2 * h], l = wl[2 * h + 1];
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int d = 64 * warp + 8 * n + 2 * t;
        const float o0 = __fadd_rn(0.0f, __fmul_rn(acc[mt][n][2 * half], w)), o1 = __fadd_rn(0.0f, __fmul_rn(acc[mt][n][2 * half + 1], w));
        *reinterpret_cast<u32*>(out + h * DIM + d) = out_pair(p, row, d, o0, o1, l);
      }
    }
}

// Scores of heads 16 mt .. +16 x keys 16 nh .. +16 over dims halves kh .. kh + NH - 1 (256 each),
// unscaled, into the halves' score tiles (NH = 2: both halves' chains interleaved).
template <int NH>
DSUF_DEVICE void score_tile(const u16* q_s, const u16* k_s, float* s_s, int hm, int mt, int nh, int kh) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float s[NH][2][4];
#pragma unroll
  for (int h = 0; h < NH; ++h)
#pragma unroll
    for (int n = 0; n < 2; ++n) s[h][n][0] = s[h][n][1] = s[h][n][2] = s[h][n][3] = 0.0f;
  const u16* qa = q_s + (16 * mt + (lane & 15)) * ROW + (lane >> 4) * 8 + kh * (DIM / 2);
  const u16* kb = k_s + (16 * nh + (lane >> 4) * 8 + (lane & 7)) * ROW + ((lane >> 3) & 1) * 8 + kh * (DIM / 2);
#pragma unroll 4
  for (int ks = 0; ks < DIM / 32; ++ks)
#pragma unroll
    for (int h = 0; h < NH; ++h) {
      u32 a[4], b[4];
      ldmatrix_x4(a, qa + h * (DIM / 2) + 16 * ks);
      ldmatrix_x4(b, kb + h * (DIM / 2) + 16 * ks);
      mma_bf16(s[h][0], a, b[0], b[1]);
      mma_bf16(s[h][1], a, b[2], b[3]);
    }
#pragma unroll
  for (int h = 0; h < NH; ++h)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      float* r0 = s_s + ((kh + h) * hm + 16 * mt + g) * S_ROW + 16 * nh + 8 * n + 2 * t;
      float* r1 = r0 + 8 * S_ROW;
      r0[0] = s[h][n][0], r0[1] = s[h][n][1];
      r1[0] = s[h][n][2], r1[1] = s[h][n][3];
    }
}

template <int HM>
DSUF_DEVICE void attn_decode(const AttnParams& p) {
  // The plan comes first, from `used`, read before the PDL wait (see AttnParams, pdl_begin): the
  // CTAs past it leave at once, the others start gathering as soon as the wait ends.
  using Smem = AttnSmem<HM>;
  const int row = blockIdx.y;
  const int used = used_slots(p, row);
  const AttnPlan plan = attn_plan(p, used, HM);
  if ((int)blockIdx.x >= plan.splits * plan.groups) return;
  pdl_begin();
  extern __shared__ __align__(16) u8 smem[];
  u16* q_s = reinterpret_cast<u16*>(smem + Smem::q);
  u16* k_s = reinterpret_cast<u16*>(smem + Smem::k);
  float* s_s = reinterpret_cast<float*>(smem + Smem::s);
  u16* p_s = reinterpret_cast<u16*>(smem + Smem::p);
  float* alpha_s = reinterpret_cast<float*>(smem + Smem::alpha);
  int* idx_s = reinterpret_cast<int*>(smem + Smem::idx);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x / plan.groups;
  const int begin = split * plan.per_split, end = min(used, begin + plan.per_split);

  // This CTA's heads h0 .. h0+n_heads-1 (of a tensor-parallel rank's p.heads), padded to whole 16-head
  // MMA tiles: the tiles past them are neither computed nor written.
  const int h0 = blockIdx.x % plan.groups * plan.head_tile, n_heads = min(p.heads - h0, plan.head_tile);
  const int hp = (n_heads + 15) & ~15;
  const u16* q = p.q + ((i64)row * p.heads + h0) * DIM;
  for (int i = tid; i < hp * DIM / 8; i += 256) {
    const int h = i / (DIM / 8), c = i % (DIM / 8);
    *reinterpret_cast<uint4*>(q_s + h * ROW + 8 * c) = h < n_heads ? *reinterpret_cast<const uint4*>(q + h * DIM + 8 * c) : make_uint4(0, 0, 0, 0);
  }

  const int ge = tid >> 3, gj = tid & 7;  // gather role
  const int sr = tid >> 2, sq = tid & 3;  // softmax role: head sr, keys 8 sq .. 8 sq + 7
  const int tiles2 = 2 * (hp / 16);       // S's (16-head, 16-key) tiles
  float m_run = NEG_INF, l_run = 0.0f;
  float acc[HM / 16][8][4];
#pragma unroll
  for (int mt = 0; mt < HM / 16; ++mt)
#pragma unroll
    for (int n = 0; n < 8; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.0f;

  // Tile i is gathered into K buffer i % 2 while tile i - 1 is multiplied: stored during tile i - 1's
  // softmax (the buffer's last reader, tile i - 2's P V, is behind the barrier before it), its
  // loads in flight since tile i - 2's. A tile of no entries costs its arithmetic and changes
  // nothing (alpha 1, or 0 on accumulators that are still 0; its probabilities are 0).
  Gather gat;
  gather_load(gat, p, row, begin + ge, end, gj);
  gather_store(gat, k_s + ge * ROW, idx_s, ge, gj);
  if (begin + TILE < end) gather_load(gat, p, row, begin + TILE + ge, end, gj);
  for (int base = begin, buf = 0; base < end; base += TILE, buf ^= 1) {
    __syncthreads();  // tile buf stored; the previous tile's P V done
    const u16* k_t = k_s + buf * TILE * ROW;
    const int* idx_t = idx_s + buf * TILE;

    if (2 * tiles2 <= 8) {  // a (tile, half) a warp
      const int tile = warp % tiles2;
      if (warp < 2 * tiles2) score_tile<1>(q_s, k_t, s_s, HM, tile >> 1, tile & 1, warp / tiles2);
    } else if (warp < tiles2) {
      score_tile<2>(q_s, k_t, s_s, HM, warp >> 1, warp & 1, 0);
    }
    __syncthreads();

    if (sr < hp) {  // online softmax of head sr over this tile (whole warps: 8 heads a warp)
      float v[8], mx = NEG_INF;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float* sk = s_s + sr * S_ROW + 8 * sq + k;
        v[k] = idx_t[8 * sq + k] >= 0 ? __fmul_rn(__fadd_rn(sk[0], sk[HM * S_ROW]), p.scale) : NEG_INF;
        mx = fmaxf(mx, v[k]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run, mx);
      const float ref = m_new == NEG_INF ? 0.0f : m_new;  // nothing seen yet: every p is 0
      const float alpha = expf(m_run - ref);
      float pk[8], sum = 0.0f;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        pk[k] = expf(v[k] - ref);
        sum += pk[k];
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      l_run = l_run * alpha + sum;
      m_run = m_new;
      if (sq == 0) alpha_s[sr] = alpha;
      *reinterpret_cast<uint4*>(p_s + sr * P_ROW + 8 * sq) =
          make_uint4(bf16x2(pk[0], pk[1]), bf16x2(pk[2], pk[3]), bf16x2(pk[4], pk[5]), bf16x2(pk[6], pk[7]));
    }
    if (base + TILE < end) {  // the next tile into the other buffer; the one after it in flight
      gather_store(gat, k_s + (buf ^ 1) * TILE * ROW + ge * ROW, idx_s + (buf ^ 1) * TILE, ge, gj);
      if (base + 2 * TILE < end) gather_load(gat, p, row, base + 2 * TILE + ge, end, gj);
    }
    __syncthreads();

    {  // O = alpha O + P K for dims 64 warp ..
#pragma unroll
      for (int mt = 0; mt < HM / 16; ++mt) {
        if (16 * mt >= hp) break;
        const float a0 = alpha_s[16 * mt + g], a1 = alpha_s[16 * mt + g + 8];
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          acc[mt][n][0] *= a0;
          acc[mt][n][1] *= a0;
          acc[mt][n][2] *= a1;
          acc[mt][n][3] *= a1;
        }
      }
#pragma unroll
      for (int kstep = 0; kstep < TILE / 16; ++kstep) {
        u32 b[4][4];
#pragma unroll
        for (int np = 0; np < 4; ++np)
          ldmatrix_x4_trans(b[np], k_t + (16 * kstep + ((lane >> 3) & 1) * 8 + (lane & 7)) * ROW + 64 * warp + 16 * np +
                                       (lane >> 4) * 8);
#pragma unroll
        for (int mt = 0; mt < HM / 16; ++mt) {
          if (16 * mt >= hp) break;
          u32 a[4];
          ldmatrix_x4(a, p_s + (16 * mt + (lane & 15)) * P_ROW + 16 * kstep + (lane >> 4) * 8);
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            mma_bf16(acc[mt][2 * np], a, b[np][0], b[np][1]);
            mma_bf16(acc[mt][2 * np + 1], a, b[np][2], b[np][3]);
          }
        }
      }
    }
  }

  if (plan.splits == 1) {  // sparse_attn_combine's work for one split, here (the same operations)
    finish_row<HM>(p, row, h0, n_heads, m_run, l_run, acc, s_s);
    return;
  }
  const i64 part = (i64)row * p.splits + split;
  if (sq == 0 && sr < n_heads) {
    p.part_ml[(part * HEADS + h0 + sr) * 2] = m_run;
    p.part_ml[(part * HEADS + h0 + sr) * 2 + 1] = l_run;
  }
  float* po = p.part_o + (part * HEADS + h0) * DIM;
#pragma unroll
  for (int mt = 0; mt < HM / 16; ++mt)
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const int h = 16 * mt + g, d = 64 * warp + 8 * n + 2 * t;
      if (h < n_heads) *reinterpret_cast<float2*>(po + h * DIM + d) = make_float2(acc[mt][n][0], acc[mt][n][1]);
      if (h + 8 < n_heads) *reinterpret_cast<float2*>(po + (h + 8) * DIM + d) = make_float2(acc[mt][n][2], acc[mt][n][3]);
    }
}

extern "C" __global__ void __launch_bounds__(256, 1) sparse_attn_decode(const __grid_constant__ AttnParams p) { attn_decode<64>(p); }
extern "C" __global__ void __launch_bounds__(256, 2) sparse_attn_decode_h32(const __grid_constant__ AttnParams p) { attn_decode<32>(p); }

// out[row, h] = sum_s w_s O_s / (sum_s w_s l_s + exp(sink[h] - M)), w_s = exp(m_s - M), M = max_s m_s;
// the row's splits in order; then the inverse RoPE if cos_t is given. grid (heads, rows, parts),
// 512 / parts / 4 threads: 4 dims a thread. Each warp reads the splits' (m, l) first, into its
// shared memory, with up to 32 splits' outputs in flight meanwhile (a decode step's combine is a
// chain of memory latencies; its few rows' heads are spread over 4 CTAs each).
#define COMBINE_SPLITS 256  // most splits a row (the launcher checks)
#define COMBINE_UNROLL 32
extern "C" __global__ void __launch_bounds__(128) sparse_attn_combine(const __grid_constant__ AttnParams p) {
  pdl_begin();
  __shared__ float w_all[4][COMBINE_SPLITS], l_all[4][COMBINE_SPLITS];
  const int h = blockIdx.x, row = blockIdx.y, lane = threadIdx.x & 31, d = 4 * (threadIdx.x + blockDim.x * blockIdx.z);
  float* w_s = w_all[threadIdx.x >> 5];
  float* l_s = l_all[threadIdx.x >> 5];
  const int splits = attn_plan(p, used_slots(p, row), HEADS).splits;
  if (splits == 1) return;  // the attention kernel finished the row
  const float* ml = p.part_ml + (i64)row * p.splits * HEADS * 2;
  const float* po = p.part_o + ((i64)row * p.splits * HEADS + h) * DIM + d;
  // The first round of outputs is in flight with the (m, l) loads (it does not depend on them).
  float4 v[COMBINE_UNROLL];
#pragma unroll
  for (int u = 0; u < COMBINE_UNROLL; ++u)
    if (u < splits) v[u] = *reinterpret_cast<const float4*>(po + (i64)u * HEADS * DIM);
  float mx = NEG_INF;
  for (int s = lane; s < splits; s += 32) {
    const float2 m = *reinterpret_cast<const float2*>(ml + (s * HEADS + h) * 2);
    w_s[s] = m.x, l_s[s] = m.y;
    mx = fmaxf(mx, m.x);
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const float ref = mx == NEG_INF ? 0.0f : mx;
  for (int s = lane; s < splits; s += 32) w_s[s] = expf(w_s[s] - ref);
  __syncwarp();
  float l = 0.0f;
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int s0 = 0; s0 < splits; s0 += COMBINE_UNROLL) {
    if (s0)
#pragma unroll
      for (int u = 0; u < COMBINE_UNROLL; ++u)
        if (s0 + u < splits) v[u] = *reinterpret_cast<const float4*>(po + (i64)(s0 + u) * HEADS * DIM);
#pragma unroll
    for (int u = 0; u < COMBINE_UNROLL; ++u) {
      if (s0 + u >= splits) break;
      const float w = w_s[s0 + u];
      l += l_s[s0 + u] * w;
      o.x += v[u].x * w;
      o.y += v[u].y * w;
      o.z += v[u].z * w;
      o.w += v[u].w * w;
    }
  }
  l += expf(p.sink[h] - ref);
  *reinterpret_cast<uint2*>(p.out + ((i64)row * p.heads + h) * DIM + d) = make_uint2(out_pair(p, row, d, o.x, o.y, l), out_pair(p, row, d + 2, o.z, o.w, l));
}
