"""Manifold-constrained hyper-connections at decode (kernels_cu/mhc.cu): one mHC site's
coefficients (`layers.HyperConnection.coefficients`), the block input it collapses the streams
into (`HcSite.block_input`: rms_norm(hc_collapse(x, pre))) and the stream update
(`layers.hc_expand`), numerically the reference's (float64 sums, float32 rounding where it
rounds). A prompt chunk's mixes come from hc_chunk_mixes (64 tokens a CTA, on the float64
tensor cores; a chunk of few tiles, e.g. a short prompt's step or a rank's share of a split chunk,
over clusters of up to eight CTAs that share a tile's values), which beats the per-token kernel there."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from .dense import DENSE_MIN_ROWS
from .norm import HC_FUSED_TOKENS, Fp8Rows, fp8_rows, hc_block_input, hc_collapse_rms_norm, hc_pre_collapse_rms_norm
from .runtime import get_kernel, ptr

HC_N = 4  # streams (hc_mult); the kernels are written for 4
MIX_THREADS = 512  # mirror of mhc.cu
MIX_TOKEN_GROUPS = 8  # hc_mixes: CTAs a row of fn (each takes every 8th token)
CHUNK_MIX_TOKENS = 64  # hc_chunk_mixes: tokens a CTA (CM_TOKENS in mhc.cu)
CHUNK_MIX_THREADS = 256  # ... its threads (32 * CM_WARPS)
CHUNK_MIX_VALUES = 128  # ... fn values a row staged at a time (CM_CHUNK)
CHUNK_MIX_CLUSTERS = (8, 4, 2, 1)  # ... CTAs a tile it may take (its cluster kernels)
FUSED_BLOCK_INPUT = True  # decode sites' mixes and block input in one launch (tests compare both ways)


@dataclass
class BlockInput:
    """A site's block input y bf16 [T, D], y FP8-quantised for the block's FP8 linears (norm.fp8_rows;
    None where not asked for) and its expand coefficients post [T, n], comb [T, n, n]. With
    `ready`, post and comb are still being computed on another stream: wait on it first."""

    y: torch.Tensor
    yq: Fp8Rows | None
    post: torch.Tensor
    comb: torch.Tensor
    ready: torch.cuda.Event | None = None


class HcSite:
    """One mHC site: fn float32 [(2+n)·n, n·D], base float32 [(2+n)·n], scale float32 [3]."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float, hc_eps: float, iters: int) -> None:
        rows = (2 + HC_N) * HC_N
        if fn.dim() != 2 or fn.shape[0] != rows or fn.shape[1] % (8 * HC_N) or tuple(base.shape) != (rows,) or tuple(scale.shape) != (3,):
            raise ValueError(f"HcSite: shapes fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)} are not a {HC_N}-stream site")
        self.fn, self.base, self.scale = fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous()
        self.norm_eps, self.hc_eps, self.iters = norm_eps, hc_eps, iters
        self.side: torch.cuda.Stream | None = None  # block_input's Sinkhorn stream

    def _check(self, x: torch.Tensor) -> None:
        if x.dtype != torch.bfloat16 or x.dim() != 3 or x.shape[1] != HC_N or HC_N * x.shape[2] != self.fn.shape[1]:
            raise ValueError(f"HcSite: need bf16 [T, {HC_N}, {self.fn.shape[1] // HC_N}], got {x.dtype} {tuple(x.shape)}")

    @staticmethod
    def _outputs(t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Empty pre [T, n], post [T, n], comb [T, n, n]."""
        return (torch.empty((t, HC_N), dtype=torch.float32, device=device), torch.empty((t, HC_N), dtype=torch.float32, device=device),
                torch.empty((t, HC_N, HC_N), dtype=torch.float32, device=device))

    def _from_mixes(self, mix: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """pre, post, comb (into `out` if given) from the mixes float32 [T, 24]: the Sinkhorn kernel."""
        t = mix.shape[0]
        pre, post, comb = out or self._outputs(t, mix.device)
        if t:
            get_kernel("mhc", "hc_coefficients", mix.device)(
                ((t + 1) // 2, 1, 1),
                32,
                [ptr(mix), ptr(self.scale), ptr(self.base), ptr(pre), ptr(post), ptr(comb), ctypes.c_float(self.hc_eps), ctypes.c_int(self.iters),
                 ctypes.c_int(t)],
            )
        return pre, post, comb

    def coefficients(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x bf16 [T, n, D] -> (pre float32 [T, n], post float32 [T, n], comb float32 [T, n, n])."""
        self._check(x)
        x = x.contiguous()
        if x.shape[0] >= DENSE_MIN_ROWS:
            return self._from_mixes(self._chunk_mixes(x))
        return self._from_mixes(self._mixes(x))

    def _chunk_mixes(self, x: torch.Tensor) -> torch.Tensor:
        """A prompt chunk's mixes float32 [T, 24] of contiguous streams x (hc_chunk_mixes: the
        float64 sums of HyperConnection.mixes from the bf16 streams, no float64 copy of them)."""
        t, n, d = x.shape
        if n * d % CHUNK_MIX_VALUES:
            raise ValueError(f"hc_chunk_mixes: n * D must be a multiple of {CHUNK_MIX_VALUES}, got {n * d}")
        mix = torch.empty((t, self.fn.shape[0]), dtype=torch.float32, device=x.device)
        tiles = math.ceil(t / CHUNK_MIX_TOKENS)
        # CTAs a tile: as many as run at once, a CTA an SM (a CTA takes ~90 µs for its tile's 64
        # tokens whatever the chunk's length, so a chunk of few tiles would leave SMs idle).
        for per_tile in CHUNK_MIX_CLUSTERS:
            kernel = get_kernel("mhc", f"hc_chunk_mixes_s{per_tile}" if per_tile > 1 else "hc_chunk_mixes", x.device)
            if per_tile == 1 or (per_tile * CHUNK_MIX_VALUES <= n * d and tiles <= kernel.max_active_clusters(per_tile, CHUNK_MIX_THREADS, x.device)):
                break
        kernel((tiles, per_tile, 1), CHUNK_MIX_THREADS, [ptr(x), ptr(self.fn), ptr(mix), ctypes.c_int(n * d), ctypes.c_int(t), ctypes.c_double(self.norm_eps)])
        return mix

    def _mixes(self, x: torch.Tensor) -> torch.Tensor:
        """The site's mixes float32 [T, 24] of contiguous streams x (decode sizes)."""
        t, _, d = x.shape
        mix = torch.empty((t, self.fn.shape[0]), dtype=torch.float32, device=x.device)
        if t:
            get_kernel("mhc", "hc_mixes", x.device)(
                (self.fn.shape[0], min(t, MIX_TOKEN_GROUPS), 1),
                MIX_THREADS,
                [ptr(x), ptr(self.fn), ptr(mix), ctypes.c_int(d), ctypes.c_int(t), ctypes.c_double(self.norm_eps)],
                shared=self.fn.shape[1] * 4,
            )
        return mix

    def block_input(self, x: torch.Tensor, weight: torch.Tensor, eps: float, fp8: bool = True) -> BlockInput:
        """The block's input rms_norm(hc_collapse(x, pre), weight, eps) bf16 [T, D] from the
        streams x bf16 [T, n, D], also FP8-quantised (with `fp8`), and the site's post and comb
        for its expand.

        Below a prompt chunk's size the mixes and the block input (pre formed from the mixes)
        come from one launch at decode sizes (norm.hc_block_input), else from the mixes kernel and
        one that takes them, while the Sinkhorn for post and comb, which only the expand needs,
        runs on the site's side stream: BlockInput.ready says when."""
        self._check(x)
        t = x.shape[0]
        yq = fp8_rows(t, x.shape[2], x.device) if fp8 else None
        if t >= DENSE_MIN_ROWS or not t:
            pre, post, comb = self.coefficients(x)
            return BlockInput(hc_collapse_rms_norm(x, pre, weight, eps, fp8_out=yq), yq, post, comb)
        x = x.contiguous()
        if t <= HC_FUSED_TOKENS and FUSED_BLOCK_INPUT:
            y, mix = hc_block_input(x, self.fn, self.scale, self.base, self.hc_eps, self.norm_eps, weight, eps, fp8_out=yq)
        else:
            mix = self._mixes(x)
            y = hc_pre_collapse_rms_norm(x, mix, self.scale, self.base, self.hc_eps, weight, eps, fp8_out=yq)
        out = self._outputs(t, x.device)  # made on this stream, which uses post and comb later
        main = torch.cuda.current_stream(x.device)
        if self.side is None:
            self.side = torch.cuda.Stream(x.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            self._from_mixes(mix, out)
            ready = torch.cuda.Event()
            ready.record()
        for tensor in (mix, *out):
            tensor.record_stream(self.side)
        return BlockInput(y, yq, out[1], out[2], ready)


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
