"""The prefill path's building blocks (dsuf.gpu.dense): bf16 copies of FP8 and FP4 weights and
FP8-quantised activations are the reference's dequantised values exactly; the SwiGLU is
layers.Expert's bit for bit; and the ops that switch to them for prompt chunks (FP8 linears, wo_a,
the MoE) keep their accuracy against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_checks import random_activations, random_fp4_weight, random_fp8_weight

from dsuf.gpu.dense import act_fake_quant, fp4_weight_bf16, fp8_weight_bf16, swiglu, swiglu_fp8
from dsuf.gpu.linear import act_quant, scale_bytes
from dsuf.gpu.moe import fp4_kernel_layout
from dsuf.model import quant
from dsuf.model.layers import f64

LIMIT = 10.0


@pytest.mark.parametrize("n, k", [(1024, 4096), (4096, 8192), (128, 128)])
def test_fp8_weight_copy_is_the_dequantised_weight(cuda, n, k):
    w, s = random_fp8_weight(n, k, cuda)
    assert torch.equal(fp8_weight_bf16(w, scale_bytes(s)), quant.dequant_fp8_weight(w, s, 128).to(torch.bfloat16))


def test_fp4_experts_copy_is_the_dequantised_weights_side_by_side(cuda):
    """Stacked experts in the kernel layout, written as w1 and w3 halves of one [E, 2N, K] buffer."""
    experts, n, k = 3, 256, 4096
    w1 = [random_fp4_weight(n, k, cuda) for _ in range(experts)]
    w3 = [random_fp4_weight(n, k, cuda) for _ in range(experts)]
    both = torch.full((experts, 2 * n, k), float("nan"), dtype=torch.bfloat16, device=cuda)
    for half, ws in enumerate((w1, w3)):
        packed = fp4_kernel_layout(torch.stack([w for w, _ in ws]))
        scales = torch.stack([scale_bytes(s) for _, s in ws])
        fp4_weight_bf16(packed, scales, out=both[:, half * n : (half + 1) * n])
        for e, (w, s) in enumerate(ws):
            assert torch.equal(both[e, half * n : (half + 1) * n], quant.dequant_fp4_weight(w, s).to(torch.bfloat16))


@pytest.mark.parametrize("m, k", [(1, 4096), (600, 4096), (37, 1024)])
def test_act_fake_quant_is_the_reference_fake_quant(cuda, m, k):
    x = random_activations(m, k, cuda)
    assert torch.equal(act_fake_quant(x), quant.act_quant_fp8(x, 128).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routed", [True, False])
def test_swiglu_is_the_reference_experts(cuda, dtype, routed):
    pairs, inter = 300, 1024
    gate_up = (torch.randn(pairs, 2 * inter, device=cuda) * 6).to(dtype)  # many beyond the clamp
    weight = torch.rand(pairs, device=cuda) if routed else None
    gate, up = gate_up.float().split(inter, dim=1)
    h = f64(F.silu, gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT)
    ref = (weight[:, None] * h if routed else h).to(torch.bfloat16)
    assert torch.equal(swiglu(gate_up, LIMIT, weight), ref)


@pytest.mark.parametrize("routed", [True, False])
def test_swiglu_fp8_is_the_swiglu_act_quantised(cuda, routed):
    """The prompt experts' fused SwiGLU + FP8 quantisation: the same bytes and scales as act_quant
    of swiglu's bf16 output."""
    pairs, inter = 333, 1024
    gate_up = torch.randn(pairs, 2 * inter, device=cuda) * 6 * torch.exp2(torch.randint(-8, 8, (pairs, 1), device=cuda).float())
    weight = torch.rand(pairs, device=cuda) if routed else None
    hq, sh = swiglu_fp8(gate_up, LIMIT, weight)
    ref_q, ref_s = act_quant(swiglu(gate_up, LIMIT, weight))
    assert torch.equal(hq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(sh, ref_s)
