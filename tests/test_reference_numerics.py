"""`reference` numerics: DeepSeek's W8A8/W4A8 activation quantisation and KV fake-quants.

The codecs themselves are checked bit for bit in test_quant.py. Here the whole path is checked:
it stays close to `exact` on the same FP8/FP4 checkpoint, its three ways of feeding a sequence
agree with each other, and its FP4 indexer picks what the exact indexer picks far above chance.

How close is "close": every FP8 activation quantisation alone adds about 2.7 % RMS relative
noise (three mantissa bits), and a forward pass stacks dozens of them, so on this tiny random
model reference and exact differ by 3–6 % in the logits when the indexer selects everything
(prompts of at most 4 × index_topk tokens). A wrong scale, block or rounding rule shows up as
several times that. Past 16 tokens the FP4 indexer keys (one mantissa bit) legitimately pick
other entries than exact numerics would, so longer prompts are compared through the picks.
"""

from __future__ import annotations

import pytest
import torch

from dsuf.cli import run_logits
from dsuf.model import load_model
from dsuf.model.layers import Numerics
from dsuf.model.state import CompressorState

EXACT = Numerics("exact", torch.float32)
REFERENCE = Numerics("reference", torch.bfloat16)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir("default"))


def tokens(n: int, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_one_fp8_activation_quantisation_alone_costs_about_2_7_percent():
    """The noise floor behind the bound below: quantising a Gaussian activation once to e4m3
    (per-128 power-of-two scales) already moves it by ~2.7 % RMS, and so moves a linear's output
    by as much. A whole forward pass stacks dozens of these."""
    from dsuf.model import quant

    x = torch.randn(4096, 128, generator=torch.Generator().manual_seed(0))
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(1))
    err = rel_err(quant.act_quant_fp8(x, 128) @ w.T, x @ w.T)
    assert 0.024 < err < 0.029


@pytest.mark.parametrize("n", [1, 4, 9, 16])
def test_reference_stays_within_fp8_noise_of_exact(model, n):
    assert n <= 4 * model.config.index_topk  # the indexer selects every visible entry
    exact = run_logits(model, tokens(n), "prefill", 0, EXACT)
    ref = run_logits(model, tokens(n), "prefill", 0, REFERENCE)
    err = rel_err(ref, exact)
    print(f"T={n}: reference vs exact rel err {err:.3e}")
    assert 1e-3 < err < 8e-2  # quantisation really happens, and only as much as FP8 allows


def test_quantisation_can_be_told_apart_from_a_wrong_scale(model, monkeypatch):
    """The bound above is tight enough to catch a gross fake-quant mistake, such as activations
    quantised to the FP4 grid instead of FP8."""
    import dsuf.model.layers as layers
    from dsuf.model import quant

    exact = run_logits(model, tokens(9), "prefill", 0, EXACT)

    def wrong_format(x: torch.Tensor, block: int) -> torch.Tensor:
        return quant.fp4_fake_quant_ue8m0(x, block)  # e2m1 where e4m3 belongs

    monkeypatch.setattr(layers.quant, "act_quant_fp8", wrong_format)
    wrong = run_logits(model, tokens(9), "prefill", 0, REFERENCE)
    print(f"FP4 activations: rel err {rel_err(wrong, exact):.3e}")
    assert rel_err(wrong, exact) > 8e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_chunked_and_decode_agree(model, dtype):
    num = Numerics("reference", dtype)
    seq = tokens(64)
    prefill = run_logits(model, seq, "prefill", 0, num)
    for mode, chunk in (("chunked", 5), ("chunked", 13), ("decode", 1)):
        err = rel_err(run_logits(model, seq, mode, chunk, num), prefill)
        print(f"{dtype} {mode}({chunk}) vs prefill: {err:.2e}")
        assert err < 1e-5


def test_fp4_indexer_picks_agree_with_exact_far_above_chance(model):
    c = model.config
    attn = model.layers[2].attn
    assert model.config.layer_kind(2) == "csa"
    T = 400
    g = torch.Generator().manual_seed(3)
    x, qr = torch.randn(T, c.dim, generator=g), torch.randn(T, c.q_lora_rank, generator=g)
    positions = torch.arange(T)
    picks = {}
    for num in (Numerics("exact", torch.bfloat16), REFERENCE):
        keys = attn.indexer.compressor(x.to(num.dtype), 0, CompressorState.new(4, c.index_head_dim), num)
        picks[num.mode] = attn.indexer.select(x.to(num.dtype), qr.to(num.dtype), positions, attn.rope.cos_sin(positions), keys, num)
    full = picks["exact"].sum(dim=1) == c.index_topk  # queries that really had to choose
    agreement = float((picks["exact"] & picks["reference"])[full].sum() / picks["exact"][full].sum())
    chance = float((c.index_topk / ((positions + 1) // 4)[full].float()).mean())
    print(f"indexer agreement {agreement:.2f}, chance {chance:.2f}")
    assert agreement > 0.7 and agreement > 4 * chance
