"""The bf16-activation GEMVs (dsuf.gpu.gemv) against float64 products at V4-Flash decode shapes:
the compressors' bf16 projections (fp32 out) and wo_a's grouped FP8 projection (bf16 out), every
K split the kernels have. With -s: their times (CUDA-graph replay over weight copies larger than
L2, so every call streams from HBM) next to the torch calls they replace."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from gpu_checks import compare, random_activations

from dsuf.gpu.bench import graph_of_calls, replay_us
from dsuf.gpu.gemv import (
    BF16,
    FP8,
    SHARED_MAX,
    SPLITS,
    bf16_gemv,
    fp8_grouped_gemv,
    shared_bytes,
)
from dsuf.gpu.layer import has_mm_out_dtype
from dsuf.model import quant

D = 4096
PROJ = {"CSA": 2624, "HCA": 1024}  # compressor wkv + wgate (+ indexer compressor, weights_proj)
GROUPS, O_RANK = 8, 1024  # wo_a: 8 groups of [1024, 4096]
POOL = 384 << 20  # bytes of weight copies a timing rotates over: several times the 60 MB L2


def splits_for(fmt: str, m: int) -> list[int]:
    tokens = next(t for t in (8, 16, 32, 64) if t >= m)
    return [s for s in SPLITS if shared_bytes(fmt, tokens, D, s) <= SHARED_MAX]


def bf16_weight(n: int, device: torch.device) -> torch.Tensor:
    return (torch.randn(n, D, device=device) * D**-0.5).to(torch.bfloat16)


def wo_a_weight(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return quant.quant_fp8_weight(torch.randn(GROUPS * O_RANK, D, device=device) * D**-0.5, 128)


def einsum_wo_a(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference's wo_a on the dequantised weight w [G*N, K] (any dtype): [M, G*N]."""
    m = x.shape[0]
    return torch.einsum("tgd,grd->tgr", x.view(m, GROUPS, D), w.view(GROUPS, O_RANK, D)).flatten(1)


@pytest.mark.parametrize("m", [1, 2, 8, 33, 64])
@pytest.mark.parametrize("kind", list(PROJ))
def test_bf16_gemv(cuda, kind, m):
    n = PROJ[kind]
    w = bf16_weight(n, cuda)
    x = random_activations(m, D, cuda)
    ref = x.double() @ w.double().T
    if has_mm_out_dtype(cuda):
        torch_rel = float((torch.mm(x, w.t(), out_dtype=torch.float32).double() - ref).norm() / ref.norm())
        print(f"\n  torch.mm bf16 -> fp32 [{n}, {D}] x {m}: rel err {torch_rel:.2e}")
    for s in splits_for(BF16, m):
        out = torch.full((m, n), float("nan"), device=cuda)  # poison: every element must be written
        bf16_gemv(x, w, out=out, splits=s)
        assert not out.isnan().any()
        rel = float((out.double() - ref).norm() / ref.norm())
        print(f"  bf16_gemv {kind} [{n}, {D}] x {m}, {s} splits: rel err {rel:.2e}")
        assert rel < 1e-5  # fp32 accumulation of 4096 products: ~1e-6
        assert torch.equal(bf16_gemv(x, w, splits=s), out), "not deterministic"
    assert torch.equal(bf16_gemv(x, w), bf16_gemv(x, w))


@pytest.mark.parametrize("m", [1, 2, 8, 33, 64])
def test_fp8_grouped_gemv(cuda, m):
    w, s = wo_a_weight(cuda)
    w_bf16 = quant.dequant_fp8_weight(w, s, 128).to(torch.bfloat16)  # exact: e4m3 * 2**e
    x = random_activations(m, GROUPS * D, cuda)
    ref = einsum_wo_a(x.double(), w_bf16.double())
    _, torch_worst = compare(f"torch einsum (bf16 weight) x {m}", einsum_wo_a(x, w_bf16), ref)
    for splits in splits_for(FP8, m):
        out = torch.full((m, GROUPS * O_RANK), float("nan"), dtype=torch.bfloat16, device=cuda)
        fp8_grouped_gemv(x, w, s, GROUPS, out=out, splits=splits)
        rel, worst = compare(f"fp8_grouped_gemv wo_a x {m}, {splits} splits", out, ref)
        # One bf16 rounding of an fp32 sum: within 1 ulp of float64 (or the einsum's own error).
        assert rel < 2.5e-3
        assert worst <= max(1.0, torch_worst)
        assert torch.equal(fp8_grouped_gemv(x, w, s.view(torch.uint8), GROUPS, splits=splits), out), "not deterministic"


@pytest.mark.parametrize("m", [1, 3, 8])
def test_wo_a_of_a_tensor_parallel_rank_runs_a_cta_per_rows(cuda, m):
    """A rank's half of wo_a (4 of the 8 groups) at decode: fp8_rows_bf16x_m8 (rows in shared
    memory before the PDL wait, no split K), as exact as the cluster GEMV; tokens past m must not
    leak into the sums."""
    from dsuf.gpu.gemv import rows_bf16x_shared_bytes
    from dsuf.gpu.linear import rows_per_cta, sm_count

    groups = GROUPS // 2
    w, s = quant.quant_fp8_weight(torch.randn(groups * O_RANK, D, device=cuda) * D**-0.5, 128)
    assert rows_per_cta(groups * O_RANK, sm_count(cuda), lambda r: rows_bf16x_shared_bytes(r, D, m), divides=O_RANK) is not None
    w_bf16 = quant.dequant_fp8_weight(w, s, 128).to(torch.bfloat16)
    x = random_activations(m, groups * D, cuda)
    ref = torch.einsum("tgd,grd->tgr", x.double().view(m, groups, D), w_bf16.double().view(groups, O_RANK, D)).flatten(1)
    out = torch.full((m, groups * O_RANK), float("nan"), dtype=torch.bfloat16, device=cuda)  # poison
    fp8_grouped_gemv(x, w, s, groups, out=out)
    rel, worst = compare(f"fp8_rows_bf16x wo_a / 2 x {m}", out, ref)
    assert rel < 2.5e-3 and worst <= 1.0
    assert torch.equal(fp8_grouped_gemv(x, w, s, groups), out), "not deterministic"
    cluster = fp8_grouped_gemv(x, w, s, groups, splits=4)
    print(f"  against the cluster GEMV: {(cluster != out).sum().item()} of {out.numel()} outputs differ (one fp32 sum order each)")


def graph_us(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """µs per call: the calls (run once eagerly first) captured as one CUDA graph, median of `reps` replays."""
    for call in calls:
        call()
    return replay_us(graph_of_calls(calls), reps) / len(calls)


def copies(nbytes: int) -> int:
    return max(2, math.ceil(POOL / nbytes))


def report(name: str, nbytes: int, ours: dict[str, float], torch_name: str, torch_us: float) -> None:
    cells = [f"{k} {us:6.2f} µs {nbytes / us / 1e3:5.0f} GB/s" for k, us in ours.items()]
    print(f"\n  {name}: " + " | ".join(cells) + f" || {torch_name} {torch_us:6.2f} µs {nbytes / torch_us / 1e3:5.0f} GB/s")


def test_gemv_timings(cuda):
    for kind, n in PROJ.items():
        pool = [bf16_weight(n, cuda) for _ in range(copies(2 * n * D))]
        for m in (1, 8):
            x = random_activations(m, D, cuda)
            ours = {"default": graph_us([lambda w=w, x=x: bf16_gemv(x, w) for w in pool])}
            for s in splits_for(BF16, m):
                ours[f"s{s}"] = graph_us([lambda w=w, s=s, x=x: bf16_gemv(x, w, splits=s) for w in pool])
            if has_mm_out_dtype(cuda):
                torch_us = graph_us([lambda w=w, x=x: torch.mm(x, w.t(), out_dtype=torch.float32) for w in pool])
            else:
                torch_us = graph_us([lambda w=w, x=x: x.float() @ w.t().float() for w in pool])
            report(f"bf16_gemv {kind} [{n}, {D}] x {m}", 2 * n * D + 2 * m * D + 4 * m * n, ours, "torch.mm", torch_us)
        del pool

    pool = [wo_a_weight(cuda) for _ in range(copies(GROUPS * O_RANK * D))]
    w_bf16 = quant.dequant_fp8_weight(*pool[0], 128).to(torch.bfloat16)
    bf16_pool = [w_bf16.clone() for _ in range(copies(2 * GROUPS * O_RANK * D))]
    for m in (1, 8):
        x = random_activations(m, GROUPS * D, cuda)
        ours = {"default": graph_us([lambda w=w, x=x: fp8_grouped_gemv(x, *w, GROUPS) for w in pool])}
        for s in splits_for(FP8, m):
            ours[f"s{s}"] = graph_us([lambda w=w, s=s, x=x: fp8_grouped_gemv(x, *w, GROUPS, splits=s) for w in pool])
        torch_us = graph_us([lambda w=w, x=x: einsum_wo_a(x, w) for w in bf16_pool])
        nbytes = GROUPS * O_RANK * D + GROUPS * O_RANK * D // 128**2 + 2 * m * (GROUPS * D + GROUPS * O_RANK)
        report(f"fp8_grouped_gemv wo_a [{GROUPS}x{O_RANK}, {D}] x {m}", nbytes, ours, "torch einsum bf16", torch_us)


def test_fp8_grouped_gemv_of_a_prompt_chunk(cuda):
    """From DENSE_MIN_ROWS rows wo_a runs on cuBLAS over its bf16 copy: the reference's einsum."""
    from dsuf.gpu.dense import DENSE_MIN_ROWS

    m = DENSE_MIN_ROWS + 88
    w, s = wo_a_weight(cuda)
    w_bf16 = quant.dequant_fp8_weight(w, s, 128).to(torch.bfloat16)
    x = random_activations(m, GROUPS * D, cuda)
    ref = einsum_wo_a(x.double(), w_bf16.double())
    _, torch_worst = compare(f"torch einsum (bf16 weight) x {m}", einsum_wo_a(x, w_bf16), ref)
    out = torch.full((m, GROUPS * O_RANK), float("nan"), dtype=torch.bfloat16, device=cuda)
    fp8_grouped_gemv(x, w, s, GROUPS, out=out)
    rel, worst = compare(f"fp8_grouped_gemv wo_a x {m} (cuBLAS)", out, ref)
    assert rel < 2.5e-3 and worst <= max(1.0, torch_worst)
