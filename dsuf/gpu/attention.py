"""Decode attention over V4-Flash's FP8 KV entries (kernels_cu/kv_cache.cu, sparse_attn.cu).

A KV entry is 584 bytes (model.md §5): the 448 nope dims in e4m3 with one UE8M0 scale per 64,
the 64 rope dims in bf16, the 7 scale bytes and a zero pad byte. It decodes to exactly the bf16
row the reference keeps (FP8 fake-quant of the nope dims, rope dims as they are), so the kernels
here compute what `layers.sink_attention` computes over the reference's cache.

Entries live in a pool (`uint8 [entries, 584]`); a query row names the entries it attends to by
index (its sliding window plus its compressed entries), -1 for none. One pool can hold the window
rings and compressed caches of many sequences and layers.
"""

from __future__ import annotations

import ctypes
import math

import torch

from dsuf.model import quant

from .linear import sm_count
from .runtime import get_kernel, ptr

KV_ENTRY_BYTES = 584
HEAD_DIM = 512
ROPE_DIM = 64
NOPE_DIM = HEAD_DIM - ROPE_DIM
KV_BLOCK = 64  # nope dims per scale
HEADS = 64
TILE = 32  # entries per tile of the attention kernel
_ROW = HEAD_DIM + 8


def attention_kernel(heads: int, rows: int, sms: int) -> tuple[str, int, int]:
    """(name, dynamic shared memory, most heads a CTA takes) of the attention kernel for `rows` rows
    of `heads` query heads: CTAs of up to 32 heads (two an SM) where a rank has that few or a prompt
    chunk's rows fill the SMs (64 heads then take two CTAs a row), else up to 64 (shared memory:
    mirror of AttnSmem in sparse_attn.cu: q, two K tiles, the two halves' scores, probabilities,
    alphas, the tiles' indices)."""
    hm = 32 if heads <= 32 or rows >= sms else HEADS
    shared = hm * _ROW * 2 + 2 * TILE * _ROW * 2 + 2 * hm * (TILE + 4) * 4 + hm * (TILE + 8) * 2 + hm * 4 + 2 * TILE * 4
    return ("sparse_attn_decode_h32" if hm == 32 else "sparse_attn_decode"), shared, hm


def new_pool(entries: int, device: torch.device | str) -> torch.Tensor:
    """An empty KV pool: uint8 [entries, 584]."""
    return torch.zeros((entries, KV_ENTRY_BYTES), dtype=torch.uint8, device=device)


def pack_kv(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor | None = None) -> None:
    """Write bf16 rows x [rows, 512] (after kv_norm and RoPE) as FP8 entries: row i into
    pool[slots[i]] (slots int32 [rows], < 0 skips the row), or into pool[i] without slots."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != HEAD_DIM:
        raise ValueError(f"pack_kv: need bf16 [rows, {HEAD_DIM}], got {x.dtype} {tuple(x.shape)}")
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != KV_ENTRY_BYTES or not pool.is_contiguous():
        raise ValueError(f"pack_kv: the pool must be contiguous uint8 [entries, {KV_ENTRY_BYTES}]")
    if slots is not None and (slots.dtype != torch.int32 or tuple(slots.shape) != (x.shape[0],)):
        raise ValueError(f"pack_kv: slots must be int32 [{x.shape[0]}]")
    rows = x.shape[0]
    if rows:
        get_kernel("kv_cache", "kv_pack_fp8", x.device)(
            (math.ceil(rows / 8), 1, 1), 256, [ptr(x.contiguous()), ptr(slots), ptr(pool), ctypes.c_int(rows)]
        )


def unpack_kv(entries: torch.Tensor) -> torch.Tensor:
    """FP8 entries uint8 [..., 584] -> the bf16 rows [..., 512] they hold (torch, for tests and
    the reference path)."""
    nope = entries[..., :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float()
    scales = quant.e8m0_decode(entries[..., HEAD_DIM + ROPE_DIM : HEAD_DIM + ROPE_DIM + NOPE_DIM // KV_BLOCK])
    nope = (nope.unflatten(-1, (-1, KV_BLOCK)) * scales.unsqueeze(-1)).flatten(-2)
    rope = entries[..., NOPE_DIM : NOPE_DIM + 2 * ROPE_DIM].contiguous().view(torch.bfloat16)
    return torch.cat((nope.to(torch.bfloat16), rope), dim=-1)


class AttnParams(ctypes.Structure):
    """Mirror of `struct AttnParams` in kernels_cu/sparse_attn.cu."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("kv", ctypes.c_void_p),
        ("idx", ctypes.c_void_p),
        ("sink", ctypes.c_void_p),
        ("part_o", ctypes.c_void_p),
        ("part_ml", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("n_idx", ctypes.c_int),
        ("used", ctypes.c_void_p),
        ("splits", ctypes.c_int),
        ("ctas", ctypes.c_int),
        ("sms", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("heads", ctypes.c_int),
        ("cos_t", ctypes.c_void_p),
        ("sin_t", ctypes.c_void_p),
    ]


COMBINE_SPLITS = 256  # most splits a row the combine takes (sparse_attn.cu)


def choose_splits(n_idx: int, rows: int, sms: int, heads: int = HEADS, ctas: int | None = None, head_cap: int = HEADS) -> tuple[int, int, int]:
    """(splits, index slots per split, heads a CTA takes): a CTA per SM (the 64-head kernel fills
    one; for the 32-head kernel's two an SM a decode step's plan is the same), so about sms / rows
    splits a row, never more than the row has tiles, none of them empty; where
    that leaves SMs idle (a decode step's rows of a few tiles each), each split's heads are
    divided among 2 or 4 CTAs too (16-head MMA tiles). ctas: at most this many CTAs a row (the
    kernel plans a row using fewer slots than it was launched for within the launch's CTAs);
    head_cap: the most heads a CTA of the kernel holds."""
    cap = sms // max(1, rows) if ctas is None else min(ctas, sms // max(1, rows))
    tiles = max(1, math.ceil(n_idx / TILE))
    want = max(1, min(tiles, cap))
    per_split = math.ceil(tiles / want)
    splits = math.ceil(tiles / per_split)
    head_tiles = math.ceil(heads / 16)
    groups = next(g for g in (4, 2, 1) if g == 1 or (g <= head_tiles and rows * splits * g <= sms and (ctas is None or splits * g <= ctas)))
    groups = max(groups, math.ceil(16 * head_tiles / head_cap))
    return splits, per_split * TILE, 16 * math.ceil(head_tiles / groups)


def launch_room(n_idx: int, rows: int, sms: int, heads: int = HEADS, head_cap: int = HEADS) -> tuple[int, int]:
    """(CTAs a row, splits a row's partial outputs have room for) of a launch over n_idx index slots:
    the plan for n_idx slots; a row using fewer is planned within these CTAs (choose_splits' ctas)."""
    splits, _, head_tile = choose_splits(n_idx, rows, sms, heads, head_cap=head_cap)
    return splits * math.ceil(heads / head_tile), splits


def sparse_attention(
    q: torch.Tensor, pool: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float, out: torch.Tensor | None = None,
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None, used: torch.Tensor | None = None,
) -> torch.Tensor:
    """q bf16 [rows, H, 512] (after the per-head norm and RoPE; H <= 64: a tensor-parallel rank's
    heads) against the pool entries named by idx int32 [rows, n] (< 0: none), with attention sinks
    float32 [H] -> bf16 [rows, H, 512]. Each row must name at least one entry. inverse_rope =
    (cos, sin) float32 [rows, 32]: the output's last 64 dims are then rotated back as
    layers.Rope.apply(out, (cos, sin), inverse=True) would, in the same launch. used = int32 [rows]: row r's
    slots from used[r] on name no entry (a cache sized for more than the rows see: the work
    follows what each row uses, not n); the kernel reads it before its PDL wait, so it must not be
    written by the launch just before this call's (the decode step writes it at the step's start)."""
    rows, heads = q.shape[0], q.shape[1]
    if q.dtype != torch.bfloat16 or q.dim() != 3 or not 1 <= heads <= HEADS or q.shape[2] != HEAD_DIM or tuple(sink.shape) != (heads,):
        raise ValueError(f"sparse_attention: need bf16 q [rows, H <= {HEADS}, {HEAD_DIM}] and sinks [H], got {q.dtype} {tuple(q.shape)}, {tuple(sink.shape)}")
    if idx.dtype != torch.int32 or idx.dim() != 2 or idx.shape[0] != rows or idx.shape[1] < 1:
        raise ValueError(f"sparse_attention: need int32 idx [{rows}, n >= 1], got {idx.dtype} {tuple(idx.shape)}")
    if pool.dtype != torch.uint8 or pool.shape[-1] != KV_ENTRY_BYTES or not pool.is_contiguous():
        raise ValueError(f"sparse_attention: the pool must be contiguous uint8 [entries, {KV_ENTRY_BYTES}]")
    if used is not None and (used.dtype != torch.int32 or tuple(used.shape) != (rows,)):
        raise ValueError(f"sparse_attention: used must be int32 [{rows}], got {used.dtype} {tuple(used.shape)}")
    n_idx, sms = idx.shape[1], sm_count(q.device)
    name, shared, head_cap = attention_kernel(heads, rows, sms)
    ctas, splits = launch_room(n_idx, rows, sms, heads, head_cap)
    assert splits <= COMBINE_SPLITS
    # (one split a row: the attention kernel finishes each row itself, no partial outputs)
    part_o = torch.empty((rows, splits, HEADS, HEAD_DIM) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((rows, splits, HEADS, 2) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty((rows, heads, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    q, idx, sink = q.contiguous(), idx.contiguous(), sink.float().contiguous()
    used = used.contiguous() if used is not None else None
    cos = sin = None
    if inverse_rope is not None:
        cos, sin = (t.float().contiguous() for t in inverse_rope)
        if tuple(cos.shape) != (rows, ROPE_DIM // 2) or tuple(sin.shape) != (rows, ROPE_DIM // 2):
            raise ValueError(f"sparse_attention: inverse_rope needs cos / sin [{rows}, {ROPE_DIM // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    p = AttnParams()
    p.q, p.kv, p.idx, p.sink = q.data_ptr(), pool.data_ptr(), idx.data_ptr(), sink.data_ptr()
    p.part_o, p.part_ml, p.out = part_o.data_ptr(), part_ml.data_ptr(), out.data_ptr()
    p.n_idx, p.used, p.splits, p.ctas, p.sms, p.scale, p.heads = n_idx, used.data_ptr() if used is not None else 0, splits, ctas, sms, scale, heads
    p.cos_t, p.sin_t = (cos.data_ptr(), sin.data_ptr()) if cos is not None else (0, 0)
    get_kernel("sparse_attn", name, q.device)((ctas, rows, 1), 256, [p], shared=shared)
    if splits > 1:
        parts = 4 if rows * heads * 4 <= 2 * sms else 1  # CTAs a head's 512 dims take: a decode step's few rows spread wide
        get_kernel("sparse_attn", "sparse_attn_combine", q.device)((heads, rows, parts), HEAD_DIM // 4 // parts, [p])
    return out
