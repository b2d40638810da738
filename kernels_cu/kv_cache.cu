// V4-Flash KV-cache entries: the 584-byte format is described in cache_entries.cuh.
//
// kv_pack_fp8: x bf16 [rows, 512] (after kv_norm and RoPE) -> pool[slot[row]] (slot < 0: skipped;
// slots null: row i goes to entry i). One warp per row (cache_entries.cuh kv_entry_fp8).
#include "cache_entries.cuh"

extern "C" __global__ void __launch_bounds__(256) kv_pack_fp8(
    const u16* __restrict__ x, const int* __restrict__ slots, u8* __restrict__ pool, int rows) {
  pdl_begin();
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (row >= rows) return;  // whole warps leave together
  const int slot = slots ? slots[row] : row;
  if (slot < 0) return;
  kv_entry_fp8(x + (i64)row * 512, pool + (i64)slot * KV_ENTRY, lane);
}
