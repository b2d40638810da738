"""Rotary embedding on the GPU (kernels_cu/rope.cu): `layers.Rope.apply` on bf16 heads, in place."""

from __future__ import annotations

import ctypes
import math

import torch

from .runtime import get_kernel, ptr

ROPE_PAIRS = 32  # the trailing 64 dims of each head


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 64 dims of every head of x bf16 [rows, heads, dim] (contiguous) in place;
    cos / sin float32 [rows, 32] are `Rope.cos_sin` of each row's position. Returns x."""
    rows, heads, dim = x.shape
    if x.dtype != torch.bfloat16 or not x.is_contiguous() or dim < 2 * ROPE_PAIRS:
        raise ValueError(f"rope_: need contiguous bf16 [rows, heads, dim >= 64], got {x.dtype} {tuple(x.shape)}")
    if tuple(cos.shape) != (rows, ROPE_PAIRS) or tuple(sin.shape) != (rows, ROPE_PAIRS):
        raise ValueError(f"rope_: cos / sin must be [{rows}, {ROPE_PAIRS}]")
    pairs = rows * heads * ROPE_PAIRS
    if pairs:
        get_kernel("rope", "rope_bf16", x.device)(
            (math.ceil(pairs / 256), 1, 1),
            256,
            [ptr(x), ptr(cos.float().contiguous()), ptr(sin.float().contiguous()), ctypes.c_int(rows), ctypes.c_int(heads), ctypes.c_int(dim), ctypes.c_int(int(inverse))],
        )
    return x
