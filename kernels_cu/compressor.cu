// One decode step of V4's KV compressors (layers.Compressor, then v4.Compressor's RoPE and cache
// format) for B sequences, each at its own position p (int32 on the device, so a CUDA graph serves
// any mix of positions; p < 0 marks a padding row, which touches nothing).
//
// The token's projections kv, score (float32, from the caller's matmul) join the state: score +=
// ape[p % ratio], both written to state row cur + p % ratio (cur = ratio for the overlapping ratio
// 4, else 0). When the token completes its group g = p / ratio, the entry is pooled per channel:
// softmax over the group's slots of score in float64, weighted sum of kv in float64, rounded to
// float32 then bf16 (for ratio 4 eight slots: the previous group's rows 0..3 on channels
// [0, width), with score -inf for g = 0, and this group's rows on [width, 2 width)). Then
// RMSNorm as layers.rms_norm (sum of squares in float64, r = f32(1 / sqrt(mean + eps)),
// bf16(w * (x * r))), RoPE on the last 64 dims at the entry's position g * ratio with cos / sin
// as layers.Rope.cos_sin computes them (angle = f32(f32(pos) * freq), cos and sin in float64
// rounded to float32; products and sums rounded, no FMA), and the entry is written: width 512 as
// a 584-byte FP8 KV entry, width 128 (the indexer's keys) Hadamard-rotated (exact sum in float64
// times f32(128**-0.5), rounded to float32 then bf16) as a 68-byte FP4 key. The state then moves
// on: for ratio 4 the current group's rows become rows 0..3; the current rows are reset to kv 0,
// score -inf.
//
// grid (width / 64, R) in clusters of width / 64 CTAs, one cluster per run of rows (a row, or
// the rows of one sequence at consecutive positions, taken in order; those that complete no group
// together); a CTA pools 64 channels: 16 threads of 4 channels times LN slot lanes. CTA 0 of the
// cluster gathers the pooled bf16 row from its peers' shared memory, normalises, rotates and
// writes the entry.
//
// The kernels NAME_chunk run the groups of many rows in parallel: a prompt chunk's (pos null: rows
// at positions chunk_first .. chunk_first + chunk_rows - 1 of the sequence whose state is
// state_row[0]; cluster y pools the y-th group the chunk completes) or a step's (pos set:
// chunk_rows rows, each sequence's side by side at consecutive positions; cluster y takes row y if
// it completes a group). A slot's row comes straight from the launch's projections (score + ape,
// as the state would hold it) where its position is one of the sequence's rows there, else from
// the sequence's state, which this pass only reads. A second launch with chunk_state set then
// writes the state each sequence's rows leave (a cluster a sequence: the chunk's, or a step's
// cluster y if row y is its sequence's last), as its rows applied in order would.
#include "cache_entries.cuh"

#define NEG_INF __int_as_float(0xff800000)
#define CH 64  // pooled channels per CTA

struct CompressParams {
  const float* kv;     // [B, C] the token's projections, rows kv_stride floats apart
  const float* score;  // [B, C], rows score_stride floats apart
  const int* pos;      // [B] the token's position; < 0: padding
  float* state_kv;     // [S, NS, C] (NS = 2 ratio for ratio 4, else ratio)
  float* state_score;  // [S, NS, C]
  const float* ape;    // [ratio, C]
  const float* norm;   // [width]
  const float* freqs;  // [32] layers.Rope.freqs
  u8* pool;            // width 512: KV entries [*, 584]; width 128: index keys [*, 68]
  const int* kv_slot;  // [B] width 512: the new entry's pool entry (< 0: not written)
  const i64* key_row;  // [B] width 128: likewise
  u16* latent;         // [B, width] or null: the new entry after RoPE (before the Hadamard rotation)
  i64 kv_stride;
  i64 score_stride;
  double eps;
  const i64* state_row;  // [B] or null: row b's state is state[state_row[b]] (else state[b])
  const int* runs;       // [R + 1] or null: cluster y takes rows runs[y] .. runs[y + 1] - 1 in order (else row y)
  int chunk_first;       // NAME_chunk: a chunk's first position (pos null), and its rows or the step's
  int chunk_rows;
  int chunk_state;       // NAME_chunk's second pass: write the state the chunk leaves
};

DSUF_DEVICE float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
DSUF_DEVICE void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
DSUF_DEVICE float4 add4(float4 a, float4 b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }
DSUF_DEVICE float at(const float4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// Thread-block clusters: a barrier of every thread of the cluster (split into arrive and wait;
// release / acquire order the shared-memory writes before it), and reading a peer CTA's shared
// memory.
DSUF_DEVICE void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
DSUF_DEVICE void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

DSUF_DEVICE u16 ld_peer_u16(const u16* local, u32 rank) {
  u32 remote;
  u16 v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  asm volatile("ld.shared::cluster.u16 %0, [%1];" : "=h"(v) : "r"(remote) : "memory");
  return v;
}

// NAME_chunk's rows: row b's position and state row.
DSUF_DEVICE int chunk_pos(const CompressParams& p, int b) { return p.pos ? p.pos[b] : p.chunk_first + b; }
DSUF_DEVICE i64 chunk_state_row(const CompressParams& p, int b) { return p.pos ? (p.state_row ? p.state_row[b] : (i64)b) : p.state_row[0]; }

// Whether position P of row b's sequence (row b at position at) is one of the launch's rows: the
// row r = b - (at - P), if it is that sequence's.
DSUF_DEVICE bool chunk_has(const CompressParams& p, int b, int at, int P) {
  const int r = b - (at - P);
  return r >= 0 && (!p.pos || (p.pos[r] == P && chunk_state_row(p, r) == chunk_state_row(p, b)));
}

// Position P of row b's sequence (row b at position at) at channels col .. col + 3 as the state
// holds it (kv, score + ape): the launch's row that has it, else the sequence's state from before
// the launch (its current group's rows from CUR, the previous group's from 0: P's group is the
// current one if the launch starts in it, that is if it has P's group's last position); before
// position 0, an empty row.
template <int RATIO, int C, int CUR>
DSUF_DEVICE void chunk_slot(const CompressParams& p, const float* st_kv, const float* st_score, int b, int at, int P, int col, float4& kv,
                            float4& sc) {
  if (P < 0) {
    kv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    sc = make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
  } else if (chunk_has(p, b, at, P)) {
    const i64 q = b - (at - P);
    kv = ld4(p.kv + q * p.kv_stride + col);
    sc = add4(ld4(p.score + q * p.score_stride + col), ld4(p.ape + (P % RATIO) * C + col));
  } else {
    const int r = (chunk_has(p, b, at, P / RATIO * RATIO + RATIO - 1) ? CUR : 0) + P % RATIO;
    kv = ld4(st_kv + r * C + col);
    sc = ld4(st_score + r * C + col);
  }
}

// Row r at position pos, which completes no group, joins state row `row`: channels col .. col + 3
// of its kv and score + ape into the state's row CUR + pos % RATIO (of C channels).
template <int RATIO, int C, int CUR>
DSUF_DEVICE void join_state(const CompressParams& p, int r, int pos, i64 row, int col) {
  constexpr int NS = CUR + RATIO;
  const int at = (CUR + pos % RATIO) * C + col;
  st4(p.state_kv + row * NS * C + at, ld4(p.kv + r * p.kv_stride + col));
  st4(p.state_score + row * NS * C + at, add4(ld4(p.score + r * p.score_stride + col), ld4(p.ape + (pos % RATIO) * C + col)));
}

template <int WIDTH, int RATIO, int LN, bool CHUNK>
DSUF_DEVICE void compress_row(const CompressParams& p, const int b) {
  constexpr bool OVERLAP = RATIO == 4;
  constexpr int C = OVERLAP ? 2 * WIDTH : WIDTH;   // projection / state channels
  constexpr int NS = OVERLAP ? 2 * RATIO : RATIO;  // state rows = pooled slots
  constexpr int SPT = NS / LN;                     // slots a thread pools
  constexpr int CUR = OVERLAP ? RATIO : 0;         // first state row of the current group
  constexpr int NT = 16 * LN;
  static_assert(NS % LN == 0 && WIDTH % CH == 0 && WIDTH % NT == 0 && NT >= 32, "compressor shape");
  static_assert(WIDTH == 512 || (WIDTH == IDX_DIM && NT == IDX_DIM), "KV entries of 512 or index keys of 128");

  // What CTA 0 needs to finish an entry, loaded with the position (none of it depends on it).
  float freq = 0.0f, weight[WIDTH / NT];
  i64 dst = -1;
  if (blockIdx.x == 0) {
    if (threadIdx.x < ROPE_PAIRS) freq = p.freqs[threadIdx.x];
    if (threadIdx.x < 32) dst = WIDTH == 512 ? (i64)p.kv_slot[b] : p.key_row[b];
#pragma unroll
    for (int k = 0; k < WIDTH / NT; ++k) weight[k] = p.norm[threadIdx.x + k * NT];
  }
  const int pos = CHUNK ? chunk_pos(p, b) : p.pos[b];
  if (pos < 0) return;
  const int phase = pos % RATIO;
  const int s = threadIdx.x >> 4;
  const int c = blockIdx.x * CH + 4 * (threadIdx.x & 15);
  const i64 row = CHUNK ? chunk_state_row(p, b) : p.state_row ? p.state_row[b] : (i64)b;
  float* st_kv = p.state_kv + row * NS * C;
  float* st_score = p.state_score + row * NS * C;
  const float* kv_in = p.kv + b * p.kv_stride;
  const float* score_in = p.score + b * p.score_stride;
  const float* ape = p.ape + phase * C;

  if (phase != RATIO - 1) {  // no entry completes: the token joins the current group
    if (s < C / WIDTH) join_state<RATIO, C, CUR>(p, b, pos, row, s * WIDTH + c);
    return;
  }

  // Slot j = s * SPT + i: state row j at channel c, or (ratio 4, this group) at width + c; the
  // last slot is the token itself. `lo`: the current group's other half, moved with it below.
  float4 kv[SPT], sc[SPT], kv_lo[SPT], sc_lo[SPT];
#pragma unroll
  for (int i = 0; i < SPT; ++i) {
    const int j = s * SPT + i;
    const int col = OVERLAP && j >= RATIO ? WIDTH + c : c;
    if (CHUNK) {  // slot j is position (pos / RATIO) * RATIO + j - CUR
      chunk_slot<RATIO, C, CUR>(p, st_kv, st_score, b, pos, pos - (NS - 1) + j, col, kv[i], sc[i]);
    } else if (j == NS - 1) {
      kv[i] = ld4(kv_in + col);
      sc[i] = add4(ld4(score_in + col), ld4(ape + col));
    } else {
      kv[i] = ld4(st_kv + j * C + col);
      sc[i] = ld4(st_score + j * C + col);
    }
    if (OVERLAP && j >= RATIO && !CHUNK) {
      if (j == NS - 1) {
        kv_lo[i] = ld4(kv_in + c);
        sc_lo[i] = add4(ld4(score_in + c), ld4(ape + c));
      } else {
        kv_lo[i] = ld4(st_kv + j * C + c);
        sc_lo[i] = ld4(st_score + j * C + c);
      }
    }
    if (OVERLAP && j < RATIO && pos == RATIO - 1) sc[i] = make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);  // group 0
  }
  // The entry's rotation, while the loads are in flight.
  float rope_cos = 0.0f, rope_sin = 0.0f;
  if (blockIdx.x == 0 && threadIdx.x < ROPE_PAIRS) {
    const double angle = (double)__fmul_rn((float)(pos - (RATIO - 1)), freq);
    rope_cos = (float)cos(angle);
    rope_sin = (float)sin(angle);
  }

  __shared__ float s_max[LN][CH];
  __shared__ double s_sum[LN][CH], s_acc[LN][CH];
  const int ch = 4 * (threadIdx.x & 15);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float m = at(sc[0], k);
#pragma unroll
    for (int i = 1; i < SPT; ++i) m = fmaxf(m, at(sc[i], k));
    s_max[s][ch + k] = m;
  }
  __syncthreads();

  // Every state row this CTA pools has been read: move the group on (a chunk's state: its second pass).
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f), empty = make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
#pragma unroll
  for (int i = 0; i < SPT && !CHUNK; ++i) {
    const int j = s * SPT + i;
    if (OVERLAP && j >= RATIO) {
      const int prev = (j - RATIO) * C;
      st4(st_kv + prev + c, kv_lo[i]);
      st4(st_kv + prev + WIDTH + c, kv[i]);
      st4(st_score + prev + c, sc_lo[i]);
      st4(st_score + prev + WIDTH + c, sc[i]);
      st4(st_kv + j * C + WIDTH + c, zero);
      st4(st_score + j * C + WIDTH + c, empty);
    }
    if (!OVERLAP || j >= RATIO) {
      st4(st_kv + j * C + c, zero);
      st4(st_score + j * C + c, empty);
    }
  }

  double l[4], a[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float m = s_max[0][ch + k];
#pragma unroll
    for (int t = 1; t < LN; ++t) m = fmaxf(m, s_max[t][ch + k]);
    l[k] = 0.0;
    a[k] = 0.0;
#pragma unroll
    for (int i = 0; i < SPT; ++i) {
      const double e = exp((double)at(sc[i], k) - (double)m);
      l[k] += e;
      a[k] += (double)at(kv[i], k) * e;
    }
    s_sum[s][ch + k] = l[k];
    s_acc[s][ch + k] = a[k];
  }
  __syncthreads();
  __shared__ __align__(16) u16 s_pooled[CH];
  if (s == 0) {
    float y[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      double sum = 0.0, acc = 0.0;
#pragma unroll
      for (int t = 0; t < LN; ++t) {
        sum += s_sum[t][ch + k];
        acc += s_acc[t][ch + k];
      }
      y[k] = (float)(acc / sum);
    }
    *reinterpret_cast<uint2*>(s_pooled + ch) = make_uint2(bf16x2(y[0], y[1]), bf16x2(y[2], y[3]));
  }

  // CTA 0 gathers the pooled row; the others wait until it has read their shared memory.
  cluster_arrive();
  cluster_wait();
  if (blockIdx.x != 0) {
    cluster_arrive();
    cluster_wait();
    return;
  }
  __shared__ __align__(16) u16 s_out[WIDTH];
  __shared__ double s_part[NT / 32];
  float y[WIDTH / NT];
  double ss = 0.0;
#pragma unroll
  for (int k = 0; k < WIDTH / NT; ++k) {
    const int d = threadIdx.x + k * NT;
    y[k] = bf16_to_f32(ld_peer_u16(s_pooled + d % CH, d / CH));
    ss += (double)y[k] * (double)y[k];
  }
  cluster_arrive();  // done with the peers' shared memory
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) s_part[threadIdx.x >> 5] = ss;
  __syncthreads();
  double total = 0.0;
#pragma unroll
  for (int w = 0; w < NT / 32; ++w) total += s_part[w];
  const float r = (float)(1.0 / sqrt(total / WIDTH + p.eps));
#pragma unroll
  for (int k = 0; k < WIDTH / NT; ++k) {
    const int d = threadIdx.x + k * NT;
    s_out[d] = f32_to_bf16(__fmul_rn(weight[k], __fmul_rn(y[k], r)));
  }
  __syncthreads();
  if (threadIdx.x < ROPE_PAIRS) {
    u32* pair = reinterpret_cast<u32*>(s_out + WIDTH - 2 * ROPE_PAIRS) + threadIdx.x;
    *pair = rotate_pair(*pair, rope_cos, rope_sin);
  }
  __syncthreads();
  if (p.latent) {
#pragma unroll
    for (int k = 0; k < WIDTH / NT; ++k) p.latent[(i64)b * WIDTH + threadIdx.x + k * NT] = s_out[threadIdx.x + k * NT];
  }
  const int lane = threadIdx.x;
  if constexpr (WIDTH == 512) {
    if (threadIdx.x < 32 && dst >= 0) kv_entry_fp8(s_out, p.pool + dst * KV_ENTRY, lane);
  } else {
    __shared__ double s_x[IDX_DIM];
    __shared__ float s_rot[IDX_DIM];
    s_x[threadIdx.x] = bf16_to_f32(s_out[threadIdx.x]);
    __syncthreads();
    double acc[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};  // exact: signed sums of bf16 values
#pragma unroll
    for (int i = 0; i < IDX_DIM; ++i) acc[i % 8] += __popc(i & threadIdx.x) & 1 ? -s_x[i] : s_x[i];
    const double sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    s_rot[threadIdx.x] = bf16_to_f32(f32_to_bf16((float)(sum * (double)HADAMARD_SCALE)));
    __syncthreads();
    if (threadIdx.x < 32 && dst >= 0) {
      const float v[4] = {s_rot[4 * lane], s_rot[4 * lane + 1], s_rot[4 * lane + 2], s_rot[4 * lane + 3]};
      u32 code[4];
      float grid[4];
      const int e = fp4_quant4(v, code, grid);
      index_entry_fp4(p.pool + dst * IDX_ENTRY, code, e, lane);
    }
  }
  cluster_wait();
}

// The state that the launch's rows of row b's sequence leave (b: their last): row j holds position
// (n / RATIO) * RATIO + j - CUR (n: the position after row b) if it was fed, else nothing (kv 0,
// score -inf). If the rows complete no group, only theirs change (the rows past them are empty
// already: a decode step's cost); else every row is read, then written.
template <int WIDTH, int RATIO, int LN>
DSUF_DEVICE void chunk_state(const CompressParams& p, int b) {
  constexpr bool OVERLAP = RATIO == 4;
  constexpr int C = OVERLAP ? 2 * WIDTH : WIDTH, NS = OVERLAP ? 2 * RATIO : RATIO, SPT = NS / LN, CUR = OVERLAP ? RATIO : 0;
  const int s = threadIdx.x >> 4;
  const int c = blockIdx.x * CH + 4 * (threadIdx.x & 15);
  const int at = chunk_pos(p, b), n = at + 1, base = n / RATIO * RATIO - CUR;
  const bool moved = n >= RATIO && chunk_has(p, b, at, n / RATIO * RATIO - 1);  // the rows complete a group
  float* st_kv = p.state_kv + chunk_state_row(p, b) * NS * C;
  float* st_score = p.state_score + chunk_state_row(p, b) * NS * C;
  float4 kv[SPT][C / WIDTH], sc[SPT][C / WIDTH];
  bool write[SPT];
#pragma unroll
  for (int i = 0; i < SPT; ++i) {
    const int P = base + s * SPT + i;
    write[i] = moved || (P >= 0 && P < n && chunk_has(p, b, at, P));
#pragma unroll
    for (int h = 0; h < C / WIDTH && write[i]; ++h)
      chunk_slot<RATIO, C, CUR>(p, st_kv, st_score, b, at, P < n ? P : -1, h * WIDTH + c, kv[i][h], sc[i][h]);
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < SPT; ++i) {
#pragma unroll
    for (int h = 0; h < C / WIDTH && write[i]; ++h) {
      const int o = (s * SPT + i) * C + h * WIDTH + c;
      st4(st_kv + o, kv[i][h]);
      st4(st_score + o, sc[i][h]);
    }
  }
}

// NAME_chunk's cluster y: a chunk's row completing its y-th group, or a step's row y if it
// completes one; second pass: the state the chunk leaves, or row y's sequence's if y is its last.
template <int WIDTH, int RATIO, int LN>
DSUF_DEVICE void compress_chunk_pass(const CompressParams& p) {
  const int y = blockIdx.y;
  if (p.chunk_state && !p.pos) {
    chunk_state<WIDTH, RATIO, LN>(p, p.chunk_rows - 1);
  } else if (p.chunk_state) {
    const bool next_is_its = y + 1 < p.chunk_rows && p.pos[y + 1] == p.pos[y] + 1 && chunk_state_row(p, y + 1) == chunk_state_row(p, y);
    if (p.pos[y] >= 0 && !next_is_its) chunk_state<WIDTH, RATIO, LN>(p, y);
  } else if (!p.pos) {
    compress_row<WIDTH, RATIO, LN, true>(p, RATIO - 1 - p.chunk_first % RATIO + y * RATIO);
  } else if (p.pos[y] % RATIO == RATIO - 1) {  // (padding, p < 0, completes none)
    compress_row<WIDTH, RATIO, LN, true>(p, y);
  }
}

// The first of rows b .. end - 1 that completes a group or is padding (end if none): the rows
// before it only join the state. Every warp finds the same one.
template <int RATIO>
DSUF_DEVICE int next_entry_row(const int* pos, int b, int end) {
  for (int base = b; base < end; base += 32) {
    const int r = base + (threadIdx.x & 31);
    const int q = r < end ? pos[r] : 0;
    const u32 m = __ballot_sync(0xffffffffu, r < end && (q < 0 || q % RATIO == RATIO - 1));
    if (m) return base + __ffs(m) - 1;
  }
  return end;
}

// A cluster's rows in order: rows of one sequence (one state) must join it in position order. The
// rows between two that complete a group write only their own state rows (a run's positions are
// consecutive: no two of them share one), so they go at once, a row for every 16 threads a half
// (compress_row's first branch, spread over the CTA); a row that completes a group waits for
// them, and the rows after it for its state moves.
template <int WIDTH, int RATIO, int LN>
DSUF_DEVICE void compress_step(const CompressParams& p) {
  constexpr int C = RATIO == 4 ? 2 * WIDTH : WIDTH, CUR = RATIO == 4 ? RATIO : 0, PER_ROW = 16 * (C / WIDTH), NT = 16 * LN;
  const int first = p.runs ? p.runs[blockIdx.y] : (int)blockIdx.y;
  const int end = p.runs ? p.runs[blockIdx.y + 1] : (int)blockIdx.y + 1;
  const int col = (threadIdx.x % PER_ROW) / 16 * WIDTH + blockIdx.x * CH + 4 * (threadIdx.x & 15);
  for (int b = first; b < end;) {
    const int stop = next_entry_row<RATIO>(p.pos, b, end);
    for (int r = b + (int)threadIdx.x / PER_ROW; r < stop; r += NT / PER_ROW)
      join_state<RATIO, C, CUR>(p, r, p.pos[r], p.state_row ? p.state_row[r] : (i64)r, col);
    if (stop == end) break;
    __syncthreads();  // the group's state rows, written by other threads, before it is pooled
    compress_row<WIDTH, RATIO, LN, false>(p, stop);
    __syncthreads();  // its state moves before the next rows' writes
    b = stop + 1;
  }
}

// Each compressor's decode kernel NAME and prompt-chunk kernel NAME_chunk (apart, so that the
// decode kernel's code is not the chunk's too).
#define COMPRESSOR_KERNELS(NAME, WIDTH, RATIO, LN)                                                                              \
  extern "C" __global__ void __cluster_dims__(WIDTH / CH, 1, 1) __launch_bounds__(16 * LN) NAME(const __grid_constant__ CompressParams p) { \
    pdl_begin();                                                                                                                 \
    compress_step<WIDTH, RATIO, LN>(p);                                                                                          \
  }                                                                                                                              \
  extern "C" __global__ void __cluster_dims__(WIDTH / CH, 1, 1) __launch_bounds__(16 * LN)                                       \
      NAME##_chunk(const __grid_constant__ CompressParams p) {                                                                   \
    pdl_begin();                                                                                                                 \
    compress_chunk_pass<WIDTH, RATIO, LN>(p);                                                                                    \
  }

COMPRESSOR_KERNELS(compress_csa, 512, 4, 8)
COMPRESSOR_KERNELS(compress_hca, 512, 128, 16)
COMPRESSOR_KERNELS(compress_index, 128, 4, 8)
