"""The MoE layer on the GPU: routed FP4 experts plus the FP8 shared expert, computed as `layers.MoE`
computes them in reference numerics (routing is the router's).

Decode-sized batches (below PREFILL_MIN_TOKENS tokens where the FP4 prefill GEMM runs, else below
GROUPED_MIN_TOKENS) run in the kernels described here; prompt chunks (`Moe._grouped`) run the
routed experts as one GEMM a matrix over all pairs, straight from the FP4 weights on sm_90a
(kernels_cu/moe_prefill.cu, when every 128-element chunk's block scales fit:
Fp4Experts.chunks_fit), else as grouped bf16 GEMMs over a bf16 copy of them made once a chunk;
and the shared expert as FP8 block-scaled GEMMs (`Fp8Expert.prefill`; dense.py).

For T tokens with top-k experts there are P = T*k (token, expert) pairs. Pairs are sorted by
expert, and each expert's weights are streamed once for all of its tokens (up to 8 a pass), so a
batch-1 decode step reads 6 routed experts (FP4, 12.75 MB each at V4-Flash shapes) and the shared
expert (FP8, 25 MB). The launches:

1. act_quant(x) -> e4m3 x and per-128 scales (shared by every expert; the layer's mHC norm
   already makes them in its own launch);
2. routed w1/w3 for all pairs, with clamp, silu(gate)*up, routing weight, bf16 rounding and w2's
   act_quant fused into the split-K epilogue; then routed w2 (bf16 [P, D]);
3. meanwhile, on a side stream, the same two steps for the shared expert (FP8, all tokens),
   which the decode layer queues as soon as the router's scores are made (shared_alongside);
4. the combine: per token, the routed outputs summed in ascending expert order, then the shared.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from .dense import act_fake_quant, fp4_weight_bf16, fp8_mm, mm_scale, swiglu, swiglu_fp8
from .linear import BLOCK, CTA_ROWS, MAX_TOKENS, GemmParams, act_quant, choose_splits, launch_fp8, scale_bytes, sm_count
from .peers import Peers
from .runtime import TensorMap, device_arch, get_kernel, ptr, tensor_map_2d

FP4_BLOCK = 32  # elements per E8M0 scale of an FP4 expert weight
FP4_MAX_CHUNKS = 16  # 128-element K chunks one CTA of the FP4 kernels covers (gemm.cu)
# FP4 kernel variant "_PUbB" (P: the products by mma.sync "u" or by wgmma "g", sm_90a only; U
# chunks a pipeline stage, B CTAs an SM), or None: P as FP4_PRODUCTS says (None: wgmma on sm_90a),
# B by the number of pairs (H200: 3 CTAs an SM at batch 1, 4 at batch 8). FP4_SPLITS overrides
# split-K. For tools/gpu-check --fp4-sweep and the tests; every split gives the same bits.
FP4_PRODUCTS: str | None = None
FP4_VARIANT: str | None = None
FP4_SPLITS: int | None = None
PREFILL_WGMMA = True  # prompt chunks' routed experts by moe_prefill_fp4 on sm_90a (tests turn it off)
PREFILL_COLS = 128  # pairs a tile of moe_prefill_fp4 (PF_COLS in moe_prefill.cu)
PREFILL_IMAGE_BYTES = 4 * 32 * PREFILL_COLS + 4 * PREFILL_COLS  # a tile's activations of one 128-element chunk and their scales
PREFILL_THREADS = 288  # its CTA: 8 warps summing, one posting the copies (PF_THREADS)
PREFILL_SHARED_BYTES = 6 * (PREFILL_IMAGE_BYTES + 128 * 64) + 3 * 128 * 16  # its ring: PF_SLOTS chunks of B and of 128 weight rows, PF_SCALE_SLOTS of their scales
PREFILL_OCTAVES = 12  # moe_prefill_fp4 scales a chunk's four k-steps' e4m3 codes by up to 2**12 (PfRowScale)
GROUPED_MIN_TOKENS = 1024  # from here the experts' bf16 copy (read once) beats the FP4 kernels' passes of 8 tokens an expert
PREFILL_MIN_TOKENS = 256  # and from here moe_prefill_fp4 does, in step graphs too (BENCHMARKS milestone 34: from 128 it loses)
EXPERT_COPY_BYTES = 2 << 30  # the bf16 copy is made this many bytes of experts at a time


def permute_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint-layout packed FP4 [..., K/2] (int8/uint8) to the kernel layout (uint8): in every
    64-byte chunk (128 elements) the sixteen 4-byte words are transposed as a 4x4 matrix,
    new[16t + 4i + b] = old[16i + 4t + b], so one 16-byte load gives a lane the word of each of
    the chunk's four 32-element k-steps; then the bits of each word are placed so that the
    kernels turn it into e4m3 by two byte permutes of a table (kernels_cu/fp4.cuh: fp4_e4m3):
    of byte j's even element (low nibble) the magnitude goes to bits 4j..4j+2 and the sign to bit
    8j + 7, of its odd element the magnitude to bits 16 + 4j.. and the sign to bit 8j + 3."""
    u = packed.contiguous().view(torch.uint8)
    if u.shape[-1] % 64:
        raise ValueError(f"permute_fp4: packed rows must be a multiple of 64 bytes, got {u.shape[-1]}")
    chunks = u.reshape(*u.shape[:-1], u.shape[-1] // 64, 4, 4, 4)  # [..., chunk, i, t, b]
    old = chunks.transpose(-3, -2).long()
    even, odd = old & 0xF, old >> 4
    j = torch.arange(4, device=u.device)
    word = ((even & 7) << 4 * j) | ((even >> 3) << 8 * j + 7) | ((odd & 7) << 16 + 4 * j) | ((odd >> 3) << 8 * j + 3)
    word = word.sum(-1, keepdim=True)  # (the bit fields are disjoint)
    new = (word >> 8 * j) & 0xFF
    return new.to(torch.uint8).reshape(u.shape)


def fp4_kernel_layout(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint-layout packed FP4 [..., N, K/2] (N a multiple of CTA_ROWS) as the MoE kernels
    read it: every chunk permuted (permute_fp4), then each matrix's rows in tiles of CTA_ROWS whose
    chunks lie one after another: chunk c of tile j, its CTA_ROWS rows' 64 bytes 64 apart, at
    (j * K/128 + c) * 8 KB. So a kernel's chunk of a tile (moe_prefill_fp4's unit) is one
    contiguous read, and a warp's 16 rows of a chunk (the decode kernels') one 1 KB run, where rows
    of K/2 bytes gave 64-byte pieces K/2 apart. The same shape, the bytes in that order."""
    u = permute_fp4(packed)
    n, half = u.shape[-2:]
    if n % CTA_ROWS:
        raise ValueError(f"fp4_kernel_layout: rows must be a multiple of {CTA_ROWS}, got {n}")
    tiles = u.reshape(*u.shape[:-2], n // CTA_ROWS, CTA_ROWS, half // 64, 64)
    return tiles.transpose(-3, -2).contiguous().reshape(u.shape)


def chunk_exponents_fit(packed: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether moe_prefill_fp4 sums every 128-element chunk of these FP4 rows (checkpoint layout
    [..., K/2], E8M0 [..., K/32]) exactly in the tensor cores: each 32-element block more than
    PREFILL_OCTAVES below its chunk's largest scale has only zero codes (its e4m3 codes would need
    a smaller scale than the chunk's base)."""
    s = scales.contiguous().view(torch.uint8).reshape(*scales.shape[:-1], -1, 4).int()
    low = s < s.amax(-1, keepdim=True) - PREFILL_OCTAVES
    if not bool(low.any()):
        return True
    codes = packed.contiguous().view(torch.uint8).reshape(*packed.shape[:-1], -1, 4, 16)
    return not bool((low & ((codes & 0x77) != 0).any(-1)).any())


@dataclass
class Fp4Experts:
    """Routed experts stacked along dim 0: w1/w3 [E, I, D/2], w2 [E, D, I/2] in kernel layout
    (fp4_kernel_layout), scales [E, rows, K/32] as uint8 E8M0 codes; chunks_fit: whether every
    matrix's chunks fit moe_prefill_fp4 (chunk_exponents_fit)."""

    w1: torch.Tensor
    s1: torch.Tensor
    w3: torch.Tensor
    s3: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    chunks_fit: bool

    @staticmethod
    def from_checkpoint(w1, s1, w3, s3, w2, s2) -> "Fp4Experts":
        """From stacked checkpoint tensors (int8 packed FP4 [E, rows, K/2], E8M0 [E, rows, K/32])."""
        e, i, half_d = w1.shape
        d = 2 * half_d
        if w3.shape != w1.shape or tuple(w2.shape) != (e, d, i // 2):
            raise ValueError(f"Fp4Experts: shapes w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)} disagree")
        for name, s, rows, k in (("s1", s1, i, d), ("s3", s3, i, d), ("s2", s2, d, i)):
            if tuple(s.shape) != (e, rows, k // FP4_BLOCK):
                raise ValueError(f"Fp4Experts: {name} shape {tuple(s.shape)} != {(e, rows, k // FP4_BLOCK)}")
        if i % CTA_ROWS or d % CTA_ROWS:
            raise ValueError(f"Fp4Experts: dims must be multiples of {CTA_ROWS}, got I={i}, D={d}")
        return Fp4Experts(
            fp4_kernel_layout(w1), scale_bytes(s1), fp4_kernel_layout(w3), scale_bytes(s3), fp4_kernel_layout(w2), scale_bytes(s2),
            all(chunk_exponents_fit(w, s) for w, s in ((w1, s1), (w3, s3), (w2, s2))),
        )

    @property
    def dim(self) -> int:
        return self.w2.shape[1]

    @property
    def inter(self) -> int:
        return self.w1.shape[1]


def fp4_splits(pairs: int, n: int, k: int, mats: int, blocks: int, sms: int) -> int:
    """How many CTAs share the K range of an FP4 decode launch's output tile: `pairs` pairs of `mats`
    matrices of N x K, `blocks` CTAs an SM of `sms` (FP4_SPLITS overrides), and never fewer than a
    CTA's shared memory needs (at most FP4_MAX_CHUNKS 128-element chunks of activations a CTA)."""
    tiles = pairs * (n // CTA_ROWS) * mats
    # Once a CTA a tile gives every SM one, splitting K only adds the partial sums' round trips
    # (a TP=2 rank's w2 at batch 1: 192 tiles, 2 splits were 1.7 % of the step slower).
    splits = FP4_SPLITS or (1 if tiles >= sms else choose_splits(tiles, k // BLOCK, blocks * sms, n * 4 * mats * 2 * pairs, pairs * mats * n * k // 2))
    return max(splits, -(-(k // BLOCK) // FP4_MAX_CHUNKS))


def prefill_tiles(ends: torch.Tensor, pairs: int) -> torch.Tensor:
    """moe_prefill_fp4's tiles int32 [pairs // PREFILL_COLS + E, 3] (expert, first pair, pairs)
    from each expert's end among the pairs sorted by expert (int64 [E], on the device): expert e's
    run in pieces of up to PREFILL_COLS, in expert order, then rows of no pairs (the kernels skip
    them). Made on the device (moe_prefill_tiles), so that a prompt chunk's MoE never waits for the
    host: the row count bounds the tiles whatever the routing."""
    n_experts = ends.shape[0]
    if ends.dtype != torch.int64 or ends.dim() != 1 or not 1 <= n_experts <= 1024:
        raise ValueError(f"prefill_tiles: need int64 ends [1..1024 experts], got {ends.dtype} {tuple(ends.shape)}")
    tiles = torch.empty((pairs // PREFILL_COLS + n_experts, 3), dtype=torch.int32, device=ends.device)
    threads = max(32, 1 << (n_experts - 1).bit_length())
    get_kernel("moe_prefill", "moe_prefill_tiles", ends.device)(
        (1, 1, 1), threads, [ptr(ends.contiguous()), ptr(tiles), ctypes.c_int(n_experts), ctypes.c_int(tiles.shape[0])]
    )
    return tiles


def prefill_images(xq: torch.Tensor, sx: torch.Tensor, x_row: torch.Tensor | None, tiles: torch.Tensor) -> torch.Tensor:
    """The tiles' activations (e4m3 [rows, K] and their scales [rows, K/128]; pair p's row
    x_row[p], or p) as moe_prefill_fp4 reads them: uint8 [tiles, K/128, PREFILL_IMAGE_BYTES] (a
    tile of at most 16, 32 or 64 pairs fills only the start of its chunks' images)."""
    k = xq.shape[1]
    images = torch.empty((tiles.shape[0], k // 128, PREFILL_IMAGE_BYTES), dtype=torch.uint8, device=xq.device)
    get_kernel("moe_prefill", "moe_prefill_images", xq.device)(
        (k // 128, tiles.shape[0], 1), 4 * PREFILL_COLS, [ptr(xq), ptr(sx), ptr(x_row), ptr(tiles), ptr(images), ctypes.c_int(k)]
    )
    return images


class PrefillParams(ctypes.Structure):
    """Mirror of `struct PrefillParams` in kernels_cu/moe_prefill.cu."""

    _fields_ = [
        ("ws", TensorMap * 2),
        ("w", ctypes.c_void_p * 2),
        ("images", ctypes.c_void_p),
        ("tiles", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("claims", ctypes.c_void_p),
        ("N", ctypes.c_int),
        ("K", ctypes.c_int),
        ("out_cols", ctypes.c_int),
        ("out_f32", ctypes.c_int),
        ("mats", ctypes.c_int),
        ("n_tiles", ctypes.c_int),
        ("_pad", ctypes.c_byte * 56),  # to the C struct's size, a multiple of its 64-byte alignment
    ]


@dataclass
class Fp8Expert:
    """The shared expert in checkpoint layout: e4m3 w1/w3 [I, D], w2 [D, I], E8M0 [rows/128, K/128]."""

    w1: torch.Tensor
    s1: torch.Tensor
    w3: torch.Tensor
    s3: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor

    def __post_init__(self) -> None:
        # w1 and w3 (and their scales) are the halves of one matrix, which a prompt chunk's GEMM takes whole.
        inter = self.w1.shape[0]
        self.w13, self.s13 = torch.cat((self.w1, self.w3)), torch.cat((scale_bytes(self.s1), scale_bytes(self.s3)))
        self.w1, self.w3 = self.w13[:inter], self.w13[inter:]
        self.s1, self.s3 = self.s13[: inter // BLOCK], self.s13[inter // BLOCK :]
        self.s2, self.w2 = scale_bytes(self.s2), self.w2.contiguous()

    @functools.cached_property
    def mm_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """s13's and s2's scales as dense.fp8_mm takes them, made on first use."""
        return mm_scale(self.s13), mm_scale(self.s2)

    def prefill(self, xq: torch.Tensor, sx: torch.Tensor, limit: float) -> torch.Tensor:
        """A prompt chunk's output bf16 [T, D] from x's act_quant: FP8 block-scaled GEMMs
        (dense.fp8_mm), gate and up in float32 as the reference keeps them."""
        s13, s2 = self.mm_scales
        gate_up = fp8_mm(xq, sx, self.w13, self.s13, torch.float32, scale_f32=s13)
        return fp8_mm(*swiglu_fp8(gate_up, limit), self.w2, self.s2, scale_f32=s2)


class Moe:
    """y = Σ_routed + shared; `limit` is the SwiGLU clamp (swiglu_limit).

    The shared expert runs on a side stream, concurrently with the routed experts. Holds split-K
    arrival counters, so one instance must not run on two streams at once."""

    def __init__(self, routed: Fp4Experts, shared: Fp8Expert, limit: float) -> None:
        self.routed = routed
        self.shared = shared
        self.limit = float(limit)
        device = routed.w1.device
        self.counter = torch.zeros(0, dtype=torch.int32, device=device)  # routed launches
        rows = max(shared.w1.shape[0], shared.w2.shape[0])
        self.shared_counter = torch.zeros(rows // CTA_ROWS, dtype=torch.int32, device=device)
        self.prefill_claims = torch.zeros(1, dtype=torch.int32, device=device)  # moe_prefill_fp4's
        self.side: torch.cuda.Stream | None = None
        # Whether moe_prefill_fp4 can take these experts (decided once; PREFILL_WGMMA at each call).
        self.fp4_prefill = routed.chunks_fit and device.type == "cuda" and device_arch(device) == "sm_90a" and routed.inter % 512 == 0

    def reserve(self, pairs: int) -> None:
        """Size the routed launches' arrival counters for up to `pairs` (token, expert) pairs now:
        a CUDA graph captured before a larger batch must not keep a pointer to counters that the
        larger batch would reallocate."""
        rows = max(self.routed.w1.shape[1], self.routed.w2.shape[1])
        if self.counter.numel() < pairs * (rows // CTA_ROWS):
            self.counter = torch.zeros(pairs * (rows // CTA_ROWS), dtype=torch.int32, device=self.counter.device)

    def decodes(self, tokens: int) -> bool:
        """Whether a call on this many tokens runs the decode kernels (else the prompt chunk's path,
        which runs the shared expert itself)."""
        if self._prefill_fp4():  # (no host sync: a step graph may capture it)
            return tokens < PREFILL_MIN_TOKENS
        return tokens < GROUPED_MIN_TOKENS or torch.cuda.is_current_stream_capturing()  # (the bf16 path reads the experts' runs on the host)

    def shared_alongside(self, xq: torch.Tensor, sx: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The shared expert on every token (x FP8-quantised), queued on the side stream after what
        the current stream has queued: (its output bf16 [T, D], the event of its end), for __call__'s
        `shared`; it needs no routing, so it may start before the experts are chosen."""
        main = torch.cuda.current_stream(xq.device)
        if self.side is None:
            self.side = torch.cuda.Stream(xq.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            y_shared = self.shared_forward(xq, sx)
            done = torch.cuda.Event()
            done.record()
        for t in (xq, sx):
            t.record_stream(self.side)
        y_shared.record_stream(main)
        return y_shared, done

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None,
                 xq: tuple[torch.Tensor, torch.Tensor] | None = None, joins: tuple[torch.cuda.Event, ...] = (),
                 shared: tuple[torch.Tensor, torch.cuda.Event | None] | None = None, to: Peers | None = None) -> torch.Tensor:
        """x bf16 [T, D]; weights float32 [T, k] and idx [T, k] from the router -> bf16 [T, D].
        xq: x already FP8-quantised (act_quant's (e4m3, scales)), e.g. by the norm that made x.
        shared: the shared expert already queued by shared_alongside where `decodes` (its event
        None: joined already); else it is queued here, beside the routed experts. joins: events of
        other streams' work that the current stream joins where it joins the shared expert's, before
        the combine (a kernel launched after a join starts only once the joined work has ended).
        to: a tensor-parallel rank's peers (collective.sender), to whom the combine pushes the
        output as this rank's part of the all-reduce that follows."""
        t, k = idx.shape
        if not 1 <= k <= 16 or self.routed.dim % 2048:
            raise ValueError(f"Moe: top-k must be 1..16 and D a multiple of 2048, got k={k}, D={self.routed.dim}")
        main = torch.cuda.current_stream(x.device)
        if not self.decodes(t):
            y_sorted, row_of, y_shared = self._grouped(x, weights, idx, xq)
            for event in joins:
                main.wait_event(event)
            return self._combine(y_sorted, y_shared, idx, out, to, row_of)
        xq, sx = xq if xq is not None else act_quant(x)
        y_shared, shared_done = shared if shared is not None else self.shared_alongside(xq, sx)

        expert = idx.reshape(-1).to(torch.int32)
        # With several tokens, pairs sorted by expert let one item serve all tokens of an expert.
        order = torch.argsort(expert, stable=True).to(torch.int32) if t > 1 else None
        # One token's top-k are distinct experts: each pair is a launch item's only column.
        hq, sh = self.routed_gate_up(xq, sx, expert, weights.reshape(-1), k, order, distinct=t == 1)
        y_routed = self.routed_down(hq, sh, expert, order, distinct=t == 1)

        for event in (shared_done, *joins):
            if event is not None:
                main.wait_event(event)
        return self._combine(y_routed, y_shared, idx, out, to)

    def _combine(self, y_routed: torch.Tensor, y_shared: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None,
                 to: Peers | None, row_of: torch.Tensor | None = None) -> torch.Tensor:
        """Per token, its routed outputs (bf16 [T*k, D]: pair t*k + j at row row_of[pair], int32,
        or at row pair) summed in ascending expert order, then the shared expert's (bf16 [T, D])
        -> bf16 [T, D]."""
        t, k = idx.shape
        if out is None:
            out = torch.empty((t, self.routed.dim), dtype=torch.bfloat16, device=y_shared.device)
        expert = idx.reshape(-1).to(torch.int32)
        get_kernel("moe_combine", "moe_combine_bf16", y_shared.device)(
            (self.routed.dim // 2048, t, 1),
            256,
            [ptr(y_routed), ptr(row_of), ptr(y_shared), ptr(expert), ptr(out), ctypes.c_int(self.routed.dim), ctypes.c_int(k), to or Peers()],
        )
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                 xq: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A prompt chunk's (routed outputs sorted by expert, each pair's row among them, shared
        output), the outputs bf16. The routed experts by moe_prefill_fp4 straight from their FP4
        weights on sm_90a (PREFILL_WGMMA, chunks_fit), else by torch._grouped_mm over their bf16 copy made
        EXPERT_COPY_BYTES at a time; the shared expert through cuBLAS (Fp8Expert.prefill)."""
        t, k = idx.shape
        xq, sx = xq if xq is not None else act_quant(x)
        expert = idx.reshape(-1).long()
        # Sorted by the narrowest integers that hold the ids (the same stable order): torch's radix
        # sort takes a pass per byte of the key, and an int64 key's eight passes a layer showed in
        # the prompt chunk's profile (BENCHMARKS milestone 21: 301 gaps between them in 43 layers).
        narrow = torch.uint8 if self.routed.w1.shape[0] <= 256 else torch.int16
        order = torch.argsort(expert.to(narrow), stable=True)
        # Each expert's end among the sorted pairs, on the device (bincount would wait for the host).
        ends = torch.searchsorted(expert.index_select(0, order), torch.arange(self.routed.w1.shape[0], device=x.device), right=True)
        route_w = weights.reshape(-1).float().index_select(0, order)
        if self._prefill_fp4():
            y_sorted = self._routed_prefill(xq, sx, (order // k).int(), ends, route_w)
        else:
            y_sorted = self._routed_bf16(x, order // k, ends, route_w)
        row_of = torch.empty_like(order, dtype=torch.int32).index_copy_(0, order, torch.arange(t * k, dtype=torch.int32, device=x.device))
        return y_sorted, row_of, self.shared.prefill(xq, sx, self.limit)

    def _prefill_fp4(self) -> bool:
        """Whether a prompt chunk's routed experts run in moe_prefill_fp4 (else over their bf16 copy)."""
        return PREFILL_WGMMA and self.fp4_prefill

    def _routed_prefill(self, xq: torch.Tensor, sx: torch.Tensor, x_row: torch.Tensor, ends: torch.Tensor, route_w: torch.Tensor) -> torch.Tensor:
        """The sorted pairs' routed outputs bf16 [P, D] by moe_prefill_fp4: gate and up in float32
        (as the reference keeps them), the SwiGLU with the routing weight, h's act_quant, then w2."""
        r = self.routed
        pairs = len(route_w)
        tiles = prefill_tiles(ends, pairs)
        gate_up = torch.empty((pairs, 2 * r.inter), dtype=torch.float32, device=xq.device)
        self.prefill_gemm(((r.w1, r.s1), (r.w3, r.s3)), prefill_images(xq, sx, x_row, tiles), tiles, gate_up, self.prefill_claims)
        hq, sh = swiglu_fp8(gate_up, self.limit, route_w)
        y_sorted = torch.empty((pairs, r.dim), dtype=torch.bfloat16, device=xq.device)
        self.prefill_gemm(((r.w2, r.s2),), prefill_images(hq, sh, None, tiles), tiles, y_sorted, self.prefill_claims)
        return y_sorted

    @staticmethod
    def prefill_gemm(mats: tuple[tuple[torch.Tensor, torch.Tensor], ...], images: torch.Tensor, tiles: torch.Tensor, out: torch.Tensor,
                     claims: torch.Tensor, ctas: int | None = None) -> None:
        """out[:, i*N:(i+1)*N] = the tiles' pairs times FP4 matrix i of their expert (moe_prefill_fp4:
        persistent, `ctas` CTAs or one an SM claiming items of (tile, matrix, 128 rows of N) through
        `claims`, int32 [1], which it zeroes first)."""
        _, n, half = mats[0][0].shape
        k = 2 * half
        if n % 128 or k % 512:
            raise ValueError(f"moe_prefill_fp4: need N % 128 == 0 and K % 512 == 0, got N={n}, K={k}")
        p = PrefillParams()
        for i, (w, ws) in enumerate(mats):
            p.w[i], p.ws[i] = w.data_ptr(), tensor_map_2d(scale_bytes(ws), 16, 128)
        claims.zero_()
        p.images, p.tiles, p.out, p.claims = images.data_ptr(), tiles.data_ptr(), out.data_ptr(), claims.data_ptr()
        p.N, p.K, p.out_cols, p.out_f32 = n, k, out.shape[1], int(out.dtype == torch.float32)
        p.mats, p.n_tiles = len(mats), tiles.shape[0]
        items = tiles.shape[0] * len(mats) * n // 128  # (the tiles past the pairs have none)
        grid = min(items, ctas or sm_count(images.device))
        get_kernel("moe_prefill", "moe_prefill_fp4", images.device)((grid, 1, 1), PREFILL_THREADS, [p], shared=PREFILL_SHARED_BYTES)

    def _routed_bf16(self, x: torch.Tensor, x_row: torch.Tensor, ends: torch.Tensor, route_w: torch.Tensor) -> torch.Tensor:
        """The sorted pairs' routed outputs bf16 [P, D] by torch._grouped_mm over the experts' bf16
        copy (gate and up rounded to bf16 there, which the reference keeps in float32)."""
        r = self.routed
        bounds = [0] + ends.tolist()  # one host sync: the experts' runs, to slice them by group
        n_experts, inter, dim = r.w1.shape[0], r.inter, r.dim
        xs = act_fake_quant(x).index_select(0, x_row)
        y_sorted = torch.empty((len(route_w), dim), dtype=torch.bfloat16, device=x.device)
        group = max(1, EXPERT_COPY_BYTES // (3 * inter * dim * 2))
        for lo in range(0, n_experts, group):
            hi = min(n_experts, lo + group)
            a, b = bounds[lo], bounds[hi]
            if a == b:
                continue
            offs = (ends[lo:hi] - a).to(torch.int32)
            w13 = torch.empty((hi - lo, 2 * inter, dim), dtype=torch.bfloat16, device=x.device)
            fp4_weight_bf16(r.w1[lo:hi], r.s1[lo:hi], out=w13[:, :inter])
            fp4_weight_bf16(r.w3[lo:hi], r.s3[lo:hi], out=w13[:, inter:])
            gate_up = torch._grouped_mm(xs[a:b], w13.transpose(1, 2), offs=offs)
            del w13
            h = act_fake_quant(swiglu(gate_up, self.limit, route_w[a:b]))
            y_sorted[a:b] = torch._grouped_mm(h, fp4_weight_bf16(r.w2[lo:hi], r.s2[lo:hi]).transpose(1, 2), offs=offs)
        return y_sorted

    def routed_gate_up(
        self,
        xq: torch.Tensor,
        sx: torch.Tensor,
        expert: torch.Tensor,
        route_w: torch.Tensor,
        k: int,
        order: torch.Tensor | None = None,
        distinct: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs p = t*k + j: h = route_w[p] * silu(clamp(x_t W1ᵀ)) * clamp(x_t W3ᵀ), rounded to bf16
        and act-quantised: (e4m3 [P, I], float32 scales [P, I/128]). `order`: the pairs sorted by
        expert (int32), so that pairs of one expert share its weight reads; None: as given.
        `distinct`: the caller knows that no two consecutive pairs (in `order`) share an expert
        (one token's top-k), so the kernel need not look for runs of one expert."""
        pairs = expert.numel()
        hq = torch.empty((pairs, self.routed.inter), dtype=torch.float8_e4m3fn, device=xq.device)
        sh = torch.empty((pairs, self.routed.inter // BLOCK), dtype=torch.float32, device=xq.device)
        r = self.routed
        self._launch("fp4_swiglu_pairs", (r.w1, r.s1), (r.w3, r.s3), expert, order, k, route_w.float().contiguous(), xq, sx, hq, sh, distinct)
        return hq, sh

    def routed_down(
        self, hq: torch.Tensor, sh: torch.Tensor, expert: torch.Tensor, order: torch.Tensor | None = None, out: torch.Tensor | None = None,
        distinct: bool = False,
    ) -> torch.Tensor:
        """Each pair's w2 on its own h row: bf16 [P, D] (rounded per expert, as the reference);
        `order` and `distinct` as for routed_gate_up. The kernel reads expert and order before its
        PDL wait (gemm.cu), so neither may be made by the launch just before it (the gate/up's
        are the router's, two launches back)."""
        y = out if out is not None else torch.empty((expert.numel(), self.routed.dim), dtype=torch.bfloat16, device=hq.device)
        self._launch("fp4_gemm_bf16_pairs", (self.routed.w2, self.routed.s2), None, expert, order, 1, None, hq, sh, y, None, distinct)
        return y

    def shared_forward(self, xq: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        """The shared expert on every token: bf16 [T, D]."""
        s = self.shared
        t = xq.shape[0]
        inter, dim = s.w1.shape[0], s.w2.shape[0]
        hq = torch.empty((t, inter), dtype=torch.float8_e4m3fn, device=xq.device)
        sh = torch.empty((t, inter // BLOCK), dtype=torch.float32, device=xq.device)
        y = torch.empty((t, dim), dtype=torch.bfloat16, device=xq.device)
        for lo in range(0, t, MAX_TOKENS):
            hi = min(t, lo + MAX_TOKENS)
            launch_fp8(s.w1, s.s1, (s.w3, s.s3), xq[lo:hi], sx[lo:hi], hq[lo:hi], sh[lo:hi], self.shared_counter, self.limit)
            launch_fp8(s.w2, s.s2, None, hq[lo:hi], sh[lo:hi], y[lo:hi], None, self.shared_counter)
        return y

    def _launch(self, name, w, w_up, expert, order, x_div, route_w, xq, sx, out, out_scale, distinct) -> None:
        """One FP4 launch over the pairs: N rows of w per expert, K = xq's width; pair p reads
        activation row p // x_div and writes output row p; `distinct`: every pair its own column."""
        pairs = expert.numel()
        n, k = w[0].shape[1], xq.shape[1]
        mats = 2 if w_up is not None else 1
        tiles = pairs * (n // CTA_ROWS) * mats
        products = FP4_PRODUCTS or ("g" if device_arch(xq.device) == "sm_90a" else "u")
        variant = FP4_VARIANT or f"_{products}2b{3 if pairs <= 16 else 4}"
        blocks = int(variant.rsplit("b", 1)[1])
        splits = fp4_splits(pairs, n, k, mats, blocks, sm_count(xq.device))
        partial = torch.empty(tiles * splits * 8 * CTA_ROWS if mats * splits > 1 else 1, dtype=torch.float32, device=xq.device)
        if self.counter.numel() < pairs * (n // CTA_ROWS):  # zeroed once; every launch leaves it zero
            self.counter = torch.zeros(pairs * (n // CTA_ROWS), dtype=torch.int32, device=xq.device)
        p = GemmParams()
        p.w[0], p.ws[0] = w[0].data_ptr(), w[1].data_ptr()
        if w_up is not None:
            p.w[1], p.ws[1] = w_up[0].data_ptr(), w_up[1].data_ptr()
        p.expert = expert.data_ptr()
        p.order = order.data_ptr() if order is not None else 0
        p.xq, p.sx = xq.data_ptr(), sx.data_ptr()
        p.route_w = route_w.data_ptr() if route_w is not None else 0
        p.out = out.data_ptr()
        p.out_scale = out_scale.data_ptr() if out_scale is not None else 0
        p.partial, p.counter = partial.data_ptr(), self.counter.data_ptr()
        p.N, p.K, p.cols, p.splits, p.x_div, p.limit = n, k, int(distinct), splits, x_div, self.limit
        get_kernel("gemm", name + variant, xq.device)((n // CTA_ROWS, mats * splits, pairs), 256, [p])
