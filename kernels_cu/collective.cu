// Low-latency collectives among the tensor-parallel ranks of one host, over CUDA IPC peer memory
// (NVLink): one kernel launch each, no NCCL, capturable in CUDA graphs.
//
// Every rank owns an inbox (two slots, each with a region per sender rank) mapped into every
// rank's address space. An inbox word that holds EMPTY has not been written: the data carries its
// own arrival, so a call needs no flags and no fences (Lamport's trick, as low-latency all-reduces
// for small messages use it). A call goes:
//   1. CTA b pushes its share [lo, hi) of the input into this call's slot, its own region, of
//      every peer's inbox: stores over NVLink, which do not wait for a reply (or the kernel that
//      made the input pushed all of it as it wrote it: peers.cuh's send_vec, `pushed`);
//   2. it reads the same share of every peer's region of its own inbox, each 16-byte vector
//      until none of its words is EMPTY (a pushed word never is: `sendable`), and empties it
//      again; its own share it takes from its input. Sums are in rank order, so every rank gets
//      the same bits (ranks keep replicated state, e.g. KV caches and expert routing, that must
//      not drift apart).
// Slots alternate by call. A peer pushes into slot s again two calls later, which it starts only
// after its call between has received this rank's part of that call, which this rank pushed (in
// that call or in its producer) after its kernel of this call had ended (kernels of a rank run in
// stream order, each one's start waiting for its predecessor's end): by then the vectors read
// here are empty again. Every call launches exactly CTAS CTAs, each counting its calls in device
// memory (epochs), so all CTAs agree on the slot, and replays of a captured graph keep counting.
#include "mhc.cuh"
#include "peers.cuh"

#define CTAS 32
#define THREADS 128
#define TIMEOUT_NS 60000000000ull  // a peer that never arrives (it died) ends in a trap, not a hang

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
  int pushed;  // this rank's part already pushed by its producer (send_vec)
};

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

// The call's epoch for this CTA (1, 2, ... per CTA): every thread loads it, so that the load is in
// flight with the input's instead of before it.
DSUF_DEVICE u32 begin_call(const Peers& P) { return P.epoch[blockIdx.x] + 1; }

// Once every thread of the CTA has read the epoch, the next call's is stored.
DSUF_DEVICE void end_call(const Peers& P, u32 epoch) {
  __syncthreads();
  if (threadIdx.x == 0) P.epoch[blockIdx.x] = epoch;
}

// This CTA's share [lo, hi) of n items.
DSUF_DEVICE void share(i64 n, i64& lo, i64& hi) {
  const i64 per = (n + CTAS - 1) / CTAS;
  lo = blockIdx.x * per;
  hi = lo + per < n ? lo + per : n;
}

DSUF_DEVICE bool landed(uint4 v) { return v.x != EMPTY && v.y != EMPTY && v.z != EMPTY && v.w != EMPTY; }

// Step 1 of a call whose input is `vecs` 16-byte vectors: this CTA's share [lo, hi) pushed to every
// peer (unless its producer pushed it). Returns the call's epoch.
DSUF_DEVICE u32 push_share(const Peers& P, const void* in, i64 vecs, bool pushed, i64& lo, i64& hi) {
  const u32 epoch = begin_call(P);
  share(vecs, lo, hi);
  if (P.world > 1 && !pushed)
    for (i64 i = lo + threadIdx.x; i < hi; i += THREADS) push_vec(P, epoch, i, reinterpret_cast<const uint4*>(in)[i]);
  return epoch;
}

// Vector i of rank q's input this call: this rank's own from `in`; a peer's from its region of this
// rank's inbox, waited for, then emptied for the call after next.
DSUF_DEVICE uint4 part_of(const Peers& P, u32 epoch, int q, const void* in, i64 i) {
  if (q == P.rank) return sendable(reinterpret_cast<const uint4*>(in)[i]);
  uint4* at = reinterpret_cast<uint4*>(region(P, P.rank, q, epoch)) + i;
  uint4 v = ld_volatile_u4(at);
  if (!landed(v)) {
    const u64 start = global_ns();
    do {
      if (global_ns() - start > TIMEOUT_NS) __trap();
      v = ld_volatile_u4(at);
    } while (!landed(v));
  }
  *at = make_uint4(EMPTY, EMPTY, EMPTY, EMPTY);
  return v;
}

// The rank-ordered float32 sum of vector i (8 bf16) of every rank's input, each element rounded to
// bf16 (returned as floats) and stored to out.
DSUF_DEVICE void sum8(const Peers& P, u32 epoch, const void* in, i64 i, uint4* out, float o[8]) {
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int r = 0; r < P.world; ++r) {
    const uint4 v = part_of(P, epoch, r, in, i);
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
  const u32 epoch = push_share(P, p.in, p.n / 8, p.pushed, lo, hi);
  float o[8];
  for (i64 i = lo + threadIdx.x; i < hi; i += THREADS) sum8(P, epoch, p.in, i, reinterpret_cast<uint4*>(p.out), o);
  end_call(P, epoch);
}

// all_reduce_bf16 of a sublayer's partial outputs [T, dim], then the mHC stream update with the
// sum (hc_expand's, bit for bit): one kernel where the two would be two.
extern "C" __global__ void __launch_bounds__(THREADS) all_reduce_expand_bf16(CollParams p) {
  pdl_begin();
  const Peers& P = p.peers;
  i64 lo, hi;
  const u32 epoch = push_share(P, p.in, p.n / 8, p.pushed, lo, hi);
  float o[8];
  for (i64 i = lo + threadIdx.x; i < hi; i += THREADS) {
    sum8(P, epoch, p.in, i, reinterpret_cast<uint4*>(p.out), o);
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
  const u32 epoch = push_share(P, p.in, p.rows * vecs, p.pushed, lo, hi);
  uint4* out = reinterpret_cast<uint4*>(p.out);
  for (i64 i = lo + threadIdx.x; i < hi; i += THREADS) {
    const i64 row = i / vecs, j = i % vecs;
    for (int r = 0; r < P.world; ++r) out[(row * P.world + r) * vecs + j] = part_of(P, epoch, r, p.in, i);
  }
  end_call(P, epoch);
}
