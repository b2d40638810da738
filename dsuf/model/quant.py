"""Quantisation codecs for DeepSeek-V4-Flash and V4.1-Flash checkpoints, activations and caches.

The checkpoint stores expert weights as packed FP4 (e2m1) with per-32 E8M0
scales and the remaining linear weights as FP8 (e4m3fn) with per-block E8M0
scales (V4.1's Engram tables: one E8M0 scale per row and 32 values);
activations are fake-quantised the way DeepSeek's kernels do, and V4.1's KV
cache rows can be held packed in their FP8/FP4 formats (`PackedRows`).  Every
function here is a plain tensor-to-tensor transform, vectorised, and exact
where the hardware format is exact, so that the reference forward pass and
the fast kernels can be checked against each other bit for bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "E2M1_VALUES",
    "FP8_MAX",
    "FP4_MAX",
    "ceil_log2_exact",
    "e8m0_decode",
    "e8m0_encode",
    "round_e4m3",
    "e2m1_encode",
    "e2m1_decode",
    "round_e2m1",
    "pack_fp4",
    "unpack_fp4",
    "dequant_fp8_weight",
    "quant_fp8_weight",
    "dequant_fp4_weight",
    "quant_fp4_weight",
    "act_quant_fp8",
    "fp4_fake_quant_ue8m0",
    "fp4_fake_quant_e4m3",
    "quant_fp8_rows",
    "dequant_fp8_rows",
    "PackedRows",
    "hadamard_matrix",
    "hadamard_transform",
]

FP8_MAX = 448.0
FP4_MAX = 6.0
# The kernels multiply by a float32 reciprocal rather than dividing; these are
# the float32-rounded reciprocals (exact as Python floats), so a float32 tensor
# times them is the same single float32 multiply the kernels do.
_FP8_MAX_INV = float(np.float32(1.0 / FP8_MAX))
_FP4_MAX_INV = float(np.float32(1.0 / FP4_MAX))
# Floors that keep every scale a normal float32 / a representable code.
_FP8_AMAX_FLOOR = 1e-4
_FP4_AMAX_FLOOR = FP4_MAX * 2.0**-126  # amax/6 >= 2**-126: scale stays normal
_FP4_E4M3_AMAX_FLOOR = FP4_MAX * 2.0**-9  # amax/6 >= 2**-9: smallest e4m3 subnormal

E2M1_VALUES: Tensor = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
"""The 16 e2m1 values in code order; bit 3 is the sign, bits 0..2 the magnitude."""

# e2m1 rounding boundaries between consecutive magnitudes.  Round-to-nearest-
# even means a tie goes to the even code, i.e. down at the boundaries below an
# even->odd step and up at the ones below an odd->even step.
_E2M1_TIES_DOWN = torch.tensor([0.25, 1.25, 2.5, 5.0], dtype=torch.float32)
_E2M1_TIES_UP = torch.tensor([0.75, 1.75, 3.5], dtype=torch.float32)


def _as_u8(codes: Tensor) -> Tensor:
    """Reinterpret 1-byte code tensors (uint8, int8, float8_e8m0fnu) as uint8."""
    if codes.dtype == torch.uint8:
        return codes
    if codes.element_size() != 1:
        raise TypeError(f"expected a 1-byte code tensor, got {codes.dtype}")
    return codes.view(torch.uint8)


def _pow2(k: Tensor) -> Tensor:
    """2**k as float32 for integer k in [-126, 127], built from the exponent bits (exact)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def ceil_log2_exact(x: Tensor) -> Tensor:
    """Exact ceil(log2(x)) for positive normal float32 x, read from the bits.

    A float log can land on the wrong side of an integer near powers of two;
    DeepSeek's kernels use this bit trick (exponent, +1 if any mantissa bit is
    set), so scales computed here match theirs exactly.  Inputs that are not
    positive normal float32 values give meaningless results.
    """
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    return (exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)).to(torch.int32)


def e8m0_decode(codes: Tensor) -> Tensor:
    """E8M0 scale bytes to float32 2**(code - 127); code 255 is NaN.

    Built from the bits so that code 0 (2**-127, a float32 subnormal) is exact too.
    """
    c = _as_u8(codes).to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 0x00400000), c << 23)
    bits = torch.where(c == 255, torch.full_like(c, 0x7FC00000), bits)
    return bits.view(torch.float32)


def e8m0_encode(scale: Tensor) -> Tensor:
    """Power-of-two float32 scales to their E8M0 byte (the biased exponent).

    Raises ValueError unless every value is an exact positive power of two in
    [2**-127, 2**127]; a silently truncated scale would corrupt a checkpoint.
    """
    bits = scale.to(torch.float32).contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    normal = (bits >= 0) & (exponent > 0) & (exponent < 255) & (mantissa == 0)
    sub_2m127 = bits == 0x00400000
    if not bool((normal | sub_2m127).all()):
        raise ValueError("e8m0_encode: every scale must be an exact positive power of two")
    return torch.where(sub_2m127, torch.zeros_like(exponent), exponent).to(torch.uint8)


def round_e4m3(x: Tensor) -> Tensor:
    """Round to the nearest e4m3fn value (ties to even), saturating at ±448; float32 out.

    e4m3fn has no infinity, so out-of-range values are clamped first rather
    than becoming NaN.  torch's float32->float8_e4m3fn cast is round-to-
    nearest-even, subnormals included (checked in the tests).
    """
    xf = x.to(torch.float32).clamp(-FP8_MAX, FP8_MAX)
    return xf.to(torch.float8_e4m3fn).to(torch.float32)


def e2m1_encode(x: Tensor) -> Tensor:
    """Round to the nearest e2m1 code (ties to even), saturating at ±6; uint8 codes 0..15.

    Any strictly negative input gets the sign bit, including ones that round
    to zero (-0.1 -> code 8, i.e. -0); +0, -0.0 and NaN give code 0.
    """
    xf = x.to(torch.float32)
    a = xf.abs().clamp(max=FP4_MAX)
    # The code of |x| is the number of rounding boundaries it has passed: strictly past a
    # boundary whose tie rounds down, at or past one whose tie rounds up. (Seven comparisons
    # beat torch.bucketize by an order of magnitude on small CPU tensors.)
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for bound in _E2M1_TIES_DOWN.tolist():
        mag += a > bound
    for bound in _E2M1_TIES_UP.tolist():
        mag += a >= bound
    sign = (xf < 0).to(mag.dtype) << 3
    return (mag | sign).to(torch.uint8)


def e2m1_decode(codes: Tensor) -> Tensor:
    """e2m1 codes (0..15) to float32 values via E2M1_VALUES."""
    return E2M1_VALUES.to(codes.device)[_as_u8(codes).long()]


def round_e2m1(x: Tensor) -> Tensor:
    """Round to the nearest e2m1 value (ties to even, saturating at ±6); float32 out."""
    return e2m1_decode(e2m1_encode(x))


def pack_fp4(codes: Tensor) -> Tensor:
    """uint8 e2m1 codes [..., K] (K even) to int8 [..., K//2], even element in the low nibble.

    This is the checkpoint's byte layout.  Codes are assumed to be in 0..15.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got {codes.shape[-1]}")
    c = _as_u8(codes)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: Tensor) -> Tensor:
    """int8/uint8 packed FP4 [..., K//2] to uint8 codes [..., K] (inverse of pack_fp4)."""
    p = _as_u8(packed)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def _expand_blocks(s: Tensor, rows: int, cols: int, block: int) -> Tensor:
    """Broadcast a per-(block x block) tensor to [rows, cols], cropping the ragged edge."""
    return s.repeat_interleave(block, dim=0)[:rows].repeat_interleave(block, dim=1)[:, :cols]


def dequant_fp8_weight(w: Tensor, scale: Tensor, block: int) -> Tensor:
    """float8_e4m3fn weight [out, in] with E8M0 scales [ceil(out/b), ceil(in/b)] to float32."""
    if w.dim() != 2:
        raise ValueError(f"dequant_fp8_weight: expected a 2-d weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    want = (-(-rows // block), -(-cols // block))
    if tuple(scale.shape) != want:
        raise ValueError(f"dequant_fp8_weight: scale shape {tuple(scale.shape)} != {want}")
    return w.to(torch.float32) * _expand_blocks(e8m0_decode(scale), rows, cols, block)


def quant_fp8_weight(w: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """float weight [out, in] to (float8_e4m3fn weight, float8_e8m0fnu scales) per block x block.

    scale = 2**ceil(log2(amax / 448)) with amax floored at 1e-4, so w / scale
    is within ±448 and the division by a power of two is exact.
    """
    if w.dim() != 2:
        raise ValueError(f"quant_fp8_weight: expected a 2-d weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    wf = w.to(torch.float32)
    pr, pc = -rows % block, -cols % block
    padded = torch.nn.functional.pad(wf, (0, pc, 0, pr))  # zeros never raise amax
    nr, nc = (rows + pr) // block, (cols + pc) // block
    amax = padded.view(nr, block, nc, block).abs().amax(dim=(1, 3)).clamp_min(_FP8_AMAX_FLOOR)
    scale = _pow2(ceil_log2_exact(amax / FP8_MAX))
    q = round_e4m3(wf / _expand_blocks(scale, rows, cols, block)).to(torch.float8_e4m3fn)
    return q, e8m0_encode(scale).view(torch.float8_e8m0fnu)


def dequant_fp4_weight(packed: Tensor, scale: Tensor, block: int = 32) -> Tensor:
    """Packed FP4 weight [out, in//2] with E8M0 scales [out, in//block] to float32 [out, in]."""
    vals = e2m1_decode(unpack_fp4(packed))
    rows, cols = vals.shape
    if cols % block or tuple(scale.shape) != (rows, cols // block):
        raise ValueError(
            f"dequant_fp4_weight: scale shape {tuple(scale.shape)} != {(rows, cols // block)}"
        )
    return vals * e8m0_decode(scale).repeat_interleave(block, dim=-1)


def quant_fp4_weight(w: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """float weight [out, in] to (int8 packed [out, in//2], float8_e8m0fnu scales [out, in//block]).

    Per row, per block along K: scale = 2**ceil(log2(amax / 6)), amax floored
    at 6 * 2**-126 so the scale stays a normal float32 (E8M0 code >= 1).
    """
    if w.dim() != 2 or w.shape[1] % block:
        raise ValueError(
            f"quant_fp4_weight: need [out, in] with in % {block} == 0, got {tuple(w.shape)}"
        )
    wb = w.to(torch.float32).unflatten(-1, (w.shape[1] // block, block))
    amax = wb.abs().amax(dim=-1, keepdim=True).clamp_min(_FP4_AMAX_FLOOR)
    scale = _pow2(ceil_log2_exact(amax / FP4_MAX))
    codes = e2m1_encode(wb / scale).flatten(-2)
    return pack_fp4(codes), e8m0_encode(scale.squeeze(-1)).view(torch.float8_e8m0fnu)


def _blocked(x: Tensor, block: int, name: str) -> Tensor:
    """x [..., K] as float32 [..., K//block, block]; K must be divisible by block."""
    if x.shape[-1] % block:
        raise ValueError(f"{name}: last dim {x.shape[-1]} is not divisible by block {block}")
    return x.to(torch.float32).unflatten(-1, (x.shape[-1] // block, block))


def _fp8_blocks(x: Tensor, block: int, name: str) -> tuple[Tensor, Tensor]:
    """(e4m3 grid values [..., K//block, block], power-of-two scales [..., K//block, 1]) of x:
    scale = 2**ceil_log2(amax * f32(1/448)) with amax floored at 1e-4, from the float32 bits
    exactly as DeepSeek's act_quant kernel does."""
    xb = _blocked(x, block, name)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(_FP8_AMAX_FLOOR)
    scale = _pow2(ceil_log2_exact(amax * _FP8_MAX_INV))
    return round_e4m3((xb / scale).clamp(-FP8_MAX, FP8_MAX)), scale


def _fp4_blocks(x: Tensor, block: int, scale_fmt: str, name: str) -> tuple[Tensor, Tensor]:
    """(e2m1 grid values [..., K//block, block], scales [..., K//block, 1]) of x.

    - "ue8m0": scale = 2**ceil_log2(amax * f32(1/6)), amax floored at 6 * 2**-126;
    - "e4m3": scale = round_e4m3(max(amax, 6 * 2**-9) / 6). Rounding the scale can go down,
      leaving |x / scale| slightly above 6, hence the clamp before rounding.
    """
    xb = _blocked(x, block, name)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    if scale_fmt == "ue8m0":
        scale = _pow2(ceil_log2_exact(amax.clamp_min(_FP4_AMAX_FLOOR) * _FP4_MAX_INV))
    elif scale_fmt == "e4m3":
        scale = round_e4m3(amax.clamp_min(_FP4_E4M3_AMAX_FLOOR) / FP4_MAX)
    else:
        raise ValueError(f"{name}: unknown scale format {scale_fmt!r}")
    return round_e2m1((xb / scale).clamp(-FP4_MAX, FP4_MAX)), scale


def act_quant_fp8(x: Tensor, block: int) -> Tensor:
    """FP8 fake-quant of activations per row, per block of the last dim (DeepSeek's act_quant):
    round_e4m3(x / scale) * scale in x's dtype, with the scale of `_fp8_blocks`."""
    q, scale = _fp8_blocks(x, block, "act_quant_fp8")
    return (q * scale).flatten(-2).to(x.dtype)


def fp4_fake_quant_ue8m0(x: Tensor, block: int) -> Tensor:
    """FP4 (e2m1) fake-quant with power-of-two (UE8M0) scales per block of the last dim; x's dtype."""
    q, scale = _fp4_blocks(x, block, "ue8m0", "fp4_fake_quant_ue8m0")
    return (q * scale).flatten(-2).to(x.dtype)


def fp4_fake_quant_e4m3(x: Tensor, block: int = 16) -> Tensor:
    """FP4 (e2m1) fake-quant with E4M3 scales per block of the last dim (NVFP4-style); x's dtype."""
    q, scale = _fp4_blocks(x, block, "e4m3", "fp4_fake_quant_e4m3")
    return (q * scale).flatten(-2).to(x.dtype)


def quant_fp8_rows(w: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """float [rows, K] to (float8_e4m3fn [rows, K], float8_e8m0fnu scales [rows, K//block]): one
    power-of-two scale per row and block of K, the layout of V4.1's Engram tables."""
    q, scale = _fp8_blocks(w, block, "quant_fp8_rows")
    return q.flatten(-2).to(torch.float8_e4m3fn), e8m0_encode(scale.squeeze(-1)).view(torch.float8_e8m0fnu)


def dequant_fp8_rows(w: Tensor, scale: Tensor) -> Tensor:
    """float8_e4m3fn [..., K] with E8M0 scales [..., K//block] to float32 (inverse of quant_fp8_rows)."""
    block = w.shape[-1] // scale.shape[-1]
    return (w.to(torch.float32).unflatten(-1, (-1, block)) * e8m0_decode(scale).unsqueeze(-1)).flatten(-2)


@dataclass(frozen=True)
class PackedRows:
    """A KV-cache row format: the values in FP8 (e4m3) or FP4 (e2m1, two per byte, even element in
    the low nibble) followed by one scale byte per `block` values (UE8M0 exponent or E4M3).

    `pack` quantises float rows [..., K] to bytes [..., row_bytes(K)]; `unpack` returns the float32
    values, which equal the matching fake-quant of the rows bit for bit. V4.1 keeps its window KV
    as ("fp8", 32, "ue8m0") (528 B for 512 dims), its compressed KV as ("fp4", 16, "e4m3") (288 B)
    and its index keys as ("fp4", 32, "ue8m0") (68 B for 128 dims)."""

    fmt: Literal["fp8", "fp4"]
    block: int
    scale_fmt: Literal["ue8m0", "e4m3"]

    def row_bytes(self, width: int) -> int:
        return (width if self.fmt == "fp8" else width // 2) + width // self.block

    def width(self, row_bytes: int) -> int:
        per_value = 1 if self.fmt == "fp8" else 0.5
        return round(row_bytes / (per_value + 1 / self.block))

    def pack(self, x: Tensor) -> Tensor:
        if self.fmt == "fp8":
            q, scale = _fp8_blocks(x, self.block, "PackedRows.pack")
            values = q.flatten(-2).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            q, scale = _fp4_blocks(x, self.block, self.scale_fmt, "PackedRows.pack")
            values = pack_fp4(e2m1_encode(q.flatten(-2))).view(torch.uint8)
        scale = scale.squeeze(-1)
        scales = e8m0_encode(scale) if self.scale_fmt == "ue8m0" else scale.to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.cat((values, scales), dim=-1)

    def unpack(self, packed: Tensor) -> Tensor:
        width = self.width(packed.shape[-1])
        n_values = self.row_bytes(width) - width // self.block
        values, scales = packed[..., :n_values], packed[..., n_values:]
        if self.fmt == "fp8":
            q = values.view(torch.float8_e4m3fn).to(torch.float32)
        else:
            q = e2m1_decode(unpack_fp4(values))
        scale = e8m0_decode(scales) if self.scale_fmt == "ue8m0" else scales.view(torch.float8_e4m3fn).to(torch.float32)
        return (q.unflatten(-1, (-1, self.block)) * scale.unsqueeze(-1)).flatten(-2)


@functools.lru_cache(maxsize=None)
def hadamard_matrix(n: int) -> Tensor:
    """Sylvester-order Hadamard matrix H_n scaled by n**-0.5 (orthonormal, symmetric); float32.

    Cached and shared between callers: do not modify the result in place.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: n must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return (h * n**-0.5).to(torch.float32)


@functools.lru_cache(maxsize=None)
def _hadamard_on(n: int, device: torch.device) -> Tensor:
    """hadamard_matrix(n) resident on device, so transforms do not copy it every call."""
    return hadamard_matrix(n).to(device)


def hadamard_transform(x: Tensor) -> Tensor:
    """x @ H_n over the last dim (n = x.shape[-1], a power of two), in float32, cast back."""
    h = _hadamard_on(x.shape[-1], x.device)
    return (x.to(torch.float32) @ h).to(x.dtype)
