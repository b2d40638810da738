"""RMSNorm kernels against layers.rms_norm / layers.hc_collapse (float64 statistics, so the
kernel should agree to the last bit nearly everywhere)."""

from __future__ import annotations

import pytest
import torch
from gpu_checks import compare

from dsuf.gpu.linear import act_quant
from dsuf.gpu.norm import fp8_rows, hc_collapse_rms_norm, rms_norm, rms_norm_fp8
from dsuf.model.layers import hc_collapse
from dsuf.model.layers import rms_norm as ref_rms_norm

EPS = 1e-6  # V4-Flash norm_eps


def norm_weight(d: int, device) -> torch.Tensor:
    """A checkpoint-like norm weight: bf16 values near 1, held in float32 (as v4.py loads it)."""
    return (1 + 0.2 * torch.randn(d, device=device)).to(torch.bfloat16).float()


@pytest.mark.parametrize(
    "what, rows, d, weighted",
    [
        ("attn_norm", 1, 4096, True),
        ("attn_norm", 8, 4096, True),
        ("q_norm", 8, 1024, True),
        ("kv_norm", 8, 512, True),
        ("per-head q", 8 * 64, 512, False),
        ("per-head q, a prompt chunk: a warp a row", 40 * 64, 512, False),
        ("kv_norm, a prompt chunk: a warp a row, the last CTA part-filled", 2051, 512, True),
    ],
)
def test_rms_norm(cuda, what, rows, d, weighted):
    x = (torch.randn(rows, d, device=cuda) * torch.exp(torch.randn(rows, 1, device=cuda))).to(torch.bfloat16)
    w = norm_weight(d, cuda) if weighted else None
    out = rms_norm(x, w, EPS)
    ref = ref_rms_norm(x, w, EPS)
    rel, worst = compare(f"rms_norm {what} [{rows}, {d}]", out, ref)
    assert worst <= 1.0 and rel < 1e-4
    assert (out == ref).float().mean() > 0.999


def assert_same_fp8(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    """Bit for bit the same e4m3 values and scales."""
    (gq, gs), (wq, ws) = got, want
    diff = (gq.view(torch.uint8) != wq.view(torch.uint8)).sum().item()
    print(f"{what}: {diff} of {wq.numel()} e4m3 bytes differ, scales equal: {torch.equal(gs, ws)}")
    assert diff == 0 and torch.equal(gs, ws)


# q_norm (1024: whole warps a 256-column pass), attn_norm (4096), and 384 (a 128-block ends
# halfway through a warp: the half-warps of one warp quantise different blocks); from 2048 rows
# of at most 1024, a warp a row.
@pytest.mark.parametrize("rows, d", [(1, 1024), (8, 1024), (3, 4096), (5, 384), (2051, 1024), (2048, 384)])
def test_rms_norm_fp8_is_act_quant_of_the_norm(cuda, rows, d):
    """The norm's output FP8-quantised in the same launch, as act_quant quantises the bf16 norm
    (the q path hands it straight to wq_b)."""
    x = (torch.randn(rows, d, device=cuda) * torch.exp(torch.randn(rows, 1, device=cuda))).to(torch.bfloat16)
    w = norm_weight(d, cuda)
    assert_same_fp8(rms_norm_fp8(x, w, EPS), act_quant(rms_norm(x, w, EPS)), f"rms_norm_fp8 [{rows}, {d}]")


@pytest.mark.parametrize("tokens", [1, 8, 32])
def test_hc_collapse_rms_norm(cuda, tokens):
    x = torch.randn(tokens, 4, 4096, device=cuda).to(torch.bfloat16)
    pre = torch.sigmoid(torch.randn(tokens, 4, device=cuda)) + 1e-6  # mHC pre coefficients
    w = norm_weight(4096, cuda)
    quantized = fp8_rows(tokens, 4096, cuda)
    out = hc_collapse_rms_norm(x, pre, w, EPS, fp8_out=quantized)
    ref = ref_rms_norm(hc_collapse(x, pre), w, EPS)
    rel, worst = compare(f"hc_collapse + rms_norm [{tokens}, 4, 4096]", out, ref)
    assert worst <= 1.0 and rel < 1e-4
    assert (out == ref).float().mean() > 0.999
    assert_same_fp8(quantized, act_quant(out), f"hc_collapse + rms_norm fp8_out [{tokens}]")


@pytest.mark.parametrize(
    "shape, weighted", [((8, 32, 512), False), ((8, 64, 512), False), ((1, 512), True), ((8, 512), True), ((40, 64, 512), False), ((2051, 512), True)]
)
def test_rms_norm_with_rope_is_the_norm_then_the_rotation(cuda, shape, weighted):
    """The per-head q norm and the kv norm, each with its RoPE in the same launch: bit for bit
    what rms_norm then the reference's rotation give (rows of one position share its cos / sin)."""
    from dsuf.model.layers import Rope

    positions = shape[0]
    x = (torch.randn(shape, device=cuda) * torch.exp(torch.randn(*shape[:-1], 1, device=cuda))).to(torch.bfloat16)
    w = norm_weight(shape[-1], cuda) if weighted else None
    rope = Rope(64, 10000.0)
    rope.freqs = rope.freqs.to(cuda)
    cos, sin = rope.cos_sin(torch.randint(0, 1 << 16, (positions,), device=cuda))
    fused = rms_norm(x, w, EPS, rope=(cos, sin))
    apart = rope.apply(rms_norm(x, w, EPS).view(positions, -1, shape[-1]), (cos, sin)).view(shape)
    assert torch.equal(fused, apart)
