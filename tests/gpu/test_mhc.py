"""mHC kernels against layers.HyperConnection.coefficients and layers.hc_expand (reference
numerics: float64 sums, Sinkhorn in float64, float32 coefficients) at V4-Flash shapes: 4 streams
of 4096, 20 Sinkhorn iterations."""

from __future__ import annotations

import pytest
import torch
from gpu_checks import compare

from dsuf.gpu.linear import act_quant
from dsuf.gpu import mhc as gpu_mhc
from dsuf.gpu.mhc import HcSite, hc_expand
from dsuf.gpu.norm import hc_block_input
from dsuf.model.layers import HyperConnection, f64, hc_collapse, rms_norm
from dsuf.model.layers import hc_expand as ref_hc_expand

N, D, EPS, HC_EPS, ITERS = 4, 4096, 1e-6, 1e-6, 20


def streams(tokens: int, device) -> torch.Tensor:
    return (torch.randn(tokens, N, D, device=device) * torch.exp(torch.randn(tokens, N, 1, device=device))).to(torch.bfloat16)


def site(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fn = torch.randn((2 + N) * N, N * D, device=device) / 128  # mixes of order 1
    return fn, torch.randn((2 + N) * N, device=device), torch.rand(3, device=device) + 0.5


def assert_coefficients_close(got, ref, what: str, names=("pre", "post", "comb")) -> None:
    for name, g, r in zip(names, got, ref):
        ulps = ((g.double() - r.double()).abs() / (r.double().abs() * 2.0**-23)).max()
        print(f"\n  hc {name} {what}: max {float(ulps):.1f} float32 ulp")
        assert float(ulps) <= 4.0, name  # float64 sums in another order, then one rounding
    assert bool((got[-1].sum(dim=-2) - 1).abs().max() < 1e-3), "comb columns must sum to ~1"


@pytest.mark.parametrize("tokens", [1, 8, 32, 600, 517])  # 600, 517: prompt chunks (hc_chunk_mixes; 517: a partial CTA)
def test_hc_coefficients(cuda, tokens):
    fn, base, scale = site(cuda)
    x = streams(tokens, cuda)
    ref = HyperConnection(fn, base, scale).coefficients(x, EPS, HC_EPS, ITERS)
    got = HcSite(fn, base, scale, EPS, HC_EPS, ITERS).coefficients(x)
    assert_coefficients_close(got, ref, f"x {tokens}")


@pytest.mark.parametrize("ctas", [2, 4, 8])
def test_a_chunks_mixes_over_clusters_of_ctas_are_one_ctas(cuda, monkeypatch, ctas):
    """A prompt chunk of few 64-token tiles (here 10: the SMs would idle) has each tile's mixes
    summed by a cluster of CTAs, a share of the values each, rank 0 adding the others' sums in rank
    order: the float64 sums in another order, so the float32 mixes within an ulp of one CTA a
    tile's. The clusters are as large as let every tile's run at once (the driver's occupancy)."""
    fn, base, scale = site(cuda)
    x = streams(600, cuda)
    hc = HcSite(fn, base, scale, EPS, HC_EPS, ITERS)
    launched = []
    get_kernel = gpu_mhc.get_kernel
    monkeypatch.setattr(gpu_mhc, "get_kernel", lambda module, name, device: launched.append(name) or get_kernel(module, name, device))
    at_once = get_kernel("mhc", f"hc_chunk_mixes_s{ctas}", cuda).max_active_clusters(ctas, gpu_mhc.CHUNK_MIX_THREADS, cuda)
    print(f"\n  clusters of {ctas} CTAs at once: {at_once} ({ctas * at_once} of {torch.cuda.get_device_properties(cuda).multi_processor_count} SMs)")
    assert 10 <= at_once <= torch.cuda.get_device_properties(cuda).multi_processor_count // ctas
    monkeypatch.setattr(gpu_mhc, "CHUNK_MIX_CLUSTERS", (ctas, 1))
    split = hc._chunk_mixes(x)
    monkeypatch.setattr(gpu_mhc, "CHUNK_MIX_CLUSTERS", (1,))
    one = hc._chunk_mixes(x)
    assert launched == [f"hc_chunk_mixes_s{ctas}", "hc_chunk_mixes"]
    ulps = ((split.double() - one.double()).abs() / (one.double().abs() * 2.0**-23)).max()
    print(f"  chunk mixes, clusters of {ctas} vs a CTA a tile: max {float(ulps):.1f} float32 ulp, {(split == one).float().mean():.4f} equal")
    assert float(ulps) <= 1.0 and (split == one).float().mean() > 0.9


# 1, 3 and 8: decode (mixes and block input in one launch); 20: more tokens than hc_mixes has CTAs
# a row (each takes several), then the collapse kernel; 600: a prompt chunk (coefficients, then the
# collapse kernel).
@pytest.mark.parametrize("tokens", [1, 3, 8, 20, 600])
def test_block_input_is_the_norm_of_the_collapse(cuda, tokens):
    """A site's block input rms_norm(hc_collapse(x, pre)) with post and comb for its expand, as the
    reference computes them (the Sinkhorn on a side stream)."""
    fn, base, scale = site(cuda)
    x = streams(tokens, cuda)
    w = 1 + 0.2 * torch.randn(D, device=cuda)
    pre, post, comb = HyperConnection(fn, base, scale).coefficients(x, EPS, HC_EPS, ITERS)
    ref = rms_norm(hc_collapse(x, pre), w, EPS)
    got = HcSite(fn, base, scale, EPS, HC_EPS, ITERS).block_input(x, w, EPS)
    if got.ready is not None:
        torch.cuda.current_stream().wait_event(got.ready)
    _, worst = compare(f"block input [{tokens}, {N}, {D}]", got.y, ref)
    assert worst <= 1.0 and (got.y == ref).float().mean() > 0.999
    xq, sx = act_quant(got.y)  # what the block's FP8 linears take: made in the same launch
    assert torch.equal(got.yq[0].view(torch.uint8), xq.view(torch.uint8)) and torch.equal(got.yq[1], sx)
    assert_coefficients_close((got.post, got.comb), (post, comb), f"with the block input x {tokens}", names=("post", "comb"))


@pytest.mark.parametrize("tokens", [1, 8])
def test_block_input_in_one_launch_is_the_mixes_then_the_collapse(cuda, tokens, monkeypatch):
    """norm.hc_block_input (a decode site's mixes and block input in one launch) gives what the
    mixes kernel followed by hc_pre_collapse_rmsnorm gives: float64 sums in another order, so the
    mixes within a few float32 ulps and the block input bit for bit nearly everywhere."""
    fn, base, scale = site(cuda)
    x = streams(tokens, cuda)
    w = 1 + 0.2 * torch.randn(D, device=cuda)
    hc = HcSite(fn, base, scale, EPS, HC_EPS, ITERS)
    one = hc.block_input(x, w, EPS)
    monkeypatch.setattr(gpu_mhc, "FUSED_BLOCK_INPUT", False)
    two = hc.block_input(x, w, EPS)
    for got in (one, two):
        torch.cuda.current_stream().wait_event(got.ready)
    _, worst = compare(f"block input in one launch [{tokens}, {N}, {D}]", one.y, two.y)
    assert worst <= 1.0 and (one.y == two.y).float().mean() > 0.999
    assert_coefficients_close((one.post, one.comb), (two.post, two.comb), f"one launch against two, x {tokens}", names=("post", "comb"))


@pytest.mark.parametrize("tokens", [1, 8, 40])
def test_the_heads_collapse_and_norm_in_one_launch_are_the_reference_hyperheads(cuda, tokens):
    """The head's input: v4.HyperHead (a site's mixes and pre with four mix rows, no Sinkhorn, the
    collapse) then the final RMSNorm, by norm.hc_block_input over the head's fn [4, 4 D]: float64
    sums in another order, so bit for bit nearly everywhere (40 tokens: more than a site takes)."""
    fn, base, scale = torch.randn(N, N * D, device=cuda) / 128, torch.randn(N, device=cuda), torch.rand(1, device=cuda) + 0.5
    x = streams(tokens, cuda)
    w = 1 + 0.2 * torch.randn(D, device=cuda)
    pre = f64(torch.sigmoid, HyperConnection(fn, base, scale).mixes(x, EPS) * scale + base) + HC_EPS
    ref = rms_norm(hc_collapse(x, pre), w, EPS)
    got, _ = hc_block_input(x, fn, scale, base, HC_EPS, EPS, w, EPS)
    _, worst = compare(f"head input [{tokens}, {N}, {D}]", got, ref)
    assert worst <= 1.0 and (got == ref).float().mean() > 0.999


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
