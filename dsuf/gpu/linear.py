"""FP8 activation quantisation and block-scaled FP8 linears for decode-sized batches.

`Fp8Linear` computes what the reference `layers.Linear` does in reference numerics for an FP8
checkpoint weight: the input is FP8-quantised per row and 128-block (`quant.act_quant_fp8`),
multiplied by the e4m3 weight with its 128x128 E8M0 block scales, accumulated in fp32 and
rounded to bf16. Up to 8 tokens, where a CTA per 16-128 rows gives at most one CTA an SM and its
rows fit in shared memory, kernels_cu/fp8_rows.cu runs it (no split K); otherwise up to 32 tokens
go through one launch of kernels_cu/gemm.cu; larger batches are cut into 32-token slices, and
from dense.DENSE_MIN_ROWS rows (prompt chunks) the matmul runs on cuBLAS over a bf16 copy of the
weight (dense.py).
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable

import torch

from .dense import DENSE_MIN_ROWS, fp8_mm, mm_scale
from .runtime import device_arch, device_index, get_kernel, ptr

BLOCK = 128  # V4-Flash weight blocks and activation blocks
MAX_TOKENS = 32  # tokens per launch: 4 mma column tiles of 8
CTA_ROWS = 128  # output rows per CTA


ROWS_TOKENS = 8  # fp8_rows: tokens a launch
ROWS_SHARED_MAX = 224 << 10  # fp8_rows: a CTA's rows, its tokens' activations and scales, 8 KB of sums
ROWS_THREADS = 512  # fp8_rows: threads a CTA (16 warps: row groups x K shares)
GEMM_WGMMA = True  # the split-K FP8 GEMM: up to 8 tokens by wgmma on sm_90a (tests turn it off)
GEMM_WG_MAX_BLOCKS = 16  # ... a CTA covering at most this many K blocks (FP8_WG_MAX_KB in gemm.cu)


class RowsParams(ctypes.Structure):
    """Mirror of `struct RowsParams` in kernels_cu/fp8_rows.cu."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("ws", ctypes.c_void_p),
        ("xq", ctypes.c_void_p),
        ("sx", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("N", ctypes.c_int),
        ("K", ctypes.c_int),
        ("M", ctypes.c_int),
        ("R", ctypes.c_int),
    ]


def rows_shared_bytes(rows: int, k: int, m: int) -> int:
    """fp8_rows_m8's shared memory: its rows of e4m3 (K + 64 bytes each), m tokens' activations as
    f16 (2K bytes each), the K blocks' scales of 8 tokens (K / 4 bytes) and 8 KB of partial sums."""
    return rows * (k + 64) + m * 2 * k + k // 4 + 8192


def rows_per_cta(n: int, sms: int, shared_bytes: Callable[[int], int], divides: int | None = None) -> int | None:
    """fp8_rows' rows a CTA for n weight rows: the fewest (the most CTAs) that give at most one
    CTA an SM and fit in shared memory (shared_bytes(rows)), and divide `divides` if given; None
    where no choice does."""
    for rows in (16, 32, 64, 128):
        if n % rows == 0 and n // rows <= sms and shared_bytes(rows) <= ROWS_SHARED_MAX and (divides is None or divides % rows == 0):
            return rows
    return None


class GemmParams(ctypes.Structure):
    """Mirror of `struct GemmParams` in kernels_cu/gemm.cu (pointers first: no padding)."""

    _fields_ = [
        ("w", ctypes.c_void_p * 2),
        ("ws", ctypes.c_void_p * 2),
        ("expert", ctypes.c_void_p),
        ("order", ctypes.c_void_p),
        ("xq", ctypes.c_void_p),
        ("sx", ctypes.c_void_p),
        ("route_w", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("out_scale", ctypes.c_void_p),
        ("partial", ctypes.c_void_p),
        ("counter", ctypes.c_void_p),
        ("N", ctypes.c_int),
        ("K", ctypes.c_int),
        ("cols", ctypes.c_int),
        ("splits", ctypes.c_int),
        ("x_div", ctypes.c_int),
        ("limit", ctypes.c_float),
    ]


def sm_count(device: torch.device | None = None) -> int:
    return _sm_count(device_index(device))


@functools.cache
def _sm_count(index: int) -> int:  # asked at launches: torch's device query costs microseconds
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(tiles: int, k_blocks: int, sms: int, partial_bytes: int, weight_bytes: int) -> int:
    """How many CTAs share the K range of one output tile (split-K).

    Memory-bound: the aim is every SM streaming about the same number of bytes. With `tiles`
    output tiles and s splits there are tiles*s equal CTAs; the busiest SM runs ceil(tiles*s/sms)
    of them, so balance = (tiles*s/sms) / ceil(tiles*s/sms). Take the fewest splits whose balance
    is >= 0.85 with at least that share of the SMs busy. Splits cost partial-sum traffic
    (`partial_bytes` per split, written and read once), held to a quarter of the weight bytes.
    """
    cap = max(1, min(k_blocks, weight_bytes // max(1, 4 * partial_bytes)))
    best, best_balance = 1, 0.0
    for s in range(1, cap + 1):
        ctas = tiles * s
        balance = (ctas / sms) / math.ceil(ctas / sms)
        if balance >= 0.85 and ctas >= 0.85 * sms:
            return s
        if balance * min(1.0, ctas / sms) > best_balance:
            best, best_balance = s, balance * min(1.0, ctas / sms)
    return best


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [M, K] -> (e4m3 [M, K], float32 scales [M, K/128]): quant.act_quant_fp8's
    quantisation with the values and scales kept apart, as the FP8 GEMMs consume them."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"act_quant: need bf16 [M, K] with K % {BLOCK} == 0, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    rows, k = x.shape
    xq = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    sx = torch.empty((rows, k // BLOCK), dtype=torch.float32, device=x.device)
    warps = rows * (k // BLOCK)
    get_kernel("act_quant", "act_quant_bf16", x.device)(
        (math.ceil(warps / 8), 1, 1), 256, [ptr(x), ptr(xq), ptr(sx), ctypes.c_int(rows), ctypes.c_int(k)]
    )
    return xq, sx


def scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (float8_e8m0fnu or uint8) as contiguous uint8 codes."""
    if scale.element_size() != 1:
        raise TypeError(f"expected 1-byte E8M0 scales, got {scale.dtype}")
    return scale.contiguous().view(torch.uint8)


class Fp8Linear:
    """y = x Wᵀ for an FP8 weight e4m3 [N, K] with E8M0 scales [N/128, K/128] (checkpoint layout,
    N and K multiples of 128), matching `layers.Linear` in reference numerics.

    Holds a small arrival-counter buffer for split-K, so one instance must not run on two
    streams at once."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        n, k = weight.shape
        if weight.dtype != torch.float8_e4m3fn or n % BLOCK or k % BLOCK:
            raise ValueError(f"Fp8Linear: need float8_e4m3fn [N, K] in 128-multiples, got {weight.dtype} {tuple(weight.shape)}")
        if tuple(scale.shape) != (n // BLOCK, k // BLOCK):
            raise ValueError(f"Fp8Linear: scale shape {tuple(scale.shape)} != {(n // BLOCK, k // BLOCK)}")
        self.weight = weight.contiguous()
        self.scale = scale_bytes(scale)
        self.counter = torch.zeros(n // CTA_ROWS, dtype=torch.int32, device=weight.device)
        # fp8_rows' rows a CTA for m = 1..ROWS_TOKENS tokens (its shared memory grows with m), or
        # None: K too long for a thread a (K block, token) scale, or no choice fits.
        takes = k // BLOCK * ROWS_TOKENS <= ROWS_THREADS
        sms = sm_count(weight.device)
        self.rows = [rows_per_cta(n, sms, lambda r, m=m: rows_shared_bytes(r, k, m)) if takes else None for m in range(ROWS_TOKENS + 1)]

    @functools.cached_property
    def mm_scale(self) -> torch.Tensor:
        """The scales as a prompt chunk's cuBLAS GEMM takes them (dense.fp8_mm), made on first use."""
        return mm_scale(self.scale)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 [M, K] -> bf16 [M, N] (act-quantised input, as the reference). Where fp8_rows
        takes the shape, it quantises x itself (no act_quant launch before it)."""
        m = x.shape[0]
        if 0 < m <= ROWS_TOKENS and self.rows[m] is not None:
            if x.dtype != torch.bfloat16 or tuple(x.shape) != (m, self.in_features):
                raise ValueError(f"Fp8Linear: need bf16 [M, {self.in_features}], got {x.dtype} {tuple(x.shape)}")
            return self._rows("fp8_rows_quant_m8", x.contiguous(), None, out)
        xq, sx = act_quant(x)
        return self.forward_quantized(xq, sx, out)

    def _rows(self, kernel: str, x: torch.Tensor, sx: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        """One fp8_rows launch (fp8_rows_m8: x e4m3 with scales sx; fp8_rows_quant_m8: x bf16)."""
        m, (n, k) = x.shape[0], self.weight.shape
        if out is None:
            out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
        rows = self.rows[m]
        p = RowsParams(self.weight.data_ptr(), self.scale.data_ptr(), x.data_ptr(), sx.data_ptr() if sx is not None else 0, out.data_ptr(), n, k, m, rows)
        get_kernel("fp8_rows", kernel, x.device)((n // rows, 1, 1), ROWS_THREADS, [p], shared=rows_shared_bytes(rows, k, m))
        return out

    def forward_quantized(self, xq: torch.Tensor, sx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """From an act_quant result (shared by several linears of one input): bf16 [M, N]."""
        m = xq.shape[0]
        n = self.out_features
        if m >= DENSE_MIN_ROWS:
            y = fp8_mm(xq, sx, self.weight, self.scale, scale_f32=self.mm_scale)
            return out.copy_(y) if out is not None else y
        if m <= ROWS_TOKENS and self.rows[m] is not None:
            return self._rows("fp8_rows_m8", xq, sx, out)
        if out is None:
            out = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device)
        for lo in range(0, m, MAX_TOKENS):
            hi = min(m, lo + MAX_TOKENS)
            launch_fp8(self.weight, self.scale, None, xq[lo:hi], sx[lo:hi], out[lo:hi], None, self.counter)
        return out


def launch_fp8(
    w: torch.Tensor,
    ws: torch.Tensor,
    w_up: tuple[torch.Tensor, torch.Tensor] | None,
    xq: torch.Tensor,
    sx: torch.Tensor,
    out: torch.Tensor,
    out_scale: torch.Tensor | None,
    counter: torch.Tensor,
    limit: float = 0.0,
) -> None:
    """One launch of the FP8 GEMM for <= 32 tokens. With `w_up` (the up projection and its
    scales) it is the SwiGLU variant: `w` is the gate, `out` receives e4m3 h and `out_scale`
    its per-128 scales, ready for w2."""
    m, k = xq.shape
    n = w.shape[0]
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"launch_fp8: 1..{MAX_TOKENS} tokens per launch, got {m}")
    mats = 2 if w_up is not None else 1
    tiles = n // CTA_ROWS * mats
    cols = m
    mt = math.ceil(m / 8)
    splits = choose_splits(
        tiles, k // BLOCK, sm_count(w.device) * (2 if mt == 1 else 1), cols * n * 4 * mats * 2, n * k * mats
    )
    wg = GEMM_WGMMA and mt == 1 and device_arch(w.device) == "sm_90a"  # up to 8 tokens: products by wgmma
    if wg:
        splits = max(splits, -(-(k // BLOCK) // GEMM_WG_MAX_BLOCKS))
    partial = torch.empty(tiles * splits * 8 * mt * CTA_ROWS if mats * splits > 1 else 1, dtype=torch.float32, device=w.device)
    p = GemmParams()
    p.w[0], p.ws[0] = w.data_ptr(), ws.data_ptr()
    if w_up is not None:
        p.w[1], p.ws[1] = w_up[0].data_ptr(), w_up[1].data_ptr()
    p.xq, p.sx = xq.data_ptr(), sx.data_ptr()
    p.out = out.data_ptr()
    p.out_scale = out_scale.data_ptr() if out_scale is not None else 0
    p.partial, p.counter = partial.data_ptr(), counter.data_ptr()
    p.N, p.K, p.cols, p.splits, p.x_div, p.limit = n, k, cols, splits, 1, limit
    name = f"fp8_{'swiglu' if w_up is not None else 'gemm_bf16'}_{'wg_' if wg else ''}m{8 * mt}"
    get_kernel("gemm", name, w.device)((n // CTA_ROWS, mats * splits, 1), 256, [p])
