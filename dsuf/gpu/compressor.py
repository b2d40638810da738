"""One decode step of V4's KV compressors as one kernel (kernels_cu/compressor.cu): the state
update, the gated pooling of a completed group, its RMSNorm and RoPE, and the cache-entry write,
for B sequences at their own positions (a device tensor, so one CUDA graph serves every step);
and a prompt chunk's groups all at once (compress_chunk: each compressor's NAME_chunk kernel),
which a step of many rows takes too (compress_decode's groups_in_parallel).

The three compressors of V4-Flash: the CSA layers' main compressor (ratio 4, width 512, overlapping
windows) and their indexer's (ratio 4, width 128, Hadamard-rotated FP4 keys), and the HCA layers'
(ratio 128, width 512). The caller computes the projections (bf16 x bf16 -> float32 matmul).
"""

from __future__ import annotations

import ctypes

import torch

from .attention import KV_ENTRY_BYTES
from .indexer import INDEX_ENTRY_BYTES
from .runtime import get_kernel

KERNELS = {(512, 4): "compress_csa", (512, 128): "compress_hca", (128, 4): "compress_index"}  # (width, ratio)
CHANNELS_PER_CTA = 64
ROPE_PAIRS = 32
MAX_ROWS = 65535  # the grid's y dimension
# From this many rows a step's groups are pooled in parallel (compress_decode's groups_in_parallel):
# a prompt's step (up to PREFILL_CHUNK rows of one sequence) otherwise pools its groups one after
# another in one cluster (a 256-row step: 64 of the indexer's Hadamard-rotated keys in a row).
PARALLEL_MIN_ROWS = 128


class CompressParams(ctypes.Structure):
    """Mirror of `struct CompressParams` in kernels_cu/compressor.cu."""

    _fields_ = [
        ("kv", ctypes.c_void_p),
        ("score", ctypes.c_void_p),
        ("pos", ctypes.c_void_p),
        ("state_kv", ctypes.c_void_p),
        ("state_score", ctypes.c_void_p),
        ("ape", ctypes.c_void_p),
        ("norm", ctypes.c_void_p),
        ("freqs", ctypes.c_void_p),
        ("pool", ctypes.c_void_p),
        ("kv_slot", ctypes.c_void_p),
        ("key_row", ctypes.c_void_p),
        ("latent", ctypes.c_void_p),
        ("kv_stride", ctypes.c_int64),
        ("score_stride", ctypes.c_int64),
        ("eps", ctypes.c_double),
        ("state_row", ctypes.c_void_p),
        ("runs", ctypes.c_void_p),
        ("chunk_first", ctypes.c_int),
        ("chunk_rows", ctypes.c_int),
        ("chunk_state", ctypes.c_int),
    ]


def _rows(what: str, t: torch.Tensor, batch: int, channels: int, name: str) -> torch.Tensor:
    """t as float32 [batch, channels] rows of contiguous, 16-byte aligned channels (a column slice
    of a wider projection output is taken as it is)."""
    if t.dtype != torch.float32 or tuple(t.shape) != (batch, channels):
        raise ValueError(f"{what}: {name} must be float32 [{batch}, {channels}], got {t.dtype} {tuple(t.shape)}")
    if t.stride(1) != 1 or t.stride(0) % 4 or t.data_ptr() % 16:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def compress_decode(
    kv: torch.Tensor,
    score: torch.Tensor,
    positions: torch.Tensor,
    state_kv: torch.Tensor,
    state_score: torch.Tensor,
    ape: torch.Tensor,
    norm: torch.Tensor,
    freqs: torch.Tensor,
    eps: float,
    pool: torch.Tensor,
    slots: torch.Tensor,
    latent: torch.Tensor | None = None,
    state_rows: torch.Tensor | None = None,
    runs: torch.Tensor | None = None,
    groups_in_parallel: bool = False,
) -> None:
    """One decode token per row b at position positions[b] (int32 [B]; < 0: a padding row, left
    untouched) fed to a compressor of ratio = ape.shape[0] and width = norm.shape[0]:

    - kv, score: float32 [B, C] the token's projections (C = 2 width for ratio 4, else width);
    - state_kv, state_score: float32 [B, rows, C] the state as CompressorState holds it (rows =
      2 ratio for ratio 4: the previous group, then the current one; else ratio), updated in place;
    - ape float32 [ratio, C], norm float32 [width], freqs float32 [32] (the layer's Rope.freqs:
      the entry's cos / sin are computed inside, at its position p - ratio + 1), eps the norm's;
    - a token that completes its group writes the entry: width 512 into the KV pool uint8
      [entries, 584] at slots[b] (int32, as pack_kv), width 128 Hadamard-rotated into the index
      key pool uint8 [n, 68] at slots[b] (int64, as pack_index_keys); < 0 writes nothing. Other
      rows write nothing there (their slot is not read);
    - latent: optional bf16 [B, width], row b set to the completed entry after RoPE (before the
      Hadamard rotation and the cache format) where row b completes one;
    - state_rows: optional int64 [B]: row b's state is state_kv[state_rows[b]] (states of many
      sequences, indexed by their slots; without it, state row b);
    - runs: optional int32 [R + 1], R <= B: the rows in runs, rows runs[r] .. runs[r + 1] - 1
      applied one after another (several tokens of one sequence, in position order, share its
      state); without it every row is its own run. Empty runs (equal bounds) are allowed;
    - groups_in_parallel: the same entries and states in two launches of the chunk kernel, a
      cluster a row: every row that completes a group pools it at once (each slot from the step's
      row that has its position, else from the state), then each sequence's last row writes the
      state its rows leave. A sequence's rows must then be side by side at consecutive positions
      with one state row (runs, if given, are those), and the rows of different sequences must
      have different state rows (a padding row with position >= 0 writes its own state row as
      any other: give padding rows a scratch state row, or position < 0).

    One launch (two with groups_in_parallel) and no state of its own: safe in CUDA graphs and on
    any stream.
    """
    batch = positions.shape[0]
    if positions.dtype != torch.int32 or positions.dim() != 1 or batch > MAX_ROWS:
        raise ValueError(f"compress_decode: positions must be int32 [B], B <= {MAX_ROWS}")
    held = state_kv.shape[0] if state_rows is not None else batch
    if state_rows is not None and (state_rows.dtype != torch.int64 or tuple(state_rows.shape) != (batch,)):
        raise ValueError(f"compress_decode: state_rows must be int64 [{batch}]")
    if latent is not None and (latent.dtype != torch.bfloat16 or tuple(latent.shape) != (batch, norm.shape[0]) or not latent.is_contiguous()):
        raise ValueError(f"compress_decode: latent must be contiguous bf16 [{batch}, {norm.shape[0]}]")
    if runs is not None and (runs.dtype != torch.int32 or runs.dim() != 1 or not 2 <= runs.shape[0] <= batch + 1):
        raise ValueError(f"compress_decode: runs must be int32 [R + 1], 1 <= R <= {batch}")
    name, params, _inputs = _checked("compress_decode", kv, score, batch, held, state_kv, state_score, ape, norm, freqs, eps, pool, slots)
    if not batch:
        return
    params.pos = positions.data_ptr()
    if state_rows is not None:
        state_rows = state_rows.contiguous()
        params.state_row = state_rows.data_ptr()
    params.latent = latent.data_ptr() if latent is not None else 0
    params.runs = runs.data_ptr() if runs is not None else 0
    grid_x, threads = norm.shape[0] // CHANNELS_PER_CTA, _threads(ape.shape[0])  # a cluster of width / 64 CTAs (compiled in)
    if groups_in_parallel:
        kernel = get_kernel("compressor", f"{name}_chunk", kv.device)
        params.chunk_rows = batch
        kernel((grid_x, batch, 1), threads, [params])
        params.chunk_state = 1
        kernel((grid_x, batch, 1), threads, [params])
    else:  # a cluster a run
        get_kernel("compressor", name, kv.device)((grid_x, runs.shape[0] - 1 if runs is not None else batch, 1), threads, [params])


def compress_chunk(
    kv: torch.Tensor,
    score: torch.Tensor,
    first: int,
    state_kv: torch.Tensor,
    state_score: torch.Tensor,
    slot: torch.Tensor,
    ape: torch.Tensor,
    norm: torch.Tensor,
    freqs: torch.Tensor,
    eps: float,
    pool: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """compress_decode for T rows of one sequence at positions first .. first + T - 1 (a prompt
    chunk) with its groups in parallel: the same entries and final state as the rows applied one
    after another, in two launches. The first pools every group the chunk completes at once, a
    cluster a group, each slot's row read from the chunk's projections (score + ape) or, before the
    chunk, from the sequence's state (int64 `slot` [1] indexes state_kv / state_score); the second
    writes the state the chunk leaves. kv, score: float32 [T, C]; ape, norm, freqs, eps, pool,
    slots ([T], row t's entry if it completes a group): as compress_decode."""
    rows, ratio = kv.shape[0], ape.shape[0]
    if first < 0 or rows < 1 or first + rows > 1 << 31:
        raise ValueError(f"compress_chunk: {rows} rows from position {first} are not a chunk")
    if slot.dtype != torch.int64 or tuple(slot.shape) != (1,):
        raise ValueError("compress_chunk: slot must be int64 [1]")
    name, params, _inputs = _checked("compress_chunk", kv, score, rows, state_kv.shape[0], state_kv, state_score, ape, norm, freqs, eps, pool, slots)
    slot = slot.contiguous()
    params.state_row, params.chunk_first, params.chunk_rows = slot.data_ptr(), first, rows
    grid_x, threads = norm.shape[0] // CHANNELS_PER_CTA, _threads(ratio)
    kernel = get_kernel("compressor", f"{name}_chunk", kv.device)
    groups = len(range((ratio - 1 - first) % ratio, rows, ratio))  # the groups the chunk completes
    if groups:
        kernel((grid_x, groups, 1), threads, [params])
    params.chunk_state = 1
    kernel((grid_x, 1, 1), threads, [params])


def _threads(ratio: int) -> int:
    return 128 if ratio == 4 else 256


def _checked(what: str, kv: torch.Tensor, score: torch.Tensor, batch: int, held: int, state_kv: torch.Tensor, state_score: torch.Tensor,
             ape: torch.Tensor, norm: torch.Tensor, freqs: torch.Tensor, eps: float, pool: torch.Tensor, slots: torch.Tensor):
    """The compressor's kernel name (compress_chunk launches NAME_chunk), the launch's parameters
    common to both functions, each argument checked (errors name `what`), and the tensors they
    point to (contiguous copies among them), to be held until the launch."""
    width, ratio = norm.shape[0], ape.shape[0]
    name = KERNELS.get((width, ratio))
    if name is None:
        raise ValueError(f"{what}: no kernel for width {width}, ratio {ratio} (have {sorted(KERNELS)})")
    channels = (2 if ratio == 4 else 1) * width
    n_state = (2 if ratio == 4 else 1) * ratio
    kv, score = _rows(what, kv, batch, channels, "kv"), _rows(what, score, batch, channels, "score")
    for t, name_of in ((state_kv, "state_kv"), (state_score, "state_score")):
        if t.dtype != torch.float32 or tuple(t.shape) != (held, n_state, channels) or not t.is_contiguous():
            raise ValueError(f"{what}: {name_of} must be contiguous float32 [{held}, {n_state}, {channels}]")
    if ape.dtype != torch.float32 or tuple(ape.shape) != (ratio, channels) or norm.dtype != torch.float32:
        raise ValueError(f"{what}: ape must be float32 [{ratio}, {channels}], norm float32 [{width}]")
    if freqs.dtype != torch.float32 or tuple(freqs.shape) != (ROPE_PAIRS,):
        raise ValueError(f"{what}: freqs must be float32 [{ROPE_PAIRS}]")
    entry_bytes, slot_dtype = (KV_ENTRY_BYTES, torch.int32) if width == 512 else (INDEX_ENTRY_BYTES, torch.int64)
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != entry_bytes or not pool.is_contiguous():
        raise ValueError(f"{what}: the pool must be contiguous uint8 [entries, {entry_bytes}]")
    if slots.dtype != slot_dtype or tuple(slots.shape) != (batch,):
        raise ValueError(f"{what}: slots must be {slot_dtype} [{batch}]")
    ape, norm, freqs, slots = ape.contiguous(), norm.contiguous(), freqs.contiguous(), slots.contiguous()
    params = CompressParams(
        kv=kv.data_ptr(), score=score.data_ptr(), state_kv=state_kv.data_ptr(), state_score=state_score.data_ptr(), ape=ape.data_ptr(),
        norm=norm.data_ptr(), freqs=freqs.data_ptr(), pool=pool.data_ptr(), kv_slot=slots.data_ptr() if width == 512 else 0,
        key_row=slots.data_ptr() if width != 512 else 0, kv_stride=kv.stride(0), score_stride=score.stride(0), eps=eps,
    )
    return name, params, (kv, score, ape, norm, freqs, slots)
