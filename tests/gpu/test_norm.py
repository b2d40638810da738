"""RMSNorm kernels against layers.rms_norm / layers.hc_collapse (float64 statistics, so the
kernel should agree to the last bit nearly everywhere)."""

from __future__ import annotations

import pytest
import torch
from gpu_checks import compare

from dsuf.gpu.norm import hc_collapse_rms_norm, rms_norm
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


@pytest.mark.parametrize("tokens", [1, 8, 32])
def test_hc_collapse_rms_norm(cuda, tokens):
    x = torch.randn(tokens, 4, 4096, device=cuda).to(torch.bfloat16)
    pre = torch.sigmoid(torch.randn(tokens, 4, device=cuda)) + 1e-6  # mHC pre coefficients
    w = norm_weight(4096, cuda)
    out = hc_collapse_rms_norm(x, pre, w, EPS)
    ref = ref_rms_norm(hc_collapse(x, pre), w, EPS)
    rel, worst = compare(f"hc_collapse + rms_norm [{tokens}, 4, 4096]", out, ref)
    assert worst <= 1.0 and rel < 1e-4
    assert (out == ref).float().mean() > 0.999
