"""Memory-bound GEMVs with bf16 activations for decode batches (kernels_cu/gemv.cu).

Two decode projections read a large weight for a few tokens, so their time is the weight's bytes
over HBM bandwidth:

- `bf16_gemv`: the compressors' bf16 projections of one token with float32 output, as the
  reference's `torch.mm(y, proj.t(), out_dtype=torch.float32)` (more tokens: cuBLAS).
- `fp8_grouped_gemv`: wo_a, read as FP8 (half the bytes of the bf16 weight the reference
  dequantises to) and turned into that exact bf16 weight in registers, then bf16 products with
  fp32 accumulation and a bf16 output, as the reference's grouped einsum.

Up to 64 tokens go through one launch (larger batches are cut into 64-token slices; prompt chunks
of dense.DENSE_MIN_ROWS rows and more run wo_a on cuBLAS over its bf16 copy). Up to 8 tokens,
where a CTA per 16-128 rows of wo_a gives at most one CTA an SM and the rows fit in shared memory
(a tensor-parallel rank's share), kernels_cu/fp8_rows.cu's fp8_rows_bf16x_m8 runs it instead:
each CTA's rows arrive in shared memory by bulk copy before the PDL wait, and no K is split. K is split
over the CTAs of a thread-block cluster, whose partial sums meet in distributed shared memory in a
fixed order: results are deterministic and a launch keeps no state (no scratch, no counters), so
any call may be captured in a CUDA graph.
"""

from __future__ import annotations

import ctypes

import torch

from .dense import DENSE_MIN_ROWS, fp8_weight_bf16
from .linear import BLOCK, ROWS_THREADS, ROWS_TOKENS, rows_per_cta, scale_bytes, sm_count
from .runtime import get_kernel

TILE = 64  # weight rows a CTA
MAX_TOKENS = 64  # tokens a launch (8 mma columns x 8)
SPLITS = (1, 2, 4, 8)  # CTAs of a cluster sharing a tile's K range (kernels _s1 .. _s8)
SHARED_MAX = 227 << 10  # dynamic shared memory a CTA may opt into on sm_90 / sm_100
BF16, FP8 = "bf16", "fp8"


class GemvParams(ctypes.Structure):
    """Mirror of `struct GemvParams` in kernels_cu/gemv.cu (pointers first: no padding)."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("ws", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("rows", ctypes.c_int),
        ("K", ctypes.c_int),
        ("M", ctypes.c_int),
        ("ldx", ctypes.c_int),
        ("group_rows", ctypes.c_int),
    ]


class RowsBf16Params(ctypes.Structure):
    """Mirror of `struct RowsBf16Params` in kernels_cu/fp8_rows.cu."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("ws", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("N", ctypes.c_int),
        ("K", ctypes.c_int),
        ("M", ctypes.c_int),
        ("R", ctypes.c_int),
        ("ldx", ctypes.c_int),
        ("group_rows", ctypes.c_int),
    ]


def rows_bf16x_shared_bytes(rows: int, k: int, m: int) -> int:
    """fp8_rows_bf16x_m8's shared memory: its rows of e4m3 (K + 64 bytes each), m token rows of
    bf16 (2K + 16 bytes each) and 8 KB of partial sums."""
    return rows * (k + 64) + m * (2 * k + 16) + 8192


def _tokens(m: int) -> int:
    """Token columns of the kernel serving m tokens: 8, 16, 32 or 64."""
    return next(t for t in (8, 16, 32, 64) if t >= m)


def shared_bytes(fmt: str, tokens: int, k: int, splits: int) -> int:
    """A CTA's shared memory: its x slice (rows padded as in the kernel's slice_stride) and, for
    FP8, the slice's block scales; later the partial sums [2, tokens, TILE] over the same bytes."""
    kc = k // splits
    stride = 2 * kc + (16 if fmt == FP8 else 64)
    slice_bytes = tokens * stride + (4 * (kc // BLOCK) if fmt == FP8 else 0)
    return max(slice_bytes, 2 * tokens * TILE * 4)


def resident_ctas(fmt: str, tokens: int, k: int, splits: int) -> int:
    """CTAs an SM holds at once: the kernels' launch bounds (MIN_CTAS in gemv.cu) and shared
    memory (228 KB an SM, 1 KB of it reserved per CTA)."""
    by_registers = 3 if fmt == BF16 and tokens == 8 else 2 if tokens <= 32 else 1
    return max(1, min(by_registers, (228 << 10) // (shared_bytes(fmt, tokens, k, splits) + (1 << 10))))


def choose_splits(fmt: str, tiles: int, k: int, tokens: int, device: torch.device) -> int:
    """The most K splits whose CTAs are all resident at once, among those that divide K into
    whole chunks and fit in shared memory. A CTA streams at a rate set by the bytes it keeps in
    flight, not by HBM (measured: ~14 GB/s a CTA at any grid size), so more CTAs finish sooner as
    long as none waits for a second wave."""
    align = 2 * (2 * BLOCK if fmt == FP8 else 32)  # two warps' K ranges of whole chunks / blocks
    valid = [s for s in SPLITS if k % (s * align) == 0 and shared_bytes(fmt, tokens, k, s) <= SHARED_MAX]
    if not valid:
        raise ValueError(f"gemv: K={k} must be a multiple of {align} (and fit a split in shared memory)")
    sms = sm_count(device)
    fits = [s for s in valid if tiles * s <= sms * resident_ctas(fmt, tokens, k, s)]
    return fits[-1] if fits else valid[0]


def _launch(fmt: str, w, ws, x, out, k: int, group_rows: int, splits: int | None) -> None:
    """One launch per MAX_TOKENS rows of x."""
    rows = w.shape[0]
    tiles = rows // TILE
    for lo in range(0, x.shape[0], MAX_TOKENS):
        xs, outs = x[lo : lo + MAX_TOKENS], out[lo : lo + MAX_TOKENS]
        m = xs.shape[0]
        tokens = _tokens(m)
        s = splits or choose_splits(fmt, tiles, k, tokens, w.device)
        p = GemvParams()
        p.w, p.ws, p.x, p.out = w.data_ptr(), ws.data_ptr() if ws is not None else 0, xs.data_ptr(), outs.data_ptr()
        p.rows, p.K, p.M, p.ldx, p.group_rows = rows, k, m, xs.stride(0), group_rows
        kernel = get_kernel("gemv", f"gemv_{fmt}_m{tokens}_s{s}", w.device)
        kernel((s, tiles, 1), 256, [p], shared=shared_bytes(fmt, tokens, k, s))


def _check_x(x: torch.Tensor, width: int, name: str) -> torch.Tensor:
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != width or x.shape[0] < 1:
        raise ValueError(f"{name}: x must be bf16 [M, {width}], got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    if x.data_ptr() % 16:
        raise ValueError(f"{name}: x must be 16-byte aligned")
    return x


def _output(out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype, device, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if out.dtype != dtype or tuple(out.shape) != shape or not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError(f"{name}: out must be contiguous, aligned {dtype} {shape}")
    return out


def bf16_gemv_takes(w: torch.Tensor) -> bool:
    """Whether bf16_gemv takes w: bf16 [N, K], N a multiple of 64 and K of 64."""
    return w.dtype == torch.bfloat16 and w.dim() == 2 and w.shape[0] % TILE == 0 and w.shape[1] % 64 == 0


def bf16_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """x bf16 [M, K] @ w bf16 [N, K]ᵀ -> float32 [M, N], fp32 accumulation. N a multiple of 64,
    K of 64 (1024 and up: of 64 * splits). `splits` forces the K split (1, 2, 4, 8), for tuning."""
    n, k = w.shape
    if not bf16_gemv_takes(w):
        raise ValueError(f"bf16_gemv: w must be bf16 [N, K] with N % {TILE} == 0 and K % 64 == 0, got {w.dtype} {tuple(w.shape)}")
    x = _check_x(x, k, "bf16_gemv")
    w = w.contiguous()
    m = x.shape[0]
    out = _output(out, (m, n), torch.float32, x.device, "bf16_gemv")
    _launch(BF16, w, None, x, out, k, n, splits)
    return out


def fp8_grouped_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    groups: int,
    out: torch.Tensor | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Grouped x @ dequant(w)ᵀ: x bf16 [M, G*K], w e4m3 [G*N, K] with E8M0 128x128 scales
    [G*N/128, K/128] (float8_e8m0fnu or uint8) -> bf16 [M, G*N], where group g gives
    out[:, g*N:(g+1)*N] = x[:, g*K:(g+1)*K] @ (w[g*N:(g+1)*N] * scale)ᵀ. N a multiple of 64 with
    G*N of 128, K a multiple of 256 (of 256 * splits; `splits` forces the cluster GEMV with that
    K split, for tuning and tests). bf16 products of the exactly dequantised
    weight, fp32 accumulation, one bf16 rounding: the reference's bf16 einsum."""
    rows, k = w.shape
    if w.dtype != torch.float8_e4m3fn or groups < 1 or rows % groups:
        raise ValueError(f"fp8_grouped_gemv: w must be float8_e4m3fn [G*N, K] for {groups} groups, got {w.dtype} {tuple(w.shape)}")
    n = rows // groups
    if n % TILE or rows % BLOCK or k % (2 * BLOCK):
        raise ValueError(f"fp8_grouped_gemv: need N % {TILE} == 0, G*N % {BLOCK} == 0 and K % {2 * BLOCK} == 0, got N={n}, K={k}")
    if tuple(scale.shape) != (rows // BLOCK, k // BLOCK):
        raise ValueError(f"fp8_grouped_gemv: scale shape {tuple(scale.shape)} != {(rows // BLOCK, k // BLOCK)}")
    x = _check_x(x, groups * k, "fp8_grouped_gemv")
    w, ws = w.contiguous(), scale_bytes(scale)
    m = x.shape[0]
    out = _output(out, (m, rows), torch.bfloat16, x.device, "fp8_grouped_gemv")
    if m >= DENSE_MIN_ROWS:  # a prompt chunk: cuBLAS over the weight's bf16 copy, each group into its columns of out
        wb = fp8_weight_bf16(w, ws).view(groups, n, k)
        for g in range(groups):
            torch.mm(x[:, g * k : (g + 1) * k], wb[g].t(), out=out[:, g * n : (g + 1) * n])
        return out
    rows_cta = rows_per_cta(rows, sm_count(w.device), lambda r: rows_bf16x_shared_bytes(r, k, m), divides=n) if m <= ROWS_TOKENS else None
    if rows_cta is not None and splits is None:
        shared = rows_bf16x_shared_bytes(rows_cta, k, m)
        p = RowsBf16Params(w.data_ptr(), ws.data_ptr(), x.data_ptr(), out.data_ptr(), rows, k, m, rows_cta, x.stride(0), n)
        get_kernel("fp8_rows", "fp8_rows_bf16x_m8", w.device)((rows // rows_cta, 1, 1), ROWS_THREADS, [p], shared=shared)
        return out
    _launch(FP8, w, ws, x, out, k, n, splits)
    return out
