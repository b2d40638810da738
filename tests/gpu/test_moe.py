"""The decode MoE (routed FP4 experts + FP8 shared expert) against layers.MoE / layers.Expert in
reference numerics, at V4-Flash shapes: D = 4096, moe_inter = 2048, top-6, swiglu_limit 10."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_checks import bf16_ulp, compare, random_activations, random_fp4_weight, random_fp8_weight

from dsuf.gpu.linear import act_quant
from dsuf.gpu.moe import Fp4Experts, Fp8Expert, Moe, fp4_kernel_layout
from dsuf.model import quant
from dsuf.model.layers import Expert, Linear, MoE, Numerics, f64

D, INTER, EXPERTS, TOPK, LIMIT = 4096, 2048, 8, 6, 10.0
NUM = Numerics()


@pytest.fixture(scope="module")
def moe_pair():
    """(kernel Moe, reference layers.MoE) over the same random checkpoint tensors."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    dev = torch.device("cuda")
    torch.seed()
    routed = {name: [] for name in ("w1", "s1", "w3", "s3", "w2", "s2")}
    experts = []
    for _ in range(EXPERTS):
        (w1, s1), (w3, s3) = random_fp4_weight(INTER, D, dev), random_fp4_weight(INTER, D, dev)
        w2, s2 = random_fp4_weight(D, INTER, dev)
        for name, t in zip(routed, (w1, s1, w3, s3, w2, s2)):
            routed[name].append(t.view(torch.uint8) if name[0] == "s" else t)  # stack E8M0 as bytes
        lin = [Linear(quant.dequant_fp4_weight(w, s), act_block=128) for w, s in ((w1, s1), (w2, s2), (w3, s3))]
        experts.append(Expert(*lin, LIMIT))
    (w1, s1), (w3, s3), (w2, s2) = (random_fp8_weight(INTER, D, dev), random_fp8_weight(INTER, D, dev), random_fp8_weight(D, INTER, dev))
    shared = Expert(
        *(Linear(quant.dequant_fp8_weight(w, s, 128), act_block=128) for w, s in ((w1, s1), (w2, s2), (w3, s3))), LIMIT
    )
    kernel = Moe(
        Fp4Experts.from_checkpoint(*(torch.stack(routed[n]) for n in routed)), Fp8Expert(w1, s1, w3, s3, w2, s2), LIMIT
    )
    reference = MoE(
        gate=(torch.randn(EXPERTS, D, device=dev) * 0.05).double(),
        bias=torch.randn(EXPERTS, device=dev) * 0.01,
        tid2eid=None,
        experts=experts,
        shared=shared,
        top_k=TOPK,
        route_scale=1.5,
    )
    return kernel, reference


def reference_moe(moe: MoE, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """MoE.__call__'s combine with its accumulator on x's device."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in idx.unique().tolist():
        rows, slot = torch.where(idx == e)
        y[rows] += moe.experts[e](x[rows], NUM, weights[rows, slot, None]).float()
    y += moe.shared(x, NUM).float()
    return y.to(torch.bfloat16)


def by_expert(idx: torch.Tensor, grouped: bool) -> torch.Tensor | None:
    """The pair order Moe uses with several tokens (sorted by expert), or none."""
    return torch.argsort(idx.reshape(-1), stable=True).int() if grouped else None


# How the decode kernels sum e4m3 products. "exact": mma.sync, which sm_90 runs as f16 HMMA with
# fp32 sums, exact for these products. "wgmma" (sm_90a, the default there): the FP4 experts' k-steps
# and the FP8 GEMM of up to 8 tokens (the shared expert) by wgmma, whose e4m3 sums keep about 12
# bits of the sum of |products| (measured on H200: at most 2.6e-4 of it over a k32 step, unbiased),
# as in DeepSeek's own FP8 GEMMs. Outputs stay within bf16 roundings of the reference, but a
# SwiGLU output h, rounded to e4m3 for w2, lands on the other side of a rounding more often; one
# e4m3 step (2^-3 relative) of one of a token's largest h elements (~4 rms) moves its w2 outputs
# by ~5e-3 of their norm (1/4 over sqrt(I)), single elements by up to ~1/30 of their rms. A wrong
# expert, row or weight moves every element of a token by far more.
@pytest.fixture(params=["exact", "wgmma"])
def sums(request, monkeypatch, cuda):
    from dsuf.gpu import linear
    from dsuf.gpu import moe as gpu_moe
    from dsuf.gpu.runtime import device_arch

    if request.param == "wgmma" and device_arch(cuda) != "sm_90a":
        pytest.skip("wgmma is sm_90a's")
    monkeypatch.setattr(gpu_moe, "FP4_PRODUCTS", "g" if request.param == "wgmma" else "u")
    monkeypatch.setattr(linear, "GEMM_WGMMA", request.param == "wgmma")
    return request.param


def assert_moe_output_close(name: str, out: torch.Tensor, ref: torch.Tensor, sums: str) -> None:
    """Outputs [tokens, D] against the reference: every element within two roundings
    (exact sums), except tokens whose h crossed an e4m3 rounding (see `sums`)."""
    rel, worst = compare(name, out, ref)
    if sums == "wgmma":  # a few such crossings a token
        assert rel < 2e-2 and worst <= 128.0
        return
    assert rel < 4e-3
    # Exact sums cross an h rounding only where the reference's float64 order does not (seen once
    # at 20 tokens on H200: 659 of 81,920 elements over 1 ulp, rel 6.8e-4; at 32 tokens of the
    # shared expert: worst 15.4; at 8 tokens of it, one token at 4.2): an eighth of the tokens.
    per_token = ((out.double() - ref.double()).abs() / (bf16_ulp(ref) + 1e-3 * ref.double().pow(2).mean().sqrt())).amax(dim=1)
    crossed = int((per_token > 2.0).sum())
    assert worst <= 2.0 or crossed <= out.shape[0] // 8, f"tokens beyond two roundings: {per_token.tolist()}"


@pytest.mark.parametrize("tokens, grouped", [(1, False), (8, False), (8, True)])
def test_routed_gate_up(cuda, moe_pair, sums, tokens, grouped):
    kernel, moe = moe_pair
    x = random_activations(tokens, D, cuda)
    weights, idx = moe.route(x, None)
    xq, sx = act_quant(x)
    hq, sh = kernel.routed_gate_up(xq, sx, idx.reshape(-1).int(), weights.reshape(-1), TOPK, by_expert(idx, grouped))
    got = hq.float() * sh.repeat_interleave(128, -1)
    ref = []
    for t in range(tokens):
        for j in range(TOPK):
            ex = moe.experts[int(idx[t, j])]
            gate = ex.w1(x[t : t + 1], NUM, torch.float32).clamp(max=LIMIT)
            up = ex.w3(x[t : t + 1], NUM, torch.float32).clamp(-LIMIT, LIMIT)
            h = weights[t, j] * (f64(F.silu, gate) * up)
            ref.append(quant.act_quant_fp8(h.to(torch.bfloat16), 128).float())
    ref = torch.cat(ref)
    rel, _ = compare(f"routed w1/w3 + SwiGLU + act_quant, {tokens} x {TOPK} pairs{', by expert' if grouped else ''}", got, ref)
    # Equal but where the sums put h on the other side of a bf16 / e4m3 rounding boundary.
    assert rel < (2e-3 if sums == "exact" else 1e-2)
    assert (got == ref).float().mean() > (0.998 if sums == "exact" else 0.99)


@pytest.mark.parametrize("tokens, grouped", [(1, False), (8, False), (8, True), (20, True)])
def test_routed_down(cuda, moe_pair, sums, tokens, grouped):
    """20 tokens over 8 experts: runs of more than 8 pairs of one expert are split."""
    kernel, moe = moe_pair
    idx = torch.stack([torch.randperm(EXPERTS, device=cuda)[:TOPK] for _ in range(tokens)])
    h = random_activations(tokens * TOPK, INTER, cuda)
    hq, sh = act_quant(h)
    out = torch.full((tokens * TOPK, D), float("nan"), dtype=torch.bfloat16, device=cuda)  # poison
    got = kernel.routed_down(hq, sh, idx.reshape(-1).int(), by_expert(idx, grouped), out=out)
    ref = torch.cat([moe.experts[int(e)].w2(h[p : p + 1], NUM, torch.float32) for p, e in enumerate(idx.reshape(-1))])
    rel, worst = compare(f"routed w2, {tokens} x {TOPK} pairs{', by expert' if grouped else ''}", got, ref)
    assert rel < 2.5e-3 and worst <= 1.0


def test_one_tokens_pairs_as_their_own_columns_give_the_bits_of_the_run_search(cuda, moe_pair, sums):
    """`distinct` (one token's top-k: no two pairs share an expert) skips the kernels' search for
    runs of one expert; the outputs are the search's, bit for bit."""
    kernel, moe = moe_pair
    x = random_activations(1, D, cuda)
    weights, idx = moe.route(x, None)
    xq, sx = act_quant(x)
    expert = idx.reshape(-1).int()
    outs = []
    for distinct in (False, True):
        hq, sh = kernel.routed_gate_up(xq, sx, expert, weights.reshape(-1), TOPK, None, distinct=distinct)
        outs.append((hq.view(torch.uint8), sh, kernel.routed_down(hq, sh, expert, None, distinct=distinct)))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("tokens", [1, 8, 32])
def test_shared_expert(cuda, moe_pair, sums, tokens):
    kernel, moe = moe_pair
    x = random_activations(tokens, D, cuda)
    xq, sx = act_quant(x)
    got = kernel.shared_forward(xq, sx)
    ref = moe.shared(x, NUM)  # bf16, as the reference rounds it
    assert_moe_output_close(f"shared expert x {tokens} tokens", got, ref, sums)


@pytest.mark.parametrize("tokens", [1, 8, 20])
def test_moe_decode(cuda, moe_pair, sums, tokens):
    kernel, moe = moe_pair
    x = random_activations(tokens, D, cuda)
    weights, idx = moe.route(x, None)
    out = torch.full((tokens, D), float("nan"), dtype=torch.bfloat16, device=cuda)  # poison
    kernel(x, weights, idx, out=out)
    assert_moe_output_close(f"MoE decode, {tokens} tokens x ({TOPK} routed + shared)", out, reference_moe(moe, x, weights, idx), sums)
    assert torch.equal(kernel(x, weights, idx), out), "not deterministic"


def spread_fp4_weight(experts: int, n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP4 experts (checkpoint layout: int8 [E, n, k/2], uint8 E8M0 [E, n, k/32]) whose
    32-element blocks' scales spread over 0 to PREFILL_OCTAVES octaves within each 128-element
    chunk, and one block in 16 all zero codes with a scale 40 octaves below: every offset
    moe_prefill_fp4 applies, and the blocks it may scale wrongly because they are zero."""
    from dsuf.gpu.moe import PREFILL_OCTAVES

    codes = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device=device)
    scales = torch.randint(120, 121 + PREFILL_OCTAVES, (experts, n, k // 32), dtype=torch.uint8, device=device)
    zero = torch.rand(experts, n, k // 32, device=device) < 1 / 16
    codes.view(experts, n, k // 32, 16).masked_fill_(zero.unsqueeze(-1), 0)
    scales.masked_fill_(zero, 80)
    return codes.view(torch.int8), scales


@pytest.mark.parametrize(
    "n, k, mats, ctas",
    [(INTER, D, 2, None), (INTER // 2, D, 2, None), (D, INTER // 2, 1, None), (INTER // 2, D, 2, 3), (D, INTER // 4, 1, 5)],
    ids=["gate and up", "a TP=2 rank's gate and up", "a TP=2 rank's down", "gate and up on 3 CTAs", "a TP=4 rank's down on 5 CTAs"],
)
def test_prefill_gemm_sums_are_the_products_within_wgmma_precision(cuda, n, k, mats, ctas):
    """moe_prefill_fp4 alone (sm_90a): gate and up (or one matrix: a tensor-parallel rank's down,
    K = 1024 or 512) of 667 pairs of eight experts against the float64 sums of the same products
    (the act-quantised activations and the dequantised FP4 weights). Expert 0 has 300 pairs
    (tiles of 128, 128 and 44: the m64n64 steps), expert 5 200 (128 and 72: a partial m64n128
    tile), experts 6, 3, 4, 1, 2 and 7 33, 64, 32, 17, 16 and 5 (either side of the m64n64,
    m64n32 and m64n16 steps' bounds; 5: one column group). The four k-steps of a chunk are summed
    in the tensor cores with each step's codes scaled exactly to the chunk's base (offsets up to
    12 octaves here); wgmma keeps about 12 bits of a 32-product step's sum of |products| and
    of the chunk's running sum, so every element is within 1e-3 of its sum of |products|; a
    misplaced column, row, k order, offset or scale is off by about the whole sum. On a few CTAs
    each takes dozens of items (tile, matrix, 128 rows) through one ring of chunks, which runs on
    from item to item (at K = 512 an item has fewer chunks than the ring has slots)."""
    from dsuf.gpu.moe import Moe, chunk_exponents_fit, prefill_images, prefill_tiles
    from dsuf.gpu.runtime import device_arch

    if device_arch(cuda) != "sm_90a":
        pytest.skip("wgmma is sm_90a's")
    mats = [spread_fp4_weight(EXPERTS, n, k, cuda) for _ in range(mats)]
    assert all(chunk_exponents_fit(w, s) for w, s in mats)
    runs = {0: 300, 1: 17, 2: 16, 3: 64, 4: 32, 5: 200, 6: 33, 7: 5}
    bounds = [0]
    for e in range(EXPERTS):
        bounds.append(bounds[-1] + runs.get(e, 0))
    pairs = bounds[-1]
    x = random_activations(pairs, k, cuda)
    xq, sx = act_quant(x)
    gate_up = torch.full((pairs, len(mats) * n), float("nan"), dtype=torch.float32, device=cuda)
    tiles = prefill_tiles(torch.tensor(bounds[1:], device=cuda), pairs)
    Moe.prefill_gemm(tuple((fp4_kernel_layout(w), s) for w, s in mats), prefill_images(xq, sx, None, tiles), tiles, gate_up,
                     torch.zeros(1, dtype=torch.int32, device=cuda), ctas)
    xd = (xq.double().view(pairs, k // 128, 128) * sx.double().unsqueeze(-1)).view(pairs, k)
    worst = 0.0
    for e, count in runs.items():
        rows = slice(bounds[e], bounds[e] + count)
        w = torch.cat([quant.dequant_fp4_weight(w[e], s[e].view(torch.float8_e8m0fnu)) for w, s in mats]).double()
        exact, mag = xd[rows] @ w.t(), xd[rows].abs() @ w.abs().t()
        worst = max(worst, float(((gate_up[rows].double() - exact).abs() / mag.clamp_min(1e-30)).max()))
    print(f"\n  moe_prefill_fp4 on {f'{ctas} CTAs' if ctas else 'a CTA an SM'}, {len(mats)} x [{n}, {k}] of {pairs} pairs: worst error {worst:.2e} of the sum of |products|")
    assert worst < 1e-3


def test_chunks_fit_the_prefill_gemm_unless_a_nonzero_block_is_far_below():
    """chunk_exponents_fit (CPU): a 128-element chunk whose four block scales lie within 12 octaves
    fits; a block 13 octaves below the largest fits only while its codes are all zero (-0 included),
    since moe_prefill_fp4 would scale it by its chunk's base. Fp4Experts records the answer."""
    from dsuf.gpu.moe import chunk_exponents_fit

    codes = torch.randint(0, 256, (2, 4, 128), dtype=torch.uint8)
    scales = torch.full((2, 4, 8), 127, dtype=torch.uint8)
    scales[1, 2, 4:8] = torch.tensor([127, 115, 120, 122], dtype=torch.uint8)  # 12 octaves
    assert chunk_exponents_fit(codes.view(torch.int8), scales)
    scales[1, 2, 5] = 114  # 13 octaves below: its codes (bytes 80..95 of the row) are random
    assert not chunk_exponents_fit(codes.view(torch.int8), scales)
    codes[1, 2, 80:96] = 0x88  # -0 and -0
    assert chunk_exponents_fit(codes.view(torch.int8), scales)


@pytest.mark.parametrize("wgmma", [True, False], ids=["FP4 by wgmma", "bf16 copy"])
def test_moe_of_a_prompt_chunk(cuda, monkeypatch, moe_pair, wgmma):
    """From PREFILL_MIN_TOKENS tokens (on sm_90a; else GROUPED_MIN_TOKENS) the routed experts run as
    one GEMM a matrix over all pairs: on sm_90a moe_prefill_fp4 (the FP4 weights as the decode
    kernels convert them, wgmma sums of about 12 bits a 128-element chunk, gate and up in
    float32), else grouped bf16 GEMMs over their bf16 copy (torch._grouped_mm: gate and up rounded
    to bf16, which the reference keeps in float32). The relative error stays near the decode
    kernels'; single elements move further, because a small change of h can move its FP8 rounding
    for w2 by a whole e4m3 step (2**-3 relative, 32 bf16 ulps). A misplaced pair or expert would
    give its token an error near that pair's share of the output. Each expert here has hundreds
    of pairs: several tiles of 128, the last one partial."""
    from dsuf.gpu import moe as gpu_moe
    from dsuf.gpu.moe import GROUPED_MIN_TOKENS, PREFILL_MIN_TOKENS
    from dsuf.gpu.runtime import device_arch

    if wgmma and device_arch(cuda) != "sm_90a":
        pytest.skip("wgmma is sm_90a's")
    monkeypatch.setattr(gpu_moe, "PREFILL_WGMMA", wgmma)
    kernel, moe = moe_pair
    assert kernel.routed.chunks_fit  # (else the bf16 path runs either way)
    fp4_chunks = []
    routed_prefill = gpu_moe.Moe._routed_prefill
    monkeypatch.setattr(gpu_moe.Moe, "_routed_prefill", lambda self, *a: fp4_chunks.append(1) or routed_prefill(self, *a))
    tokens = (PREFILL_MIN_TOKENS if wgmma else GROUPED_MIN_TOKENS) + 24
    x = random_activations(tokens, D, cuda)
    weights, idx = moe.route(x, None)
    out = torch.full((tokens, D), float("nan"), dtype=torch.bfloat16, device=cuda)
    kernel(x, weights, idx, out=out)
    ref = reference_moe(moe, x, weights, idx)
    rel, _ = compare(f"MoE of a prompt chunk, {tokens} tokens x ({TOPK} routed + shared)", out, ref)
    # Per token, not per element: an element whose h crossed an e4m3 rounding can be a whole
    # rounding of its own off (~128 bf16 ulps, the worst of ~800k elements lands either side of
    # that), where a misplaced pair moves its token's whole output by that pair's share.
    token_rel = ((out.double() - ref.double()).norm(dim=1) / ref.double().norm(dim=1)).max()
    print(f"  worst token: rel err {float(token_rel):.2e}")
    assert rel < 6e-3 and token_rel < 5e-2  # (H200: 2.0e-2 and 2.1e-2 at 792 and 1,048 tokens)
    assert len(fp4_chunks) == int(wgmma), "the chunk took the wrong path"
    assert torch.equal(kernel(x, weights, idx), out), "not deterministic"


def test_a_step_graph_of_many_rows_captures_the_prompt_chunk_path(cuda, monkeypatch, moe_pair):
    """A step of PREFILL_MIN_TOKENS rows or more (a short prompt's step, a large decode batch) runs
    the routed experts by moe_prefill_fp4 inside its CUDA graph too: the path never waits for the
    host (its tiles are made on the device), so the graph replayed on other tokens and routes gives
    the bits of an eager call on them."""
    from dsuf.gpu import moe as gpu_moe
    from dsuf.gpu.moe import PREFILL_MIN_TOKENS
    from dsuf.gpu.runtime import device_arch

    if device_arch(cuda) != "sm_90a":
        pytest.skip("moe_prefill_fp4 is sm_90a's")
    kernel, moe = moe_pair
    fp4_chunks = []
    routed_prefill = gpu_moe.Moe._routed_prefill
    monkeypatch.setattr(gpu_moe.Moe, "_routed_prefill", lambda self, *a: fp4_chunks.append(1) or routed_prefill(self, *a))
    tokens = PREFILL_MIN_TOKENS + 40
    x = random_activations(tokens, D, cuda)
    weights, idx = moe.route(x, None)
    kernel(x, weights, idx)  # (warm-up: the kernels loaded, the claims counter made)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(x, weights, idx)
    assert len(fp4_chunks) == 2, "the captured step took the decode kernels"
    for _ in range(2):
        fresh = random_activations(tokens, D, cuda)
        fresh_weights, fresh_idx = moe.route(fresh, None)
        for static, new in ((x, fresh), (weights, fresh_weights), (idx, fresh_idx)):
            static.copy_(new)
        graph.replay()
        eager = kernel(fresh, fresh_weights, fresh_idx)
        rel, _ = compare(f"MoE of {tokens} rows, graph replayed on fresh routes", out, reference_moe(moe, fresh, fresh_weights, fresh_idx))
        assert rel < 6e-3
        assert torch.equal(out, eager), "the replayed graph differs from the eager call"
