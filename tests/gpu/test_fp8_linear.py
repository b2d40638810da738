"""FP8 activation quantisation and the block-scaled FP8 linear against the reference Linear in
reference numerics (float64 accumulation of the act-quantised input and dequantised weight)."""

from __future__ import annotations

import pytest
import torch
from gpu_checks import compare, random_activations, random_fp8_weight

from dsuf.gpu.dense import DENSE_MIN_ROWS
from dsuf.gpu.linear import Fp8Linear, act_quant
from dsuf.model import quant
from dsuf.model.layers import Linear, Numerics

# V4-Flash FP8 linears that run at decode: (out_features, in_features).
SHAPES = {
    "attn.wq_a": (1024, 4096),
    "attn.wkv": (512, 4096),
    "attn.wq_b": (32768, 1024),
    "attn.wo_b": (4096, 8192),
    "indexer.wq_b": (8192, 1024),
    "shared.w1": (2048, 4096),
    "shared.w2": (4096, 2048),
}


@pytest.mark.parametrize("m, k", [(1, 4096), (8, 4096), (32, 8192), (5, 1024)])
def test_act_quant_matches_reference(cuda, m, k):
    x = random_activations(m, k, cuda)
    xq, sx = act_quant(x)
    got = xq.float().view(m, k // 128, 128) * sx.unsqueeze(-1)
    ref = quant.act_quant_fp8(x, 128).float().view(m, k // 128, 128)
    assert torch.equal(got, ref), float((got - ref).abs().max())
    # The scales are DeepSeek's: powers of two with amax / scale in (224, 448].
    amax = x.float().view(m, k // 128, 128).abs().amax(-1).clamp_min(1e-4)
    assert torch.equal(torch.exp2(torch.log2(sx).round()), sx)
    assert bool(((amax / sx) <= 448).all())


def reference(w: torch.Tensor, s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """layers.Linear in reference numerics, before its bf16 rounding (float32 [M, N])."""
    return Linear(quant.dequant_fp8_weight(w, s, 128), act_block=128)(x, Numerics(), torch.float32)


@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma on sm_90a", "mma.sync"])
@pytest.mark.parametrize("m", [1, 8, 13, 32, 600, 1023])  # 600, 1023: prompt chunks, on cuBLAS (FP8 block scaling)
@pytest.mark.parametrize("name", list(SHAPES))
def test_fp8_linear(cuda, monkeypatch, name, m, wgmma):
    from dsuf.gpu import linear

    monkeypatch.setattr(linear, "GEMM_WGMMA", wgmma)
    n, k = SHAPES[name]
    w, s = random_fp8_weight(n, k, cuda)
    x = random_activations(m, k, cuda)
    lin = Fp8Linear(w, s)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=cuda)  # poison
    lin(x, out=out)
    ref = reference(w, s, x)
    rel, worst = compare(f"{name} [{n}, {k}] x {m} tokens", out, ref)
    # bf16 rounding alone gives ~1e-3 relative and 0.5 ulp; mma.sync sums each 128-block in fp32
    # in another order than the float64 reference. FP8 wgmma (a prompt chunk's cuBLAS GEMM; at
    # decode, the tile GEMM on sm_90a) keeps about 12 bits of each 32-product step's sum of
    # |products|, a few ulps where the output cancels (a wrong block scale moves it by tens).
    assert rel < 2.5e-3
    assert worst <= (4.0 if wgmma or m >= DENSE_MIN_ROWS else 1.0)
    assert torch.equal(lin(x), out), "not deterministic"


def test_a_prompt_chunk_off_hopper_takes_exact_bf16_copies(cuda, monkeypatch):
    """Where cuBLAS may not take 128-block scales (not sm_90a), a prompt chunk's FP8 linear
    multiplies exact bf16 copies of the activations' quantisation and the weight: within one
    rounding, as mma.sync's sums."""
    from dsuf.gpu import dense

    monkeypatch.setattr(dense, "device_arch", lambda device: "sm_100a")
    n, k = SHAPES["attn.wo_b"]
    w, s = random_fp8_weight(n, k, cuda)
    x = random_activations(600, k, cuda)
    rel, worst = compare(f"attn.wo_b [{n}, {k}] x 600 tokens, bf16 copies", Fp8Linear(w, s)(x), reference(w, s, x))
    assert rel < 2.5e-3 and worst <= 1.0


def test_fp8_linear_beyond_one_launch(cuda):
    """More than 32 tokens run as 32-token slices."""
    n, k = SHAPES["attn.wq_a"]
    w, s = random_fp8_weight(n, k, cuda)
    x = random_activations(70, k, cuda)
    rel, worst = compare("attn.wq_a x 70 tokens", Fp8Linear(w, s)(x), reference(w, s, x))
    assert rel < 2.5e-3 and worst <= 1.0


# Tensor-parallel shards (two ranks) that fp8_rows takes at decode: a CTA per 16-128 rows.
TP2_SHAPES = {"attn.wq_b / 2": (16384, 1024), "attn.wo_b / 2": (4096, 4096), "shared.w2 / 2": (4096, 1024)}


def rows_case(cuda, name: str, m: int):
    """(weight, scales, x, the linear, its poisoned output of fp8_rows' first launch) for a shape
    that fp8_rows takes."""
    from dsuf.gpu.linear import rows_per_cta, rows_shared_bytes, sm_count

    n, k = {**SHAPES, **TP2_SHAPES}[name]
    assert rows_per_cta(n, sm_count(cuda), lambda rows: rows_shared_bytes(rows, k, m)) is not None, "fp8_rows should take this shape"
    w, s = random_fp8_weight(n, k, cuda)
    x = random_activations(m, k, cuda)
    lin = Fp8Linear(w, s)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=cuda)  # poison
    lin(x, out=out)
    return w, s, x, lin, out


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("name", ["attn.wq_a", "attn.wkv", "indexer.wq_b", *TP2_SHAPES])
def test_fp8_rows_equals_the_reference(cuda, name, m):
    """The no-split-K kernel (fp8_rows.cu) on the shapes it takes, against the reference; tokens
    past m must not leak into the sums."""
    w, s, x, lin, out = rows_case(cuda, name, m)
    n, k = w.shape
    rel, worst = compare(f"fp8_rows {name} [{n}, {k}] x {m} tokens", out, reference(w, s, x))
    assert rel < 2.5e-3 and worst <= 1.0
    assert torch.equal(lin(x), out), "not deterministic"


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("name", ["attn.wo_b / 2", "attn.wq_a"])
def test_fp8_rows_quantises_bf16_input_as_act_quant(cuda, name, m):
    """From bf16 input, fp8_rows quantises each token's 128-blocks itself: the same output bits as
    act_quant's e4m3 values and scales fed to it (activations over several octaves, so that the
    blocks' scales differ)."""
    _, _, x, lin, fused = rows_case(cuda, name, m)
    assert torch.equal(fused, lin.forward_quantized(*act_quant(x)))
