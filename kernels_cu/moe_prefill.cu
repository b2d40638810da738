// A prompt chunk's routed experts straight from their FP4 weights (sm_90a): for the pairs sorted
// by expert, out[p, mat * N + n] = sum_k xq[x_row[p], k] sx[x_row[p], k/128] * W_mat[e_p][n, k]
// sw(n, k). The e2m1 codes become e4m3 in registers as in the decode kernels (gemm.cu), each
// 32-element block's codes further scaled exactly by a power of two relative to its 128-element
// chunk (PfRowScale), so that a chunk's four k-steps sum in the tensor cores (wgmma: about 12
// bits of the sum of |products|, as DeepSeek's FP8 GEMMs, which also promote every 128) and the
// chunk is promoted to fp32 once, with its rows' base scales and its pairs' activation scales.
// No bf16 copy of the experts is made.
//
// Two kernels. moe_prefill_images writes each tile's activations (up to 128 pairs of one expert,
// listed on the device by dsuf.gpu.moe.prefill_tiles; rows of 0 pairs after them are skipped)
// chunk by chunk as the images wgmma reads as B, so that the GEMM loads a chunk's B with one bulk
// copy. moe_prefill_fp4 is persistent: a CTA an SM claims items (tile, mat, 128-row block of N)
// in tile-major order from a counter as it goes, so that the CTAs running at once share few
// tiles' images and experts whatever each item costs, and its ring of chunks runs on from one
// item into the next: the next item's first chunks land while this one's last are summed and its
// outputs stored, and the ring fills once a CTA, not once an item. Two warpgroups take 64 rows each, m64n128k32 steps
// (m64n64k32, m64n32k32 or m64n16k32 for a tile of at most 64, 32 or 16 pairs). A warpgroup converts a chunk's A, runs its four
// steps back to back and promotes; ptxas would serialise wgmmas whose A registers other
// instructions write while they run, so the other warpgroup is what overlaps. A ring of PF_SLOTS
// slots holds chunks (the B image by a bulk copy, the 128 rows' FP4 weights by another: the kernel
// layout puts a tile's chunk in one 8 KB run; PF_SLOTS - 1 chunks ahead), so that no thread waits for global memory once the ring is full; with every
// fourth chunk come the rows' E8M0 scales of that chunk and the next three (a TMA box of 16 bytes
// a row, the narrowest there is) into PF_SCALE_SLOTS slots of their own.
//
// B image of a chunk (up to PF_IMAGE_BYTES) for a tile whose items take m64nNPk32 steps (NP =
// pf_width(pairs): 16, 32, 64 or 128 columns, the pairs then zeros): k-step s (of 4) at s * NP * 32;
// in it, for column group cg (8 pairs) and k half h, a core matrix of 8 pairs x 16 bytes at
// cg * 256 + h * 128 (descriptor LBO 128 for k, SBO 256 for columns). Within a k-step the k order
// is gemm.cu's: logical k 4t + b holds element 8t + 2b, 16 + 4t + b element 8t + 2b + 1 (half 0
// the even elements, half 1 the odd), matching the even and odd codes of the weight words. Then
// the NP columns' activation scales (float, times 64: undoing the e4m3 weight bytes' 2**-6), 0
// past the tile's pairs. A short prompt's tiles hold a few pairs each: their images are that much
// smaller (one bulk copy each, still).
#include "fp4.cuh"

#define PF_COLS 128                                // pairs a tile: wgmma's N
#define PF_STEP_BYTES (PF_COLS * 32)               // one k-step's B
#define PF_IMAGE_BYTES (4 * PF_STEP_BYTES + PF_COLS * 4)  // (the widest)
#define PF_ROWS 128                                // weight rows a CTA
#define PF_A_BYTES (PF_ROWS * 64)                  // their FP4 codes of one chunk
#define PF_SLOT_BYTES (PF_IMAGE_BYTES + PF_A_BYTES)
#define PF_SLOTS 6
#define PF_SCALE_BYTES (PF_ROWS * 16)              // the rows' E8M0 scales of four chunks
#define PF_SCALE_SLOTS 3                           // enough: see PfRing::refill
#define PF_ITEM_SLOTS 2
#define PF_THREADS 288                             // 8 warps summing, then the warp that posts the copies

struct PrefillParams {
  TensorMap ws[2];     // the experts' E8M0 scales [E * N rows, K/32 bytes], boxes of 16 bytes x PF_ROWS; mat 1 (if any) writes columns N..2N-1
  const u8* w[2];      // FP4 experts [E * N rows, K/2 bytes] in kernel layout: a tile's chunk is PF_A_BYTES at (row / PF_ROWS * K/128 + chunk) * PF_A_BYTES
  const u8* images;    // [tiles, K/128, PF_IMAGE_BYTES] (moe_prefill_images)
  const int* tiles;    // [tiles, 3]: expert, first pair, pairs (1..PF_COLS; 0: no tile, and none after it)
  void* out;           // [P, out_cols], float32 if out_f32 else bf16
  int* claims;         // items claimed past the first gridDim.x: 0 at the start
  int N, K, out_cols, out_f32, mats, n_tiles;
};

// moe_prefill_images' and moe_prefill_fp4's tiles int32 [n_tiles, 3] (expert, first pair, pairs)
// from each expert's end among the pairs sorted by expert (ends, int64 [experts]): expert e's run
// in pieces of up to PF_COLS pairs, in expert order, then rows of no pairs. One CTA, a thread an
// expert (a power of two >= experts): each expert's tile count, their inclusive scan, then each
// expert's own tiles. One launch, where torch took some twenty small ones.
extern "C" __global__ void __launch_bounds__(1024) moe_prefill_tiles(const i64* ends, int* tiles, int experts, int n_tiles) {
  pdl_begin();
  __shared__ int scan[1024];
  const int e = threadIdx.x;
  const i64 start = e > 0 && e < experts ? ends[e - 1] : 0, end = e < experts ? ends[e] : 0;
  const int per = (int)((end - start + PF_COLS - 1) / PF_COLS);
  scan[e] = per;
  __syncthreads();
  for (int o = 1; o < blockDim.x; o <<= 1) {
    const int before = e >= o ? scan[e - o] : 0;
    __syncthreads();
    scan[e] += before;
    __syncthreads();
  }
  for (int j = 0, t = scan[e] - per; j < per; ++j, ++t) {
    const i64 first = start + (i64)j * PF_COLS;
    tiles[3 * t] = e, tiles[3 * t + 1] = (int)first, tiles[3 * t + 2] = (int)min((i64)PF_COLS, end - first);
  }
  for (int t = scan[blockDim.x - 1] + e; t < n_tiles; t += blockDim.x)
    tiles[3 * t] = experts - 1, tiles[3 * t + 1] = 0, tiles[3 * t + 2] = 0;
}

// The columns of a tile's wgmma steps (m64nNPk32) and image: the fewest of 16, 32, 64 and 128 that hold its pairs.
DSUF_DEVICE int pf_width(int pairs) { return pairs > 64 ? 128 : pairs > 32 ? 64 : pairs > 16 ? 32 : 16; }
DSUF_DEVICE int pf_image_bytes(int np) { return 4 * 32 * np + 4 * np; }

// grid (K/128, tiles), 4 * PF_COLS threads: thread (pair c, k-step s) writes its 32 bytes of the image.
extern "C" __global__ void __launch_bounds__(4 * PF_COLS) moe_prefill_images(const u8* xq, const float* sx, const int* x_row,
                                                                             const int* tiles, u8* images, int K) {
  pdl_begin();
  const int kc = blockIdx.x, KC = gridDim.x, pair0 = tiles[3 * blockIdx.y + 1], cols = tiles[3 * blockIdx.y + 2];
  if (cols <= 0) return;  // a row past the tiles (prefill_tiles: their count bound)
  const int c = threadIdx.x >> 2, s = threadIdx.x & 3, np = pf_width(cols);
  if (c >= np) return;
  const int row = c >= cols ? -1 : x_row ? x_row[pair0 + c] : pair0 + c;
  uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
  if (row >= 0) {
    const u8* src = xq + (i64)row * K + kc * 128 + 32 * s;
    lo = ld_nc16(src), hi = ld_nc16(src + 16);
  }
  u8* image = images + ((i64)blockIdx.y * KC + kc) * PF_IMAGE_BYTES;
  u8* at = image + s * 32 * np + (c >> 3) * 256 + (c & 7) * 16;
  *reinterpret_cast<uint4*>(at) = make_uint4(__byte_perm(lo.x, lo.y, 0x6420), __byte_perm(lo.z, lo.w, 0x6420),
                                             __byte_perm(hi.x, hi.y, 0x6420), __byte_perm(hi.z, hi.w, 0x6420));
  *reinterpret_cast<uint4*>(at + 128) = make_uint4(__byte_perm(lo.x, lo.y, 0x7531), __byte_perm(lo.z, lo.w, 0x7531),
                                                   __byte_perm(hi.x, hi.y, 0x7531), __byte_perm(hi.z, hi.w, 0x7531));
  if (s == 0) reinterpret_cast<float*>(image + 4 * 32 * np)[c] = row >= 0 ? 64.0f * sx[(i64)row * (K >> 7) + kc] : 0.0f;
}

// An item: tile (expert, first pair, pairs; 0 pairs: no item), matrix and 128-row block of N.
struct PfItem {
  int tile, expert, pair0, cols, mat, rb;
};

// Item w of the launch's, tile-major (the tiles' rows of no pairs come last).
DSUF_DEVICE PfItem pf_item_at(const PrefillParams& p, int w) {
  const int blocks = p.N >> 7, tile = w / (p.mats * blocks);
  PfItem it{tile, 0, 0, 0, w % (p.mats * blocks) / blocks, w % blocks};
  if (tile < p.n_tiles) it.expert = p.tiles[3 * tile], it.pair0 = p.tiles[3 * tile + 1], it.cols = p.tiles[3 * tile + 2];
  return it;
}

// The ring over the CTA's chunks q = 0, 1, ... (the chunks of its items one after another: item i
// has q = i * KC..(i + 1) * KC - 1): chunk q's slot is full once its image and weight rows (and for
// q % 4 == 0 the scales of chunks q..q+3) have landed, empty once every warp is done with it.
// The producer (a warp of its own, so that no summing warp waits for a slot to empty) claims the
// items as it posts their first chunks, and writes each into one of PF_ITEM_SLOTS slots before
// that chunk's barrier completes; the CTA's last claim, past the
// items, completes the barrier with no copies, so that the warps find no item there and stop.
struct PfRing {
  u8* smem;
  u8* scales;  // PF_SCALE_SLOTS x [PF_ROWS][16]
  u64* full;
  u64* empty;
  PfItem* items;
  const PrefillParams* p;
  int claim;  // (the producer's) the next item: blockIdx.x first, then claimed one item ahead, hiding the atomic's latency
  bool done;  // (the producer's) past the CTA's last item

  // The producer's step q: chunk q + PF_SLOTS - 1 into the slot of chunk q - 1 once every summing
  // warp is done with that, if the CTA has it. Its scales' slot last held those of chunks up to
  // q + PF_SLOTS - 1 - 4 * PF_SCALE_SLOTS + 3 < q - 1, its item's slot the item read at chunk
  // q + PF_SLOTS - 1 - PF_ITEM_SLOTS * KC <= q - 1 (KC >= 4): done with too.
  DSUF_DEVICE void refill(int q) {
    if (done) return;
    const int KC = p->K >> 7, next = q + PF_SLOTS - 1, c = next % KC, slot = next % PF_SLOTS;
    if (q > 0) mbar_wait(&empty[(q - 1) % PF_SLOTS], ((q - 1) / PF_SLOTS) & 1);
    PfItem& it = items[next / KC % PF_ITEM_SLOTS];
    if (c == 0) {
      it = pf_item_at(*p, claim);
      claim = gridDim.x + atomicAdd(p->claims, 1);
      if (it.cols <= 0) {
        done = true;
        mbar_arrive(&full[slot]);
        return;
      }
    }
    u8* s = smem + slot * PF_SLOT_BYTES;
    const int row = it.expert * p->N + it.rb * PF_ROWS;
    const int image = pf_image_bytes(pf_width(it.cols));
    mbar_expect_bytes(&full[slot], image + PF_A_BYTES + (c % 4 ? 0 : PF_SCALE_BYTES));
    bulk_copy(s, p->images + ((i64)it.tile * KC + c) * PF_IMAGE_BYTES, image, &full[slot]);
    bulk_copy(s + PF_IMAGE_BYTES, p->w[it.mat] + ((i64)(row / PF_ROWS) * KC + c) * PF_A_BYTES, PF_A_BYTES, &full[slot]);
    if (c % 4 == 0) tma_copy_2d(scales + next / 4 % PF_SCALE_SLOTS * PF_SCALE_BYTES, &p->ws[it.mat], 4 * c, row, &full[slot]);
  }
};

// A lane's row of one chunk: its four k-steps' E8M0 scales e_i (bytes of s) relative to the
// chunk's base exponent m = max(min e, max e - 12): step i's e4m3 codes are scaled by 2**o_i,
// o_i = e_i - m in 0..12 (exact, by the conversion's table), so that the four steps sum in the
// tensor cores and the chunk is promoted once with 2**m. A step more than 12 below the row's
// largest has only zero codes (Fp4Experts checks that at load, else the experts take the bf16
// path): its o_i (clamped at 0) does not matter.
struct PfRowScale {
  u32 lo[4], hi[4];  // step i's table (fp4_e4m3_table of o_i)
  float base;        // 2**(m - 127)

  DSUF_DEVICE explicit PfRowScale(u32 s) {
    const int e0 = s & 0xff, e1 = (s >> 8) & 0xff, e2 = (s >> 16) & 0xff, e3 = s >> 24;
    const int m = max(min(min(e0, e1), min(e2, e3)), max(max(e0, e1), max(e2, e3)) - 12);
    fp4_e4m3_table(max(e0 - m, 0), lo[0], hi[0]), fp4_e4m3_table(max(e1 - m, 0), lo[1], hi[1]);
    fp4_e4m3_table(max(e2 - m, 0), lo[2], hi[2]), fp4_e4m3_table(max(e3 - m, 0), lo[3], hi[3]);
    base = __int_as_float(max(m << 23, 0x00400000));  // e8m0_to_f32 (code 0: 2**-127)
  }
  PfRowScale() = default;
};

// A warp's 16 rows' PfRowScales for a group of four chunks (whose scales come with its first),
// entry 16 j + r: chunk j of the group, row r. Its lanes build two entries each as the group
// starts; a quad's four lanes, which share their rows, would otherwise each build the same two
// rows' scales every chunk (more instructions than the chunk's conversion).
struct PfTables {
  uint4 lo[64], hi[64];
  float base[64];

  DSUF_DEVICE void build(const u8* scales, int lane) {
    __syncwarp();  // every lane done with the previous group's
#pragma unroll
    for (int e = lane; e < 64; e += 32) {
      const PfRowScale r(*reinterpret_cast<const u32*>(scales + (e & 15) * 16 + 4 * (e >> 4)));
      lo[e] = make_uint4(r.lo[0], r.lo[1], r.lo[2], r.lo[3]), hi[e] = make_uint4(r.hi[0], r.hi[1], r.hi[2], r.hi[3]), base[e] = r.base;
    }
    __syncwarp();
  }
  DSUF_DEVICE PfRowScale get(int e) const {
    PfRowScale r;
    const uint4 l = lo[e], h = hi[e];
    r.lo[0] = l.x, r.lo[1] = l.y, r.lo[2] = l.z, r.lo[3] = l.w, r.hi[0] = h.x, r.hi[1] = h.y, r.hi[2] = h.z, r.hi[3] = h.w;
    r.base = base[e];
    return r;
  }
};

// k-step I's A (rows g and g + 8 of the lane's weight words) as e4m3 scaled by its rows' 2**o.
template <int I>
DSUF_DEVICE void pf_convert(u32 (&a)[4], const uint4& w0, const uint4& w1, const PfRowScale& r0, const PfRowScale& r1) {
  fp4_e4m3(word(w0, I), r0.lo[I], r0.hi[I], a[0], a[2]);
  fp4_e4m3(word(w1, I), r1.lo[I], r1.hi[I], a[1], a[3]);
}

template <bool ACC, int NP>
DSUF_DEVICE void pf_issue(float (&d)[NP / 2], const u32 (&a)[4], u64 desc) {
  if constexpr (NP == 128) {
    wgmma_e4m3_n128_issue<ACC>(d, a[0], a[1], a[2], a[3], desc);
  } else if constexpr (NP == 64) {
    wgmma_e4m3_n64_issue<ACC>(d, a[0], a[1], a[2], a[3], desc);
  } else if constexpr (NP == 32) {
    wgmma_e4m3_n32_issue<ACC>(d, a[0], a[1], a[2], a[3], desc);
  } else {
    wgmma_e4m3_n16_issue<ACC>(d, a[0], a[1], a[2], a[3], desc);
  }
}

// An item's GEMM over its tile's NP (16, 32, 64 or 128) first columns, its chunks the CTA's q0..q0 + KC - 1;
// acc[4j + q]: row r0 (q < 2) or r0 + 8, pair column 8j + 2t + (q & 1).
template <int NP>
DSUF_DEVICE void pf_gemm(const PrefillParams& p, const PfRing& ring, PfTables& tables, const PfItem& it, int q0, int r0) {
  const int KC = p.K >> 7, t = threadIdx.x & 3, g = (threadIdx.x & 31) >> 2;
  constexpr u64 STEP = 32 * NP >> 4;  // the descriptor's address counts 16 bytes
  float acc[NP / 2], d[NP / 2];
#pragma unroll
  for (int j = 0; j < NP / 2; ++j) acc[j] = 0.0f, d[j] = 0.0f;
  // No CTA-wide barrier in the loop: a warpgroup waiting for its wgmmas lets the other run.
  for (int c = 0; c < KC; ++c) {
    const int q = q0 + c;
    const u8* slot = ring.smem + (q % PF_SLOTS) * PF_SLOT_BYTES;
    mbar_wait(&ring.full[q % PF_SLOTS], (q / PF_SLOTS) & 1);
    const uint4 w0 = *reinterpret_cast<const uint4*>(slot + PF_IMAGE_BYTES + r0 * 64 + 16 * t);
    const uint4 w1 = *reinterpret_cast<const uint4*>(slot + PF_IMAGE_BYTES + (r0 + 8) * 64 + 16 * t);
    if (q % 4 == 0) tables.build(ring.scales + q / 4 % PF_SCALE_SLOTS * PF_SCALE_BYTES + (r0 - g) * 16, threadIdx.x & 31);
    const PfRowScale sc0 = tables.get(q % 4 * 16 + g), sc1 = tables.get(q % 4 * 16 + g + 8);
    // All four steps' A first: ptxas runs the wgmmas back to back only if no other instruction
    // writes their registers between the first and the wait.
    u32 a0[4], a1[4], a2[4], a3[4];
    pf_convert<0>(a0, w0, w1, sc0, sc1), pf_convert<1>(a1, w0, w1, sc0, sc1);
    pf_convert<2>(a2, w0, w1, sc0, sc1), pf_convert<3>(a3, w0, w1, sc0, sc1);
    const u64 desc = wgmma_desc(slot, 128, 256);
    wgmma_fence();
    pf_issue<false, NP>(d, a0, desc);
    pf_issue<true, NP>(d, a1, desc + STEP);
    pf_issue<true, NP>(d, a2, desc + 2 * STEP);
    pf_issue<true, NP>(d, a3, desc + 3 * STEP);
    wgmma_commit();
    wgmma_wait_for<0>();
    pin(d);
#pragma unroll
    for (int i = 0; i < 4; ++i) pin(a0[i]), pin(a1[i]), pin(a2[i]), pin(a3[i]);
    const float* xsc = reinterpret_cast<const float*>(slot + 4 * 32 * NP);  // the chunk's activation scales
#pragma unroll
    for (int j = 0; j < NP / 8; ++j) {
      const float2 sc = *reinterpret_cast<const float2*>(xsc + 8 * j + 2 * t);
      acc[4 * j] = fmaf(d[4 * j], sc0.base * sc.x, acc[4 * j]);
      acc[4 * j + 1] = fmaf(d[4 * j + 1], sc0.base * sc.y, acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(d[4 * j + 2], sc1.base * sc.x, acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(d[4 * j + 3], sc1.base * sc.y, acc[4 * j + 3]);
    }
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(&ring.empty[q % PF_SLOTS]);
  }
  const int n0 = it.mat * p.N + it.rb * PF_ROWS + r0;
#pragma unroll
  for (int j = 0; j < NP / 8; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int c = 8 * j + 2 * t + (q & 1), n = n0 + 8 * (q >> 1);
      if (c >= it.cols) continue;
      const i64 at = (i64)(it.pair0 + c) * p.out_cols + n;
      if (p.out_f32) {
        static_cast<float*>(p.out)[at] = acc[4 * j + q];
      } else {
        static_cast<u16*>(p.out)[at] = f32_to_bf16(acc[4 * j + q]);
      }
    }
}

// Dynamic shared memory: PF_SLOTS slots, then PF_SCALE_SLOTS of weight scales.
extern "C" __global__ void __launch_bounds__(PF_THREADS, 1) moe_prefill_fp4(const __grid_constant__ PrefillParams p) {
  extern __shared__ __align__(128) u8 smem[];
  __shared__ __align__(8) u64 bars[2 * PF_SLOTS];
  __shared__ PfItem items[PF_ITEM_SLOTS];
  __shared__ PfTables tables[8];
  const int KC = p.K >> 7, warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int r0 = 64 * (warp >> 2) + 16 * (warp & 3) + g;  // this lane's rows r0 and r0 + 8 of the CTA's
  if (threadIdx.x == 0) mbar_init(bars, PF_SLOTS), mbar_init(bars + PF_SLOTS, PF_SLOTS, 8);
  __syncthreads();
  pdl_begin();  // (the tiles, images and claim counter are made just before)
  PfRing ring{smem, smem + PF_SLOTS * PF_SLOT_BYTES, bars, bars + PF_SLOTS, items, &p, (int)blockIdx.x, false};
  if (warp == 8) {  // the producer: chunks 0..PF_SLOTS - 2, then one as each is done with
    if (threadIdx.x == 256)
      for (int q = 1 - PF_SLOTS; !ring.done; ++q) ring.refill(q);
    return;
  }
  for (int i = 0;; ++i) {
    mbar_wait(&ring.full[i * KC % PF_SLOTS], (i * KC / PF_SLOTS) & 1);
    const PfItem it = items[i % PF_ITEM_SLOTS];
    if (it.cols <= 0) break;
    switch (pf_width(it.cols)) {  // (a short prompt's tiles hold a few pairs of their expert: no wider steps than they need)
      case 128: pf_gemm<128>(p, ring, tables[warp], it, i * KC, r0); break;
      case 64: pf_gemm<64>(p, ring, tables[warp], it, i * KC, r0); break;
      case 32: pf_gemm<32>(p, ring, tables[warp], it, i * KC, r0); break;
      default: pf_gemm<16>(p, ring, tables[warp], it, i * KC, r0);
    }
  }
}
