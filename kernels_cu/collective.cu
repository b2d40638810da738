// Low-latency collectives among the tensor-parallel ranks of one host, over CUDA IPC peer memory
// (NVLink): one kernel launch each, no NCCL, capturable in CUDA graphs.
//
// Every rank owns an inbox (two slots, each with a region per sender rank) and a flag array, both
// mapped into every rank's address space. A call (every call launches exactly CTAS CTAs on every
// rank) goes:
//   1. CTA b pushes its share [lo, hi) of the input into this call's slot, its own region, of
//      every rank's inbox (its own included): stores over NVLink, which do not wait for a reply;
//   2. the CTAs b of all ranks meet: each stores the call's epoch into every rank's flag (b, me)
//      with release semantics (after its pushes), then waits until its own flags (b, r) reach the
//      epoch (acquire): every rank's share has then landed in its own inbox;
//   3. CTA b reads share [lo, hi) of every sender's region of its own inbox (local memory), in
//      rank order, and writes the output.
// Pushing instead of reading the peers' buffers saves a round trip over NVLink per call. A CTA
// only reads what the same-numbered CTAs of the peers wrote, so a per-CTA meeting suffices.
// Slots alternate by call: a rank pushes into slot s again two calls later, and by then every
// peer has met it in the call between, so its reads of slot s are over (kernels of a rank run in
// stream order). Epochs are per-CTA counters in device memory, so replays of a captured
// graph keep counting. Sums are taken in rank order, so every rank gets the same bits (ranks keep
// replicated state, e.g. KV caches and expert routing, that must not drift apart).
#include "mhc.cuh"

#define MAX_RANKS 8
#define CTAS 32
#define THREADS 512
#define TIMEOUT_NS 60000000000ull  // a peer that never arrives (it died) ends in a trap, not a hang

struct Peers {
  u8* staging[MAX_RANKS];  // rank r's inbox (slot s, sender q at (s * world + q) * slot_bytes), mapped here
  u32* flags[MAX_RANKS];   // rank r's flags [CTAS][MAX_RANKS], mapped here
  u32* epoch;              // this rank's per-CTA call counters [CTAS]
  i64 slot_bytes;
  int rank;
  int world;
};

struct CollParams {
  Peers peers;
  const void* in;
  void* out;
  i64 n;     // all_reduce_bf16: elements (a multiple of 8); all_gather_f32: floats a rank gives per row (a multiple of 4)
  int rows;  // all_gather_f32: rows
  // all_reduce_expand_bf16: the mHC update that follows (hc_expand8) of streams x [T, 4, dim]
  // with post [T, 4] and comb [T, 4, 4] into y [T, 4, dim]; in / out are [T, dim].
  const u16* x;
  const float* post;
  const float* comb;
  u16* y;
  int dim;
};

DSUF_DEVICE u32 ld_acquire_sys(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

DSUF_DEVICE void st_release_sys(u32* p, u32 v) { asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory"); }

DSUF_DEVICE uint4 ld_volatile_u4(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

DSUF_DEVICE u64 global_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The call's epoch for this CTA (1, 2, ... per CTA; shared by all its threads).
DSUF_DEVICE u32 begin_call(const Peers& P) {
  __shared__ u32 epoch;
  if (threadIdx.x == 0) epoch = P.epoch[blockIdx.x] + 1;
  __syncthreads();
  return epoch;
}

DSUF_DEVICE void end_call(const Peers& P, u32 epoch) {
  if (threadIdx.x == 0) P.epoch[blockIdx.x] = epoch;
}

// CTA b of every rank has written its share of its staging slot.
DSUF_DEVICE void meet(const Peers& P, u32 epoch) {
  __syncthreads();
  const int r = threadIdx.x;
  if (r < P.world) {
    __threadfence_system();
    st_release_sys(P.flags[r] + blockIdx.x * MAX_RANKS + P.rank, epoch);
    const u32* mine = P.flags[P.rank] + blockIdx.x * MAX_RANKS + r;
    const u64 start = global_ns();
    while ((int)(ld_acquire_sys(mine) - epoch) < 0) {
      if (global_ns() - start > TIMEOUT_NS) __trap();
    }
  }
  __syncthreads();
}

// This CTA's share [lo, hi) of n items.
DSUF_DEVICE void share(i64 n, i64& lo, i64& hi) {
  const i64 per = (n + CTAS - 1) / CTAS;
  lo = blockIdx.x * per;
  hi = lo + per < n ? lo + per : n;
}

// Sender q's region of this call's slot in rank r's inbox.
DSUF_DEVICE u8* region(const Peers& P, int r, int q, u32 epoch) { return P.staging[r] + ((epoch & 1) * P.world + q) * P.slot_bytes; }

DSUF_DEVICE void stage_in(const Peers& P, u32 epoch, const uint4* in, i64 lo, i64 hi) {
  for (i64 i = lo + threadIdx.x; i < hi; i += THREADS) {
    const uint4 v = in[i];
    for (int r = 0; r < P.world; ++r) reinterpret_cast<uint4*>(region(P, r, P.rank, epoch))[i] = v;
  }
}

// Steps 1 and 2 of a call whose input is `vecs` 16-byte vectors: this CTA's share [lo, hi) pushed,
// the ranks met. Returns the call's epoch.
DSUF_DEVICE u32 stage_and_meet(const Peers& P, const void* in, i64 vecs, i64& lo, i64& hi) {
  const u32 epoch = begin_call(P);
  share(vecs, lo, hi);
  stage_in(P, epoch, reinterpret_cast<const uint4*>(in), lo, hi);
  meet(P, epoch);
  return epoch;
}

// What rank r pushed this call: its region of this rank's own inbox.
DSUF_DEVICE const u8* slot_of(const Peers& P, int r, u32 epoch) { return region(P, P.rank, r, epoch); }

// The rank-ordered float32 sum of vector i (8 bf16) of every rank's staged input, each element
// rounded to bf16 (returned as floats) and stored to out.
DSUF_DEVICE void sum8(const Peers& P, u32 epoch, i64 i, uint4* out, float o[8]) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int r = 0; r < P.world; ++r) {
    const uint4 v = ld_volatile_u4(slot_of(P, r, epoch) + i * 16);
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      acc[2 * k] += bf16_to_f32(w[k] & 0xffff);
      acc[2 * k + 1] += bf16_to_f32(w[k] >> 16);
    }
  }
  u32 packed[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    packed[k] = f32_to_bf16(acc[2 * k]) | ((u32)f32_to_bf16(acc[2 * k + 1]) << 16);
    o[2 * k] = bf16_to_f32(packed[k] & 0xffff);
    o[2 * k + 1] = bf16_to_f32(packed[k] >> 16);
  }
  out[i] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// out = the sum over ranks of in (bf16 [n]), accumulated in float32 in rank order, rounded once.
extern "C" __global__ void __launch_bounds__(THREADS) all_reduce_bf16(CollParams p) {
  pdl_begin();
  const Peers& P = p.peers;
  i64 lo, hi;
  const u32 epoch = stage_and_meet(P, p.in, p.n / 8, lo, hi);
  float o[8];
  for (i64 i = lo + threadIdx.x; i < hi; i += THREADS) sum8(P, epoch, i, reinterpret_cast<uint4*>(p.out), o);
  end_call(P, epoch);
}

// all_reduce_bf16 of a sublayer's partial outputs [T, dim], then the mHC stream update with the
// sum (hc_expand's, bit for bit): one kernel where the two would be two.
extern "C" __global__ void __launch_bounds__(THREADS) all_reduce_expand_bf16(CollParams p) {
  pdl_begin();
  const Peers& P = p.peers;
  i64 lo, hi;
  const u32 epoch = stage_and_meet(P, p.in, p.n / 8, lo, hi);
  float o[8];
  for (i64 i = lo + threadIdx.x; i < hi; i += THREADS) {
    sum8(P, epoch, i, reinterpret_cast<uint4*>(p.out), o);
    const i64 e = 8 * i;
    hc_expand8(o, p.x, p.post, p.comb, p.y, (int)(e / p.dim), (int)(e % p.dim), p.dim);
  }
  end_call(P, epoch);
}

// in float32 [rows, n] per rank -> out float32 [rows, world * n]: out[row, r * n + j] = rank r's in[row, j].
extern "C" __global__ void __launch_bounds__(THREADS) all_gather_f32(CollParams p) {
  pdl_begin();
  const Peers& P = p.peers;
  const i64 vecs = p.n / 4;  // 16-byte vectors per row a rank gives
  i64 lo, hi;
  const u32 epoch = stage_and_meet(P, p.in, p.rows * vecs, lo, hi);
  uint4* out = reinterpret_cast<uint4*>(p.out);
  for (i64 i = lo + threadIdx.x; i < hi; i += THREADS) {
    const i64 row = i / vecs, j = i % vecs;
    for (int r = 0; r < P.world; ++r) out[(row * P.world + r) * vecs + j] = ld_volatile_u4(slot_of(P, r, epoch) + i * 16);
  }
  end_call(P, epoch);
}
