"""Building blocks shared by the DeepSeek model families, written for the reference path.

Weights are held dequantised (FP8/FP4 values times power-of-two scales are exact in any float
format), so one loaded model can run either numerics mode:

- `exact`: no activation quantisation and no KV fake-quants; activations in the chosen dtype.
- `reference`: DeepSeek's numerics — per-block FP8 activation quantisation before FP8/FP4 linears
  (W8A8/W4A8 with fp32 accumulation and bf16 output), fake-quantised caches, bf16 between modules.

Batch invariance: every reduction (matmuls, norms, softmax sums) accumulates in float64, and
every transcendental function (exp, sigmoid, silu, softplus, cos, sin) is evaluated in float64 —
CPU kernels compute the vectorised body and the scalar tail of a tensor differently — then the
result is rounded to float32 where the reference holds an fp32 value. A row's result then does
not depend on which other rows share the call, so prefill, chunked prefill, decode and any mix
of sequences in one batch give the same numbers, and FP8 rounding cannot amplify
accumulation-order noise into different outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from . import quant

NumericsMode = Literal["exact", "reference"]
ACC = torch.float64  # accumulation dtype of the reference path (see the module docstring)


def acc_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ wᵀ accumulated in float64 (w already float64), rounded to float32."""
    return F.linear(x.to(ACC), w).float()


def f64(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) evaluated in float64, rounded to float32 (see the module docstring)."""
    return fn(x.to(ACC)).float()


@dataclass(frozen=True)
class Numerics:
    mode: NumericsMode = "reference"
    dtype: torch.dtype = torch.bfloat16  # activations between modules

    @property
    def quantize(self) -> bool:
        return self.mode == "reference"

    @staticmethod
    def parse(mode: str, dtype: str | None = None) -> "Numerics":
        if mode not in ("exact", "reference"):
            raise ValueError(f"numerics must be 'exact' or 'reference', got {mode!r}")
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        if dtype is None:
            dtype = "bfloat16" if mode == "reference" else "float32"
        if dtype not in dtypes:
            raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
        return Numerics(mode, dtypes[dtype])  # type: ignore[arg-type]


class Linear:
    """y = x Wᵀ (fp32 result, rounded to the output dtype); in reference mode the input is
    FP8-quantised per block first when the checkpoint stores W in FP8/FP4 (`act_block` set), as
    DeepSeek's kernels do."""

    def __init__(self, weight: torch.Tensor, act_block: int | None = None) -> None:
        self.weight = weight.to(ACC)
        self.act_block = act_block

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor, num: Numerics, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if num.quantize and self.act_block:
            x = quant.act_quant_fp8(x, self.act_block)
        return acc_matmul(x, self.weight).to(out_dtype or num.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32, weight applied in float32, result in x's dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.to(ACC).square().mean(-1, keepdim=True) + eps).float()
    if weight is not None:
        x = weight * x
    return x.to(dtype)


# ---- rotary embeddings ---------------------------------------------------------------------------


class Rope:
    """GPT-J style (interleaved pairs) rotary embedding on the trailing `dim` channels, with
    optional YaRN frequency blending. Angles are pos · f computed in float32, as in the reference."""

    def __init__(self, dim: int, base: float, yarn: tuple[float, int, float, float] | None = None) -> None:
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if yarn is not None:
            factor, original_len, beta_fast, beta_slow = yarn

            def correction_dim(rotations: float) -> float:
                return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(correction_dim(beta_fast)), 0)
            high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
            if low == high:
                high += 0.001
            ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
            freqs = freqs / factor * ramp + freqs * (1 - ramp)
        self.dim = dim
        self.freqs = freqs

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.outer(positions.to(torch.float32), self.freqs)
        return f64(torch.cos, angles), f64(torch.sin, angles)

    def apply(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], inverse: bool = False) -> torch.Tensor:
        """Rotate x[..., -dim:]; x is [T, ..., C] and cos/sin are [T, dim/2]."""
        cos, sin = cos_sin
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if inverse:
            sin = -sin
        rope = x[..., -self.dim :].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
        return torch.cat((x[..., : -self.dim], rotated.to(x.dtype)), dim=-1)


# ---- manifold-constrained hyper-connections (mHC) -----------------------------------------------


@dataclass
class HyperConnection:
    """One mHC site: `fn` [(2+n)·n, n·D] (held in float64 for the accumulation), `base`
    [(2+n)·n] and `scale` [3] in float32."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        self.fn = self.fn.to(ACC)  # once at load, not on every step

    def mixes(self, x: torch.Tensor, norm_eps: float) -> torch.Tensor:
        """x [T, n, D] → [T, (2+n)·n]: one RMS statistic over all n·D values, matmul first."""
        flat = x.flatten(1).to(ACC)
        rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
        return F.linear(flat, self.fn).float() * rsqrt.float()

    def coefficients(
        self, x: torch.Tensor, norm_eps: float, hc_eps: float, iters: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """pre [T, n], post [T, n] and the doubly-stochastic comb [T, n, n] (Sinkhorn, fp32)."""
        n = x.shape[1]
        mix = self.mixes(x, norm_eps)
        pre = f64(torch.sigmoid, mix[:, :n] * self.scale[0] + self.base[:n]) + hc_eps
        post = 2 * f64(torch.sigmoid, mix[:, n : 2 * n] * self.scale[1] + self.base[n : 2 * n])
        logits = (mix[:, 2 * n :] * self.scale[2] + self.base[2 * n :]).view(-1, n, n)
        comb = torch.softmax(logits.to(ACC), dim=-1) + hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        return pre, post, comb.float()


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """y = Σ_i pre_i · X_i in float32, cast to the stream dtype."""
    return (pre.unsqueeze(-1).to(ACC) * x.to(ACC)).sum(dim=1).float().to(x.dtype)


def hc_expand(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k · out + Σ_j comb[j, k] · X_j, in float32 and rounded once."""
    mixed = torch.einsum("tjk,tjd->tkd", comb.to(ACC), residual.to(ACC))
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed.float()).to(residual.dtype)


# ---- attention ------------------------------------------------------------------------------------


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float, num: Numerics
) -> torch.Tensor:
    """Single-KV-head attention with per-head sinks: q [T, H, d], keys (= values) [L, d],
    mask [T, L] (True = attend). The sink adds exp(sink − max) to the denominator only; in
    reference mode probabilities are rounded to the activation dtype before PV, as the kernel does."""
    k = keys.to(ACC)
    scores = torch.einsum("thd,ld->thl", q.to(ACC), k).float() * scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    probs = f64(torch.exp, scores - peak)
    denom = probs.to(ACC).sum(dim=-1).float() + f64(torch.exp, sink.unsqueeze(0) - peak.squeeze(-1))
    if num.quantize:
        probs = probs.to(num.dtype)
    out = torch.einsum("thl,ld->thd", probs.to(ACC), k).float() / denom.unsqueeze(-1)
    return out.to(num.dtype)


# ---- mixture of experts ---------------------------------------------------------------------------


@dataclass
class Expert:
    """SwiGLU with the clamp (`limit` > 0): gate ≤ limit, up ∈ [−limit, limit]. The routing weight
    multiplies before w2 (so it is inside w2's input quantisation)."""

    w1: Linear
    w2: Linear
    w3: Linear
    limit: float

    def __call__(self, x: torch.Tensor, num: Numerics, weight: torch.Tensor | None = None) -> torch.Tensor:
        gate = self.w1(x, num, torch.float32)
        up = self.w3(x, num, torch.float32)
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        h = f64(F.silu, gate) * up
        if weight is not None:
            h = weight * h
        return self.w2(h.to(num.dtype), num)


@dataclass
class MoE:
    """sqrt-softplus scoring; top-k on score + bias (or a fixed tid2eid table for hash layers);
    weights = normalised scores × route_scale; routed experts plus the shared expert."""

    gate: torch.Tensor  # [E, D] float64
    bias: torch.Tensor | None  # [E] float32, noaux load-balancing correction (selection only)
    tid2eid: torch.Tensor | None  # [vocab, k] int64 for hash-routed layers
    experts: list[Expert]
    shared: Expert
    top_k: int
    route_scale: float

    def route(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = f64(lambda z: F.softplus(z).sqrt(), acc_matmul(x, self.gate))
        if self.tid2eid is not None:
            idx = self.tid2eid[ids]
        else:
            idx = (scores + self.bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        weights = weights / weights.to(ACC).sum(dim=-1, keepdim=True).float() * self.route_scale
        return weights, idx

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, num: Numerics) -> torch.Tensor:
        weights, idx = self.route(x, ids)
        y = torch.zeros(x.shape, dtype=torch.float32)
        for e in idx.unique().tolist():
            rows, slot = torch.where(idx == e)
            y[rows] += self.experts[e](x[rows], num, weights[rows, slot, None]).float()
        y += self.shared(x, num).float()
        return y.to(num.dtype)
