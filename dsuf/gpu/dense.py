"""Prefill-sized matmuls on the tensor cores through cuBLAS and CUTLASS.

A chunk of thousands of rows is compute-bound. The decode kernels re-read a weight for every 32
rows (FP8) or every 8 rows of an expert (FP4), hundreds of times a chunk; here it is read once.
FP8 linears multiply their e4m3 weights and the activations' FP8 quantisation as they are, with
DeepSeek's block scaling (1x128 activation blocks, 128x128 weight blocks: torch._scaled_mm),
whose e4m3 sums keep about 12 bits of a 32-product step, as the decode kernels' wgmma. The FP4
experts are turned into bf16 copies once per chunk (exact: an e2m1 value times a power-of-two
E8M0 scale is a bf16 value, and so is the activations' FP8 quantisation kept as bf16,
`act_fake_quant`), multiplied by torch._grouped_mm: every product is the reference's, only the
fp32 summation order differs, and the gate and up projections are rounded to bf16 before the
SwiGLU (torch._grouped_mm writes bf16 only; the reference keeps them in float32).
"""

from __future__ import annotations

import ctypes
import math

import torch
import torch.nn.functional as F

from .runtime import device_arch, get_kernel, ptr

DENSE_MIN_ROWS = 128  # from this many rows an FP8 linear runs here rather than in the decode kernels (short prompts' steps too)


def fp8_weight_bf16(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K] with uint8 E8M0 scales [N/128, K/128] -> bf16 [N, K] (exact)."""
    n, k = w.shape
    if w.dtype != torch.float8_e4m3fn or n % 128 or k % 128 or tuple(scale.shape) != (n // 128, k // 128) or scale.dtype != torch.uint8:
        raise ValueError(f"fp8_weight_bf16: need e4m3 [N, K] in 128-multiples and uint8 scales [N/128, K/128], got {tuple(w.shape)}, {scale.dtype} {tuple(scale.shape)}")
    out = torch.empty((n, k), dtype=torch.bfloat16, device=w.device)
    get_kernel("dequant", "fp8_weight_bf16", w.device)(
        (math.ceil(n * k / 8 / 256), 1, 1), 256, [ptr(w.contiguous()), ptr(scale.contiguous()), ptr(out), ctypes.c_int(n), ctypes.c_int(k)]
    )
    return out


def fp4_weight_bf16(w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Stacked FP4 experts in kernel layout (moe.fp4_kernel_layout) uint8 [E, N, K/2] with uint8 E8M0
    scales [E, N, K/32] -> bf16 [E, N, K] (exact), written into `out` if given: a [E, N, K] view
    whose experts may lie further apart (e.g. w1 and w3 side by side in one [E, 2N, K] buffer)."""
    e, n, half = w.shape
    k = 2 * half
    if w.dtype != torch.uint8 or k % 128 or n % 128 or tuple(scale.shape) != (e, n, k // 32) or not w.is_contiguous() or not scale.is_contiguous():
        raise ValueError(f"fp4_weight_bf16: need contiguous uint8 [E, N, K/2] (N a multiple of 128) and scales [E, N, K/32], got {tuple(w.shape)}, {tuple(scale.shape)}")
    if out is None:
        out = torch.empty((e, n, k), dtype=torch.bfloat16, device=w.device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (e, n, k) or out.stride()[1:] != (k, 1):
        raise ValueError(f"fp4_weight_bf16: out must be bf16 [{e}, {n}, {k}] with contiguous experts")
    quads = e * n * k // 32  # 16-byte loads: 32 elements
    get_kernel("dequant", "fp4_weight_bf16", w.device)(
        (math.ceil(quads / 256), 1, 1), 256,
        [ptr(w), ptr(scale), ptr(out), ctypes.c_int64(e * n), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int64(out.stride(0))],
    )
    return out


def act_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """bf16 [M, K] -> bf16 [M, K]: the per-row, per-128 FP8 quantisation (linear.act_quant) of x,
    as the values it decodes to."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % 128:
        raise ValueError(f"act_fake_quant: need bf16 [M, K] with K % 128 == 0, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    rows, k = x.shape
    out = torch.empty_like(x)
    if rows:
        get_kernel("act_quant", "act_fake_quant_bf16", x.device)(
            (math.ceil(rows * (k // 128) / 8), 1, 1), 256, [ptr(x), ptr(out), ctypes.c_int(rows), ctypes.c_int(k)]
        )
    return out


def mm_scale(scale: torch.Tensor) -> torch.Tensor:
    """A weight's uint8 E8M0 scales [N/128, K/128] as fp8_mm multiplies by them: float32 2**e."""
    return scale.view(torch.float8_e8m0fnu).float()


def fp8_mm(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
           scale_f32: torch.Tensor | None = None) -> torch.Tensor:
    """An act_quant result (e4m3 [M, K], float32 scales [M, K/128]) times an e4m3 weight [N, K]
    with uint8 E8M0 scales [N/128, K/128], transposed: [M, N] of out_dtype (bf16 or float32).
    cuBLAS block scaling takes the activations' scales M-major and the weight's as the transpose
    of the checkpoint's (scale_f32: mm_scale(scale), kept by a caller that multiplies by the
    weight again), and only row counts that are multiples of 4 (it refuses 1001 to 1003 rows and
    takes 1000 and 1004, bit for bit as padded further): other row counts run padded with zero rows.
    Elsewhere than on Hopper (where cuBLAS may not take 128-blocks) the same products through
    exact bf16 copies of both."""
    m, k = xq.shape
    if device_arch(xq.device) != "sm_90a":
        x = (xq.to(torch.bfloat16).view(m, k // 128, 128) * sx.to(torch.bfloat16).unsqueeze(-1)).view(m, k)
        return torch.mm(x, fp8_weight_bf16(w, scale).t(), out_dtype=torch.float32).to(out_dtype)
    pad = -m % 4  # (one launch each for x and its scales, padded and M-major at once)
    xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn) if pad else xq
    scale_a = F.pad(sx.t(), (0, pad), value=1.0).t() if pad else sx.t().contiguous().t()
    w_scale = scale_f32 if scale_f32 is not None else mm_scale(scale)
    return torch._scaled_mm(xq, w.t(), scale_a=scale_a, scale_b=w_scale.t(), out_dtype=out_dtype)[:m]


def swiglu(gate_up: torch.Tensor, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """layers.Expert's SwiGLU over pairs: gate_up float32 or bf16 [P, 2I] (gate, then up) and
    optional routing weights float32 [P] -> bf16 h [P, I]."""
    pairs, two_i = gate_up.shape
    inter = two_i // 2
    if gate_up.dtype not in (torch.float32, torch.bfloat16) or two_i % 4 or not gate_up.is_contiguous():
        raise ValueError(f"swiglu: need contiguous float32 or bf16 [P, 2I], got {gate_up.dtype} {tuple(gate_up.shape)}")
    if weight is not None and (weight.dtype != torch.float32 or tuple(weight.shape) != (pairs,)):
        raise ValueError(f"swiglu: weight must be float32 [{pairs}]")
    h = torch.empty((pairs, inter), dtype=torch.bfloat16, device=gate_up.device)
    if pairs:
        name = "swiglu_f32" if gate_up.dtype == torch.float32 else "swiglu_bf16"
        get_kernel("dequant", name, gate_up.device)(
            (math.ceil(pairs * inter / 2 / 256), 1, 1), 256,
            [ptr(gate_up), ptr(weight.contiguous() if weight is not None else None), ptr(h), ctypes.c_int64(pairs), ctypes.c_int(inter), ctypes.c_float(limit)],
        )
    return h


def swiglu_fp8(gate_up: torch.Tensor, limit: float, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant(swiglu(gate_up, limit, weight)) in one pass, the bf16 h never written: float32
    gate_up [P, 2I] (I % 128 == 0) -> (e4m3 [P, I], float32 scales [P, I/128])."""
    pairs, two_i = gate_up.shape
    inter = two_i // 2
    if gate_up.dtype != torch.float32 or inter % 128 or two_i % 2 or not gate_up.is_contiguous():
        raise ValueError(f"swiglu_fp8: need contiguous float32 [P, 2I], I % 128 == 0, got {gate_up.dtype} {tuple(gate_up.shape)}")
    if weight is not None and (weight.dtype != torch.float32 or tuple(weight.shape) != (pairs,)):
        raise ValueError(f"swiglu_fp8: weight must be float32 [{pairs}]")
    hq = torch.empty((pairs, inter), dtype=torch.float8_e4m3fn, device=gate_up.device)
    sh = torch.empty((pairs, inter // 128), dtype=torch.float32, device=gate_up.device)
    if pairs:
        weight = weight.contiguous() if weight is not None else None
        get_kernel("act_quant", "swiglu_act_quant_f32", gate_up.device)(
            (math.ceil(pairs * (inter // 128) / 8), 1, 1), 256,  # a warp a 128-block of h
            [ptr(gate_up), ptr(weight), ptr(hq), ptr(sh), ctypes.c_int(pairs), ctypes.c_int(inter), ctypes.c_float(limit)],
        )
    return hq, sh
