"""Comparison helpers for the GPU kernel tests."""

from __future__ import annotations

import torch

from dsuf.model import quant


def bf16_ulp(ref: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |ref| (8 significant bits), floored at the smallest normal."""
    _, exponent = torch.frexp(ref.double().abs())
    return torch.ldexp(torch.ones_like(ref, dtype=torch.float64), exponent - 8).clamp_min(2.0**-133)


def compare(name: str, out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Print the error of out against ref and return (‖out − ref‖ / ‖ref‖, worst), where worst is
    max |out − ref| / (1 bf16 ulp of ref + 1e-3 rms(ref)): at most 1 means every element is within
    one rounding of the reference, or within 1e-3 rms where ref is near zero and cancellation
    makes ulps meaningless."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not out.isnan().any(), f"{name}: NaN in the output (an element left unwritten?)"
    diff = (out.double() - ref.double()).abs()
    ref64 = ref.double()
    rms = float(ref64.pow(2).mean().sqrt())
    rel = float(diff.norm() / ref64.norm())
    ulp = bf16_ulp(ref)
    worst = float((diff / (ulp + 1e-3 * rms)).max())
    over = int((diff > ulp).sum())
    print(f"\n  {name}: rel err {rel:.2e}, max {float((diff / ulp).max()):.2f} bf16 ulp, {over} elements over 1 ulp, worst {worst:.2f}")
    return rel, worst


def random_fp8_weight(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight [n, k] with E8M0 128x128 scales spread over a few octaves per block."""
    octave = torch.randint(-3, 3, (-(-n // 128), -(-k // 128)), device=device).float()
    spread = torch.exp2(octave).repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return quant.quant_fp8_weight(torch.randn(n, k, device=device) * 0.02 * spread, 128)


def random_fp4_weight(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random packed e2m1 weight [n, k/2] (int8) with E8M0 per-32 scales."""
    rows = torch.exp2(torch.randint(-2, 2, (n, 1), device=device).float())
    return quant.quant_fp4_weight(torch.randn(n, k, device=device) * 0.02 * rows, 32)


def random_activations(m: int, k: int, device: torch.device) -> torch.Tensor:
    """bf16 [m, k]: normal values with channel scales over a few octaves (as real hidden states,
    so the per-128 activation scales differ between blocks)."""
    channel = torch.exp(torch.randn(k, device=device) * 0.7)
    return (torch.randn(m, k, device=device) * channel).to(torch.bfloat16)


def state_tensors(state) -> list[torch.Tensor]:
    """Every tensor of a SequenceState (dsuf.model.state), layer by layer, in a fixed order; a
    compressor's scores as their finite values and where they are -inf (empty state rows), so
    that relative errors stay defined."""
    out = []
    for st in state.layers:
        out += [st.window, st.compressed] if st.compressed is not None else [st.window]
        for comp in (st.compressor, st.indexer):
            if comp is not None:
                empty = comp.score.isneginf()
                out += [comp.kv, comp.score.masked_fill(empty, 0), empty.float()]
        if st.index_keys is not None:
            out.append(st.index_keys)
    return out
