"""The lightning indexer at decode (kernels_cu/indexer.cu): scores of every compressed index key,
then the top-k entries a CSA layer attends to.

V4-Flash's index keys are FP4: 68-byte entries (model.md §5) of 128 e2m1 values (64 bytes, even
element in the low nibble) and 4 UE8M0 scales, one per 32 dims. The reference keeps the same
values fake-quantised in bf16 (Hadamard-rotated, then `quant.fp4_fake_quant_ue8m0`); queries are
quantised the same way and reach the kernel as their e2m1 grid values in e4m3 plus float scales.
Scores follow the reference bit for bit (see indexer.cu); the top-k is the reference's
`select_topk` (k largest, ties to the lower index), returned in ascending index order.
"""

from __future__ import annotations

import ctypes
import math

import torch

from dsuf.model import quant

from .linear import sm_count
from .runtime import get_kernel, ptr

INDEX_ENTRY_BYTES = 68
INDEX_HEADS = 64
INDEX_DIM = 128
FP4_BLOCK = 32
TOPK_THREADS = 1024
TOPK_SHARED_MAX = 192 << 10  # scores a top-k CTA stages in shared memory: up to 48k per row
TOPK_SLICE = 16384  # rows longer than a CTA stages are cut into slices of this many keys (a first pass)
TOPK_SHORT = 2048  # rows of at most this many keys: topk_select_short, 256 threads a CTA, several CTAs an SM
TOPK_SHORT_THREADS = 256


def _fp4_quant(x: torch.Tensor, q: torch.Tensor | None, q_scale: torch.Tensor | None, pool: torch.Tensor | None, dst: torch.Tensor | None) -> None:
    """kernels_cu/indexer.cu fp4_quant_rows on the rows of x: values + scales and/or entries."""
    rows = x.numel() // INDEX_DIM
    if x.dtype != torch.bfloat16 or x.shape[-1] != INDEX_DIM:
        raise ValueError(f"FP4 quantisation: need bf16 [..., {INDEX_DIM}], got {x.dtype} {tuple(x.shape)}")
    if rows:
        get_kernel("indexer", "fp4_quant_rows", x.device)(
            (math.ceil(rows / 8), 1, 1), 256, [ptr(x.contiguous()), ctypes.c_int(rows), ptr(q), ptr(q_scale), ptr(pool), ptr(dst)]
        )


def fp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's FP4 fake-quant (`quant.fp4_fake_quant_ue8m0`, ue8m0 scales per 32) of bf16
    x [..., 128], as its e2m1 values in float8_e4m3fn [..., 128] and float32 scales [..., 4]:
    fake-quant = e4m3 * scale exactly."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], INDEX_DIM // FP4_BLOCK), dtype=torch.float32, device=x.device)
    _fp4_quant(x, q, scale, None, None)
    return q, scale


def index_query_fp4(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index queries as index_scores takes them, from wq_b's bf16 heads q [rows, H, 128] and the
    rows' RoPE (cos, sin float32 [rows, 32]): the RoPE of the trailing 64 dims, the Hadamard
    rotation (the sums exact, as the compressor rotates index keys) and `fp4_quantize`, in one
    launch (kernels_cu/indexer.cu index_query_fp4)."""
    rows, heads = q.shape[0], q.shape[1]
    if q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[2] != INDEX_DIM:
        raise ValueError(f"index_query_fp4: need bf16 q [rows, H, {INDEX_DIM}], got {q.dtype} {tuple(q.shape)}")
    if tuple(cos.shape) != (rows, 32) or tuple(sin.shape) != (rows, 32) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"index_query_fp4: cos / sin must be float32 [{rows}, 32]")
    out = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
    scale = torch.empty((rows, heads, INDEX_DIM // FP4_BLOCK), dtype=torch.float32, device=q.device)
    if rows:
        get_kernel("indexer", "index_query_fp4", q.device)(
            (math.ceil(rows * heads / 8), 1, 1), 256,
            [ptr(q.contiguous()), ptr(cos.contiguous()), ptr(sin.contiguous()), ctypes.c_int(rows), ctypes.c_int(heads), ptr(out), ptr(scale)],
        )
    return out, scale


def pack_index_keys(keys: torch.Tensor, pool: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 keys [n, 128] -> their FP4 fake-quant as 68-byte entries, written to pool[rows]
    (int64 [n]) or, without a pool, to a new uint8 [n, 68]. Returns the pool."""
    n = keys.shape[0]
    if pool is None:
        pool, rows = torch.empty((n, INDEX_ENTRY_BYTES), dtype=torch.uint8, device=keys.device), torch.arange(n, device=keys.device)
    if pool.dtype != torch.uint8 or pool.shape[-1] != INDEX_ENTRY_BYTES or not pool.is_contiguous():
        raise ValueError(f"pack_index_keys: the pool must be contiguous uint8 [entries, {INDEX_ENTRY_BYTES}]")
    if rows is None or rows.dtype != torch.int64 or tuple(rows.shape) != (n,):
        raise ValueError(f"pack_index_keys: rows must be int64 [{n}]")
    _fp4_quant(keys, None, None, pool, rows)
    return pool


def unpack_index_keys(entries: torch.Tensor) -> torch.Tensor:
    """68-byte entries uint8 [..., 68] -> float32 values [..., 128]."""
    values = quant.e2m1_decode(quant.unpack_fp4(entries[..., : INDEX_DIM // 2]))
    scale = quant.e8m0_decode(entries[..., INDEX_DIM // 2 :])
    return (values.unflatten(-1, (-1, FP4_BLOCK)) * scale.unsqueeze(-1)).flatten(-2)


class IndexParams(ctypes.Structure):
    """Mirror of `struct IndexParams` in kernels_cu/indexer.cu."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_scale", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("keys", ctypes.c_void_p),
        ("key_start", ctypes.c_void_p),
        ("n_keys", ctypes.c_void_p),
        ("scores", ctypes.c_void_p),
        ("stride", ctypes.c_int),
        ("w_stride", ctypes.c_int64),
        ("w_scale", ctypes.c_float),
        ("w_bf16", ctypes.c_int),
    ]


class TopkParams(ctypes.Structure):
    """Mirror of `struct TopkParams` in kernels_cu/indexer.cu."""

    _fields_ = [
        ("scores", ctypes.c_void_p),
        ("n_keys", ctypes.c_void_p),
        ("offset", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("stride", ctypes.c_int),
        ("out_stride", ctypes.c_int),
        ("out_col", ctypes.c_int),
        ("k", ctypes.c_int),
        ("cache", ctypes.c_int),
        ("slice", ctypes.c_int),
        ("cand", ctypes.c_void_p),
        ("cand_stride", ctypes.c_int),
        ("cand_slice", ctypes.c_int),
    ]


def index_scores(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    key_start: torch.Tensor,
    n_keys: torch.Tensor,
    max_keys: int,
    weight_scale: float = 1.0,
    weights_bf16: bool = False,
) -> torch.Tensor:
    """Index scores float32 [rows, max_keys]: row r scores keys[key_start[r] + j] for
    j < n_keys[r] (int32 device tensors, so they may change without the host knowing; every
    n_keys[r] <= max_keys); columns past n_keys[r] are -inf.

    q: float8_e4m3fn [rows, 64, 128] and q_scale float32 [rows, 64, 4] (`fp4_quantize` of the
    queries); weights float32 [rows, 64] (rows may be strided, e.g. a column slice of a wider
    projection), used as f32(weights) * weight_scale, or with weights_bf16 as
    f32(bf16(weights)) * weight_scale; keys: the 68-byte entry pool uint8 [entries, 68]."""
    rows = q.shape[0]
    if q.dtype != torch.float8_e4m3fn or tuple(q.shape[1:]) != (INDEX_HEADS, INDEX_DIM):
        raise ValueError(f"index_scores: need e4m3 q [rows, {INDEX_HEADS}, {INDEX_DIM}], got {q.dtype} {tuple(q.shape)}")
    if keys.dtype != torch.uint8 or keys.shape[-1] != INDEX_ENTRY_BYTES or not keys.is_contiguous():
        raise ValueError(f"index_scores: the key pool must be contiguous uint8 [entries, {INDEX_ENTRY_BYTES}]")
    for name, t in (("key_start", key_start), ("n_keys", n_keys)):
        if t.dtype != torch.int32 or tuple(t.shape) != (rows,):
            raise ValueError(f"index_scores: {name} must be int32 [{rows}]")
    scores = torch.empty((rows, max_keys), dtype=torch.float32, device=q.device)
    # A row's 128-key blocks go round its CTAs: spread over the SMs for a decode step's few rows
    # (up to 8 blocks a CTA at 1M context); a prompt chunk's many rows take a CTA each, which loads
    # the row's queries once for all its blocks.
    ctas = min(256, math.ceil(max_keys / 128), max(1, math.ceil(8 * sm_count(q.device) / max(1, rows))))
    if weights.dtype != torch.float32 or tuple(weights.shape) != (rows, INDEX_HEADS) or weights.stride(1) != 1:
        weights = weights.float().contiguous()
    q, q_scale = q.contiguous(), q_scale.float().contiguous()
    p = IndexParams()
    p.q, p.q_scale, p.w, p.keys = q.data_ptr(), q_scale.data_ptr(), weights.data_ptr(), keys.data_ptr()
    p.key_start, p.n_keys, p.scores = key_start.data_ptr(), n_keys.data_ptr(), scores.data_ptr()
    p.stride = max_keys
    p.w_stride, p.w_scale, p.w_bf16 = weights.stride(0), weight_scale, int(weights_bf16)
    get_kernel("indexer", "index_scores", q.device)((ctas, rows, 1), 256, [p])
    return scores


def topk_indices(
    scores: torch.Tensor,
    n_keys: torch.Tensor,
    k: int,
    out: torch.Tensor | None = None,
    out_col: int = 0,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """The indices of the min(k, n_keys[r]) largest of scores[r, :n_keys[r]] (ties to the lower
    index), ascending, plus offset[r] if given, written to out[r, out_col : out_col + k] (int32;
    -1 past the picks). Returns out (allocated [rows, k] when None)."""
    rows, stride = scores.shape
    if scores.dtype != torch.float32 or not scores.is_contiguous():
        raise ValueError("topk_indices: scores must be contiguous float32 [rows, n]")
    if out is None:
        out = torch.empty((rows, k), dtype=torch.int32, device=scores.device)
    if out.dtype != torch.int32 or out.shape[0] != rows or out.shape[1] < out_col + k or out.stride(1) != 1:
        raise ValueError(f"topk_indices: out must be int32 [{rows}, >= {out_col + k}] with unit column stride")
    for name, t in (("n_keys", n_keys), ("offset", offset)):
        if t is not None and (t.dtype != torch.int32 or tuple(t.shape) != (rows,)):
            raise ValueError(f"topk_indices: {name} must be int32 [{rows}]")
    select = get_kernel("indexer", "topk_select", scores.device)
    cand = None
    if stride > TOPK_SHARED_MAX // 4 and rows < sm_count(scores.device):
        # Long rows, few of them (decode at long context): each slice's top k first (a CTA a slice), then theirs.
        slices = math.ceil(stride / TOPK_SLICE)
        cand = torch.empty((rows, slices * k), dtype=torch.int32, device=scores.device)
        first = TopkParams()
        first.scores, first.n_keys, first.out = scores.data_ptr(), n_keys.data_ptr(), cand.data_ptr()
        first.stride, first.out_stride, first.out_col, first.k, first.cache, first.slice = stride, cand.stride(0), 0, k, TOPK_SLICE, TOPK_SLICE
        select((rows, slices, 1), TOPK_THREADS, [first], shared=4 * TOPK_SLICE)
    p = TopkParams()
    p.scores, p.n_keys, p.out = scores.data_ptr(), n_keys.data_ptr(), out.data_ptr()
    p.offset = offset.data_ptr() if offset is not None else 0
    p.stride, p.out_stride, p.out_col, p.k = stride, out.stride(0), out_col, k
    if cand is not None:
        p.cand, p.cand_stride, p.cand_slice = cand.data_ptr(), cand.shape[1], TOPK_SLICE
    keys = cand.shape[1] if cand is not None else stride
    p.cache = min(keys, TOPK_SHARED_MAX // 4)
    if keys <= TOPK_SHORT:
        get_kernel("indexer", "topk_select_short", scores.device)((rows, 1, 1), TOPK_SHORT_THREADS, [p], shared=4 * p.cache)
    else:
        select((rows, 1, 1), TOPK_THREADS, [p], shared=4 * p.cache)
    return out
