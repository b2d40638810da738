"""The MoE router against layers.MoE.route (reference numerics) at V4-Flash shapes: 256 experts,
D = 4096, top-6, route_scale 1.5; bias-corrected selection and the hash layers' tid2eid."""

from __future__ import annotations

import pytest
import torch

from dsuf.gpu.router import Router
from dsuf.model.layers import MoE

E, D, TOPK, SCALE, VOCAB = 256, 4096, 6, 1.5, 129280


@pytest.mark.parametrize("tokens", [1, 8, 32, 600])  # 600: a prompt chunk (the scores in torch)
@pytest.mark.parametrize("hashed", [False, True])
def test_router(cuda, tokens, hashed):
    gate = (torch.randn(E, D, device=cuda) * 0.02).to(torch.bfloat16)
    bias = torch.randn(E, device=cuda) * 0.1
    tid2eid = torch.rand(VOCAB, E, device=cuda).argsort(dim=-1)[:, :TOPK] if hashed else None
    x = (torch.randn(tokens, D, device=cuda) * torch.exp(torch.randn(D, device=cuda) * 0.5)).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (tokens,), device=cuda)
    ref_w, ref_idx = MoE(gate.double(), None if hashed else bias, tid2eid, [], None, TOPK, SCALE).route(x, ids)
    router = Router(gate, None if hashed else bias, tid2eid, TOPK, SCALE)
    w, idx = router(x, ids)
    # The same experts (the kernel orders ties by expert; torch.topk leaves them unspecified).
    ref_sorted, order = ref_idx.sort(dim=-1)
    got_sorted, got_order = idx.long().sort(dim=-1)
    assert torch.equal(got_sorted, ref_sorted)
    diff = (w.gather(1, got_order) - ref_w.gather(1, order)).abs()
    print(f"\n  router {tokens} tokens{' (hash)' if hashed else ''}: max |Δw| {float(diff.max()):.1e}")
    assert float(diff.max()) <= 2**-22 * float(ref_w.abs().max())
