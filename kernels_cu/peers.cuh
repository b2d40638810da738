// The tensor-parallel ranks' inboxes as a kernel sees them (collective.cu's protocol): the
// collectives' own kernels push and read through these, and a producer whose output goes straight
// into an all-reduce pushes its vectors from its epilogue (`send_vec`), so that the all-reduce
// only waits for, sums and uses them.
#pragma once
#include "common.cuh"

#define MAX_RANKS 8
#define EMPTY 0x80008000u  // an inbox word not yet written (two bf16 -0.0)

struct Peers {
  u8* inbox[MAX_RANKS];  // rank r's inbox (slot s, sender q at (s * world + q) * slot_bytes), mapped here
  u32* epoch;            // this rank's per-CTA call counters (collective.cu's CTAS)
  i64 slot_bytes;
  int rank;
  int world;  // 0: nowhere to send (a producer's output not pushed)
};

DSUF_DEVICE void st_volatile_u4(void* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Sender q's region of call `epoch`'s slot in rank r's inbox.
DSUF_DEVICE u8* region(const Peers& P, int r, int q, u32 epoch) { return P.inbox[r] + ((epoch & 1) * P.world + q) * P.slot_bytes; }

// A vector as it is pushed: a word equal to EMPTY (two bf16 -0.0, or the float32 -2^-134) becomes
// 0x80000000 (bf16 +0.0 and -0.0: the same values; float32 -0.0). Every rank takes its own part
// so too, so that all compute on the same bits.
DSUF_DEVICE uint4 sendable(uint4 v) {
  v.x = v.x == EMPTY ? 0x80000000u : v.x;
  v.y = v.y == EMPTY ? 0x80000000u : v.y;
  v.z = v.z == EMPTY ? 0x80000000u : v.z;
  v.w = v.w == EMPTY ? 0x80000000u : v.w;
  return v;
}

// Vector i (16 bytes) of this rank's part of call `epoch`, pushed to every peer.
DSUF_DEVICE void push_vec(const Peers& P, u32 epoch, i64 i, uint4 v) {
  v = sendable(v);
  for (int r = 0; r < P.world; ++r)
    if (r != P.rank) st_volatile_u4(region(P, r, P.rank, epoch) + i * 16, v);
}

// From a producer: vector i of this rank's part of the collective's next call (every CTA of the
// collective's previous call has ended, so its epochs are that call's).
DSUF_DEVICE void send_vec(const Peers& P, i64 i, uint4 v) {
  if (P.world > 1) push_vec(P, P.epoch[0] + 1, i, v);
}
