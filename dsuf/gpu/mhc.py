"""Manifold-constrained hyper-connections at decode (kernels_cu/mhc.cu): one mHC site's
coefficients (`layers.HyperConnection.coefficients`) and the stream update (`layers.hc_expand`),
numerically the reference's (float64 sums, float32 rounding where it rounds). The collapse that
precedes every block is `norm.hc_collapse_rms_norm`. A prompt chunk's mixes are the reference's
own float64 matmul (cuBLAS), which beats the per-token kernel there."""

from __future__ import annotations

import ctypes

import torch

from dsuf.model.layers import HyperConnection

from .dense import DENSE_MIN_ROWS
from .runtime import get_kernel, ptr

HC_N = 4  # streams (hc_mult); the kernels are written for 4
MIX_THREADS = 512  # mirror of mhc.cu


class HcSite:
    """One mHC site: fn float32 [(2+n)·n, n·D], base float32 [(2+n)·n], scale float32 [3]."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float, hc_eps: float, iters: int) -> None:
        rows = (2 + HC_N) * HC_N
        if fn.dim() != 2 or fn.shape[0] != rows or fn.shape[1] % (8 * HC_N) or tuple(base.shape) != (rows,) or tuple(scale.shape) != (3,):
            raise ValueError(f"HcSite: shapes fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)} are not a {HC_N}-stream site")
        self.fn, self.base, self.scale = fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous()
        self.norm_eps, self.hc_eps, self.iters = norm_eps, hc_eps, iters

    def coefficients(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x bf16 [T, n, D] -> (pre float32 [T, n], post float32 [T, n], comb float32 [T, n, n])."""
        t, n, d = x.shape
        if x.dtype != torch.bfloat16 or n != HC_N or n * d != self.fn.shape[1]:
            raise ValueError(f"HcSite: need bf16 [T, {HC_N}, {self.fn.shape[1] // HC_N}], got {x.dtype} {tuple(x.shape)}")
        rows = self.fn.shape[0]
        x = x.contiguous()
        mix = torch.empty((t, rows), dtype=torch.float32, device=x.device)  # (the kernel's output)
        pre = torch.empty((t, n), dtype=torch.float32, device=x.device)
        post = torch.empty((t, n), dtype=torch.float32, device=x.device)
        comb = torch.empty((t, n, n), dtype=torch.float32, device=x.device)
        if t >= DENSE_MIN_ROWS:
            mix = HyperConnection(self.fn, self.base, self.scale).mixes(x, self.norm_eps).contiguous()
        elif t:
            get_kernel("mhc", "hc_mixes", x.device)(
                (rows, t, 1), MIX_THREADS, [ptr(x), ptr(self.fn), ptr(mix), ctypes.c_int(d), ctypes.c_double(self.norm_eps)]
            )
        if t:
            get_kernel("mhc", "hc_coefficients", x.device)(
                (t, 1, 1),
                32,
                [ptr(mix), ptr(self.scale), ptr(self.base), ptr(pre), ptr(post), ptr(comb), ctypes.c_float(self.hc_eps), ctypes.c_int(self.iters)],
            )
        return pre, post, comb


def hc_expand(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k · out + Σ_j comb[j, k] · X_j: out bf16 [T, D], x bf16 [T, n, D] -> bf16 [T, n, D]."""
    t, n, d = x.shape
    if out.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or n != HC_N or d % 2048 or tuple(out.shape) != (t, d):
        raise ValueError(f"hc_expand: need bf16 out [T, D] and x [T, 4, D], D % 2048 == 0; got {tuple(out.shape)}, {tuple(x.shape)}")
    y = torch.empty_like(x)
    if t:
        get_kernel("mhc", "hc_expand", x.device)(
            (d // 2048, t, 1),
            256,
            [ptr(out.contiguous()), ptr(x.contiguous()), ptr(post.float().contiguous()), ptr(comb.float().contiguous()), ptr(y), ctypes.c_int(d)],
        )
    return y
