"""RMSNorm kernels (kernels_cu/rmsnorm.cu), numerically the reference's `layers.rms_norm` and
`layers.hc_collapse` followed by it (with the collapse's pre given, or formed from an mHC site's
mixes). Each can also hand its output FP8-quantised to the FP8 linear that follows, exactly as
`linear.act_quant` of its bf16 output, in the same launch (`rms_norm_fp8`, `fp8_out=`)."""

from __future__ import annotations

import ctypes

import torch

from .linear import BLOCK
from .runtime import get_kernel, ptr

MAX_DIM = 8192
HC_STREAMS = 4  # the mHC streams the collapse kernels take (HC_N in mhc.cuh)
WARP_ROW_DIM = 1024  # rows this short (8 elements a lane, 4 passes) can take a warp each ...
WARP_ROWS_MIN = 2048  # ... and do, from this many rows (a prompt chunk's per-head norms): 8 rows a CTA
HC_FUSED_TOKENS = 8  # hc_block_input's most tokens: a CTA a token and mix row, each with its row of fn
HC_SPLIT_TOKENS = 4  # up to here two CTAs a mix row, each with half of it (48 CTAs a token: the SMs are there)


def _rows_launch(name: str, rows: int, d: int, device: torch.device, args: list) -> None:
    """One rmsnorm.cu kernel over `rows` rows of d: a CTA a row, or its _warp variant (a warp a row)."""
    if d <= WARP_ROW_DIM and rows >= WARP_ROWS_MIN:
        get_kernel("rmsnorm", name.replace("_bf16", "_warp_bf16"), device)((-(-rows // 8), 1, 1), 256, [*args, ctypes.c_int(rows)])
    else:
        get_kernel("rmsnorm", name, device)((rows, 1, 1), 256, args)


def _check_dim(d: int) -> None:
    if d % 8 or d > MAX_DIM:
        raise ValueError(f"rms_norm: the last dim must be a multiple of 8 and at most {MAX_DIM}, got {d}")


def _weight(weight: torch.Tensor | None, d: int) -> torch.Tensor | None:
    if weight is None:
        return None
    if tuple(weight.shape) != (d,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({d},)")
    return weight.float().contiguous()


Fp8Rows = tuple[torch.Tensor, torch.Tensor]
"""Rows FP8-quantised as linear.act_quant leaves them: (e4m3 [T, D], float32 scales [T, D/128])."""


def fp8_rows(t: int, d: int, device: torch.device) -> Fp8Rows:
    """Empty buffers for T rows of D FP8-quantised."""
    if d % BLOCK:
        raise ValueError(f"FP8 rows need D % {BLOCK} == 0, got {d}")
    return (torch.empty((t, d), dtype=torch.float8_e4m3fn, device=device), torch.empty((t, d // BLOCK), dtype=torch.float32, device=device))


def _fp8_ptrs(fp8_out: Fp8Rows | None, t: int, d: int) -> list[ctypes.c_void_p]:
    if fp8_out is None:
        return [ptr(None), ptr(None)]
    xq, sx = fp8_out
    if xq.dtype != torch.float8_e4m3fn or tuple(xq.shape) != (t, d) or sx.dtype != torch.float32 or tuple(sx.shape) != (t, d // BLOCK):
        raise ValueError(f"fp8_out: need e4m3 [{t}, {d}] and float32 [{t}, {d // BLOCK}], got {xq.dtype} {tuple(xq.shape)}, {sx.dtype} {tuple(sx.shape)}")
    if not (xq.is_contiguous() and sx.is_contiguous()):
        raise ValueError("fp8_out: the buffers must be contiguous")
    return [ptr(xq), ptr(sx)]


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> Fp8Rows:
    """act_quant(rms_norm(x, weight, eps)) of bf16 x [T, D] in one launch (the bf16 rows are not kept)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"rms_norm_fp8: expected bfloat16 [T, D], got {x.dtype} {tuple(x.shape)}")
    t, d = x.shape
    _check_dim(d)
    out = fp8_rows(t, d, x.device)
    if t:
        _rows_launch("rmsnorm_bf16", t, d, x.device, [ptr(x.contiguous()), ptr(_weight(weight, d)), ptr(None), *_fp8_ptrs(out, t, d), ctypes.c_int(d), ctypes.c_float(eps)])
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """bf16 [..., D] normalised over the last dim, times weight (float32 [D]) if given. With
    rope = (cos, sin) float32 [P, 32] (x [P, ...]: P positions), the last 64 dims of every row are
    then rotated as layers.Rope.apply would (in the same launch)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"rms_norm: expected bfloat16, got {x.dtype}")
    d = x.shape[-1]
    _check_dim(d)
    x = x.contiguous()
    out = torch.empty_like(x)
    rows = x.numel() // d
    if not rows:
        return out
    io = [ptr(x), ptr(_weight(weight, d)), ptr(out)]
    dims = [ctypes.c_int(d), ctypes.c_float(eps)]
    if rope is None:
        _rows_launch("rmsnorm_bf16", rows, d, x.device, io + _fp8_ptrs(None, rows, d) + dims)
        return out
    cos, sin = (t.float().contiguous() for t in rope)
    positions = x.shape[0]
    if d < 64 or tuple(cos.shape) != (positions, 32) or tuple(sin.shape) != (positions, 32):
        raise ValueError(f"rms_norm: rope needs cos / sin [{positions}, 32] and D >= 64, got {tuple(cos.shape)}, D={d}")
    _rows_launch("rmsnorm_rope_bf16", rows, d, x.device, io + dims + [ptr(cos), ptr(sin), ctypes.c_int(rows // positions)])
    return out


def hc_collapse_rms_norm(x: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor | None, eps: float, fp8_out: Fp8Rows | None = None) -> torch.Tensor:
    """rms_norm(hc_collapse(x, pre)): the mHC streams x bf16 [T, 4, D] mixed with pre float32
    [T, 4] into bf16 [T, D], then normalised; also into fp8_out (fp8_rows) if given."""
    if x.dtype != torch.bfloat16 or x.dim() != 3 or x.shape[1] != HC_STREAMS or tuple(pre.shape) != tuple(x.shape[:2]):
        raise ValueError(f"hc_collapse_rms_norm: need bf16 [T, {HC_STREAMS}, D] and pre [T, {HC_STREAMS}], got {x.dtype} {tuple(x.shape)}, {tuple(pre.shape)}")
    t, _, d = x.shape
    _check_dim(d)
    x = x.contiguous()
    pre = pre.float().contiguous()
    out = torch.empty((t, d), dtype=torch.bfloat16, device=x.device)
    if t:
        get_kernel("rmsnorm", "hc_collapse_rmsnorm_bf16", x.device)(
            (t, 1, 1),
            256,
            [ptr(x), ptr(pre), ptr(_weight(weight, d)), ptr(out), *_fp8_ptrs(fp8_out, t, d), ctypes.c_int(d), ctypes.c_float(eps)],
        )
    return out


def hc_pre_collapse_rms_norm(x: torch.Tensor, mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
                             weight: torch.Tensor, eps: float, fp8_out: Fp8Rows | None = None) -> torch.Tensor:
    """hc_collapse_rms_norm with pre formed from an mHC site's mixes float32 [T, 24] (scale
    float32 [3], base float32 [24]: the site's), as HyperConnection.coefficients forms it."""
    t, n, d = x.shape
    if x.dtype != torch.bfloat16 or n != 4 or tuple(mix.shape) != (t, 24) or not x.is_contiguous():
        raise ValueError(f"hc_pre_collapse_rms_norm: need contiguous bf16 [T, 4, D] and mix [T, 24], got {x.dtype} {tuple(x.shape)}, {tuple(mix.shape)}")
    _check_dim(d)
    out = torch.empty((t, d), dtype=torch.bfloat16, device=x.device)
    if t:
        get_kernel("rmsnorm", "hc_pre_collapse_rmsnorm_bf16", x.device)(
            (t, 1, 1),
            256,
            [ptr(x), ptr(mix), ptr(scale), ptr(base), ctypes.c_float(hc_eps), ptr(_weight(weight, d)), ptr(out), *_fp8_ptrs(fp8_out, t, d),
             ctypes.c_int(d), ctypes.c_float(eps)],
        )
    return out


def hc_block_input(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float, mix_eps: float,
                   weight: torch.Tensor, eps: float, fp8_out: Fp8Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An mHC site's mixes and block input in one launch (decode sizes: T <= HC_FUSED_TOKENS):
    (hc_pre_collapse_rms_norm's output, the mixes float32 [T, 24] of the site fn float32 [24, 4·D]
    with the mixes' own eps), as the site's mixes kernel followed by hc_pre_collapse_rms_norm.
    With fn [4, 4·D], the head's HyperHead (pre only: v4.HyperHead, then the final norm), for any
    number of tokens; the mixes' first 4 columns are made. Up to HC_SPLIT_TOKENS tokens each mix is
    summed by two CTAs, each over two of the streams."""
    t, n, d = x.shape
    rows = fn.shape[0]
    head = rows == HC_STREAMS
    if x.dtype != torch.bfloat16 or n != HC_STREAMS or not x.is_contiguous() or tuple(fn.shape) != (rows, n * d) or rows not in (HC_STREAMS, 24) \
            or not 1 <= t <= (t if head else HC_FUSED_TOKENS):
        raise ValueError(f"hc_block_input: need contiguous bf16 [T, 4, D] and fn [24, 4 D] (T <= {HC_FUSED_TOKENS}) or [4, 4 D], "
                         f"got {x.dtype} {tuple(x.shape)}, {tuple(fn.shape)}")
    _check_dim(d)
    out = torch.empty((t, d), dtype=torch.bfloat16, device=x.device)
    mix = torch.empty((t, 24), dtype=torch.float32, device=x.device)
    split = 2 if t <= HC_SPLIT_TOKENS else 1
    get_kernel("rmsnorm", "hc_block_input_split_bf16" if split > 1 else "hc_block_input_bf16", x.device)(
        (t, rows * split, 1),
        256,
        [ptr(x), ptr(fn), ptr(mix), ptr(scale), ptr(base), ctypes.c_float(hc_eps), ptr(_weight(weight, d)), ptr(out), *_fp8_ptrs(fp8_out, t, d),
         ctypes.c_int(d), ctypes.c_float(eps), ctypes.c_double(mix_eps)],
        shared=fn.shape[1] * 4 // split,
    )
    return out, mix
