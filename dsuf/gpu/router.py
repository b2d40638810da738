"""The MoE router at decode (kernels_cu/router.cu): `layers.MoE.route` on the GPU.

Scores s = sqrt(softplus(x W_gateᵀ)) (bf16 x and gate, float64 sums, float32 result); experts
are the top-k of s + bias (ties to the lower expert) or, on hash layers, the token's row of
tid2eid; weights = s[idx] / (Σ s[idx] + eps) · route_scale. Returns (weights float32 [T, k],
idx int32 [T, k]), the form `moe.Moe` takes. A prompt chunk's scores are the reference's own
float64 matmul (cuBLAS), which beats the per-token kernel there."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from dsuf.model.layers import acc_matmul, f64

from .dense import DENSE_MIN_ROWS
from .runtime import get_kernel, ptr

MAX_EXPERTS = 512
MAX_TOPK = 16


class Router:
    """gate bf16 [E, D]; bias float32 [E] (None on hash layers); tid2eid [vocab, k] (hash layers)."""

    def __init__(
        self,
        gate: torch.Tensor,
        bias: torch.Tensor | None,
        tid2eid: torch.Tensor | None,
        top_k: int,
        route_scale: float,
        route_eps: float = 0.0,
    ) -> None:
        experts, dim = gate.shape
        if gate.dtype != torch.bfloat16 or experts > MAX_EXPERTS or dim % 256 or not 1 <= top_k <= MAX_TOPK:
            raise ValueError(f"Router: need a bf16 gate [E <= {MAX_EXPERTS}, D % 256 == 0] and 1 <= top_k <= {MAX_TOPK}")
        if tid2eid is not None and (tid2eid.dim() != 2 or tid2eid.shape[1] != top_k):
            raise ValueError(f"Router: tid2eid must be [vocab, {top_k}]")
        self.gate = gate.contiguous()
        self.bias = bias.float().contiguous() if bias is not None else None
        self.tid2eid = tid2eid.to(torch.int32).contiguous() if tid2eid is not None else None
        self.top_k, self.route_scale, self.route_eps = top_k, route_scale, route_eps

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """sqrt(softplus(x W_gateᵀ)): float32 [T, E]."""
        experts, dim = self.gate.shape
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != dim:
            raise ValueError(f"Router: need bf16 x [T, {dim}], got {x.dtype} {tuple(x.shape)}")
        if x.shape[0] >= DENSE_MIN_ROWS:
            return f64(lambda z: F.softplus(z).sqrt(), acc_matmul(x, self.gate.double()))
        out = torch.empty((x.shape[0], experts), dtype=torch.float32, device=x.device)
        if x.shape[0]:
            get_kernel("router", "router_scores", x.device)(
                (experts, x.shape[0], 1),
                128,
                [ptr(x.contiguous()), ptr(self.gate), ptr(out), ctypes.c_int(x.shape[0]), ctypes.c_int(experts), ctypes.c_int(dim)],
            )
        return out

    def __call__(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x bf16 [T, D]; ids int64 [T] (hash layers) -> (weights float32 [T, k], idx int32 [T, k])."""
        return self.select(self.scores(x), ids)

    def select(self, scores: torch.Tensor, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts and their weights from the scores (float32 [T, E], as `scores` makes them):
        (weights, idx) as __call__ returns them."""
        tokens, experts = scores.shape
        if self.tid2eid is not None and (ids is None or ids.dtype != torch.int64 or tuple(ids.shape) != (tokens,)):
            raise ValueError(f"Router: a hash layer needs int64 token ids [{tokens}]")
        idx = torch.empty((tokens, self.top_k), dtype=torch.int32, device=scores.device)
        weights = torch.empty((tokens, self.top_k), dtype=torch.float32, device=scores.device)
        if tokens:
            hashed = self.tid2eid is not None
            get_kernel("router", "router_select", scores.device)(
                (tokens, 1, 1),
                32,
                [
                    ptr(scores), ptr(None if hashed else self.bias), ptr(self.tid2eid), ptr(ids.contiguous() if hashed else None),
                    ptr(idx), ptr(weights), ctypes.c_int(experts), ctypes.c_int(self.top_k),
                    ctypes.c_double(self.route_eps), ctypes.c_float(self.route_scale),
                ],
            )
        return weights, idx
