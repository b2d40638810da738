"""mHC kernels against layers.HyperConnection.coefficients and layers.hc_expand (reference
numerics: float64 sums, Sinkhorn in float64, float32 coefficients) at V4-Flash shapes: 4 streams
of 4096, 20 Sinkhorn iterations."""

from __future__ import annotations

import pytest
import torch
from gpu_checks import compare

from dsuf.gpu.mhc import HcSite, hc_expand
from dsuf.model.layers import HyperConnection
from dsuf.model.layers import hc_expand as ref_hc_expand

N, D, EPS, HC_EPS, ITERS = 4, 4096, 1e-6, 1e-6, 20


def streams(tokens: int, device) -> torch.Tensor:
    return (torch.randn(tokens, N, D, device=device) * torch.exp(torch.randn(tokens, N, 1, device=device))).to(torch.bfloat16)


@pytest.mark.parametrize("tokens", [1, 8, 32, 600])  # 600: a prompt chunk (the mixes in torch)
def test_hc_coefficients(cuda, tokens):
    fn = torch.randn((2 + N) * N, N * D, device=cuda) / 128  # mixes of order 1
    base = torch.randn((2 + N) * N, device=cuda)
    scale = torch.rand(3, device=cuda) + 0.5
    x = streams(tokens, cuda)
    ref = HyperConnection(fn, base, scale).coefficients(x, EPS, HC_EPS, ITERS)
    got = HcSite(fn, base, scale, EPS, HC_EPS, ITERS).coefficients(x)
    for name, g, r in zip(("pre", "post", "comb"), got, ref):
        ulps = ((g.double() - r.double()).abs() / (r.double().abs() * 2.0**-23)).max()
        print(f"\n  hc {name} x {tokens}: max {float(ulps):.1f} float32 ulp")
        assert float(ulps) <= 4.0, name  # float64 sums in another order, then one rounding
    assert bool((got[2].sum(dim=-2) - 1).abs().max() < 1e-3), "comb columns must sum to ~1"


@pytest.mark.parametrize("tokens", [1, 8])
def test_hc_expand(cuda, tokens):
    x = streams(tokens, cuda)
    out = (torch.randn(tokens, D, device=cuda) * 2).to(torch.bfloat16)
    post = 2 * torch.rand(tokens, N, device=cuda)
    comb = torch.softmax(torch.randn(tokens, N, N, device=cuda), dim=-1)
    got = hc_expand(out, x, post, comb)
    ref = ref_hc_expand(out, x, post, comb)
    _, worst = compare(f"hc_expand [{tokens}, {N}, {D}]", got, ref)
    assert (got == ref).float().mean() > 0.9999 and worst <= 1.0
