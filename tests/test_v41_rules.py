"""One focused test per V4.1 rule (model.md §3.3): each fails if its rule is broken, and most show
by a counter-example that breaking it would change the numbers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dsuf.model import load_model, quant, v41
from dsuf.model.engram import DEAD, Engram
from dsuf.model.layers import HyperConnection, IndexScorer, Numerics, Segment, load_rows, rms_norm
from dsuf.model.state import V41_COMPRESSED_KV, V41_INDEX_KEYS, V41_WINDOW_KV, CompressorState
from dsuf.model.v41 import CSA2Attention, Shared, candidate_blocks

EXACT = Numerics("exact", torch.float32)
REFERENCE = Numerics("reference", torch.bfloat16)
INF = float("inf")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def model(tiny_v41):
    return load_model(tiny_v41("default"))  # [SWA, Full(2), Reuse, Full(1, candidates), Reindex, Reuse]


@pytest.fixture(scope="module")
def variant(tiny_v41):
    return load_model(tiny_v41("variant"))  # [SWA, Full(2), Reuse, Reuse, Full(1, candidates), Reuse, Reindex]


def tokens(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def record_compressed(monkeypatch, model) -> dict[int, tuple[torch.Tensor, torch.Tensor] | None]:
    """Layer → the (compressed keys, picks) its attention used in the last forward."""
    layer_of = {id(block.attn): i for i, block in enumerate(model.layers)}
    seen: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
    original = CSA2Attention.compressed

    def spy(self, seg, x, qr, cos_sin, num, shared):
        out = original(self, seg, x, qr, cos_sin, num, shared)
        seen[layer_of[id(self)]] = None if out is None else (out[0].clone(), out[1].clone())
        return out

    monkeypatch.setattr(CSA2Attention, "compressed", spy)
    return seen


# ---- CSA2 roles -------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["model", "variant"])
def test_reuse_layers_read_the_nearest_source_with_the_latest_picks(which, request, monkeypatch):
    m = request.getfixturevalue(which)
    c = m.config
    seen = record_compressed(monkeypatch, m)
    state = m.new_state(REFERENCE)
    m.forward(tokens(37), state, REFERENCE)
    latest_index_layer = None
    for layer, kind in enumerate(c.layer_kind(i) for i in range(c.n_layers)):
        if kind == "swa":
            assert seen[layer] is None
            continue
        keys, picks = seen[layer]
        source = c.kv_source_of(layer)
        assert torch.equal(keys, load_rows(state.layers[source].compressed, V41_COMPRESSED_KV, REFERENCE)), layer
        if kind in ("full", "reindex"):
            latest_index_layer = layer
        else:
            assert torch.equal(picks, seen[latest_index_layer][1]), f"layer {layer} must reuse layer {latest_index_layer}'s picks"
    reindex = c.csa2.index_source_layers[-1]
    # a reindex layer really picks anew, so "the latest picks" is a different choice from the source's
    assert not torch.equal(seen[reindex][1], seen[c.csa2.candidate_source_layer][1])


def test_a_ratio_2_source_scores_its_own_keys_on_steps_that_emit_no_entry(model, monkeypatch):
    """The reference would score layer 1 against the last *published* keys (layer 3's) on odd
    steps (model.md §7.1); like transformers and vLLM we use the source's own running cache."""
    state = model.new_state(REFERENCE)
    model.forward(tokens(20), state, REFERENCE)
    used = []
    original = IndexScorer.scores
    monkeypatch.setattr(IndexScorer, "scores", lambda self, x, qr, cs, keys, num: used.append((self, keys.clone())) or original(self, x, qr, cs, keys, num))
    model.forward(torch.tensor([5]), state, REFERENCE)  # position 20 opens a group: layer 1 emits nothing
    assert state.layers[1].compressed.shape[0] == 10
    scorer, keys = used[0]
    assert scorer is model.layers[1].attn.indexer
    assert torch.equal(keys, load_rows(state.layers[1].index_keys, V41_INDEX_KEYS, REFERENCE))
    assert keys.shape[0] != state.layers[3].index_keys.shape[0]


def test_candidate_blocks_hand_examples():
    scores = torch.tensor([
        [0, 9, 0, 0, 1, 1, 1, 1, 0, 0],  # all visible: block 0 (max 9) beats block 1 (1); block 2 holds the newest entry
        [0, 0, 0, 0, 3, 0, -INF, -INF, -INF, -INF],  # 6 visible: newest in block 1, block 2 unreachable
        [-INF] * 10,  # nothing visible yet
        [2, 0, 0, -INF, -INF, -INF, -INF, -INF, -INF, -INF],  # one reachable block only
    ])
    counts = torch.tensor([10, 6, 0, 3])
    keep = candidate_blocks(scores, counts, topk_blocks=2, block_size=4)
    Y, N = True, False
    assert keep.tolist() == [
        [Y, Y, Y, Y, N, N, N, N, Y, Y],
        [Y, Y, Y, Y, Y, Y, Y, Y, N, N],
        [N] * 10,
        [Y, Y, Y, Y, N, N, N, N, N, N],
    ]
    # the pin: a newest block that scores lowest is still kept
    low = torch.tensor([[5, 5, 5, 5, 4, 4, 4, 4, -1, -INF]])
    assert candidate_blocks(low, torch.tensor([9]), 2, 4).tolist() == [[Y, Y, Y, Y, N, N, N, N, Y, Y]]


def test_reindex_layers_pick_only_inside_the_candidate_blocks(model, monkeypatch):
    c = model.config
    reindex = c.csa2.index_source_layers[-1]
    assert c.layer_kind(reindex) == "reindex"
    seq = tokens(41)
    kept = []
    original = v41.candidate_blocks
    monkeypatch.setattr(v41, "candidate_blocks", lambda *a: kept.append(original(*a)) or kept[-1])
    seen = record_compressed(monkeypatch, model)
    model.forward(seq, model.new_state(EXACT), EXACT)
    candidates, picks = kept[0], seen[reindex][1]
    visible = torch.arange(41)[None, :] < (torch.arange(41) + 1)[:, None]
    assert (picks & ~candidates).sum() == 0  # level two stays inside level one
    assert ((candidates & visible).sum(1) < visible.sum(1)).any()  # level one really dropped entries
    assert torch.equal(picks.sum(1), visible.sum(1).clamp(max=c.index_topk))  # and kept enough to fill top-k
    # without the restriction the reindex layer would attend elsewhere
    monkeypatch.setattr(v41, "candidate_blocks", lambda scores, *a: scores > -INF)
    model.forward(seq, model.new_state(EXACT), EXACT)
    assert not torch.equal(seen[reindex][1], picks)


# ---- caches, keys and queries ---------------------------------------------------------------------


@pytest.mark.parametrize("layer", [1, 3], ids=["ratio-2", "ratio-1"])
def test_index_keys_come_from_the_pre_rope_latent_and_each_cache_has_its_format(model, layer):
    c = model.config
    attn = model.layers[layer].attn
    T, W = 13, c.window_size
    x = torch.randn(T, c.dim, generator=torch.Generator().manual_seed(layer)).to(torch.bfloat16)
    state = model.new_state(REFERENCE)
    st = state.layers[layer]
    attn(x, [Segment(slice(0, T), 0, st)], REFERENCE, [Shared()])

    latent, pos = attn.compressor(x, 0, CompressorState.new(attn.ratio, c.head_dim) if attn.ratio > 1 else None, REFERENCE)
    assert pos.tolist() == list(range(0, T - attn.ratio + 1, attn.ratio))  # entry j stands for position ratio·j
    cs = attn.rope.cos_sin(pos)

    def index_key(v: torch.Tensor) -> torch.Tensor:
        return quant.fp4_fake_quant_ue8m0(attn.rope.apply(rms_norm(attn.wk(v, REFERENCE), attn.k_norm, c.norm_eps), cs), 32)

    keys = V41_INDEX_KEYS.unpack(st.index_keys).to(torch.bfloat16)
    assert torch.equal(keys, index_key(latent))
    assert not torch.equal(keys, index_key(attn.rope.apply(latent, cs)))  # keys from the RoPE'd latent would differ
    # compressed KV: the RoPE'd latent in FP4 with E4M3 scales per 16, on all dims
    assert torch.equal(V41_COMPRESSED_KV.unpack(st.compressed).to(torch.bfloat16), quant.fp4_fake_quant_e4m3(attn.rope.apply(latent, cs), 16))
    # window KV: FP8 with power-of-two scales per 32 on all dims, the RoPE'd ones included
    positions = torch.arange(T)
    kv = attn.rope.apply(rms_norm(attn.wkv(x, REFERENCE), attn.kv_norm, c.norm_eps), attn.rope.cos_sin(positions))
    want = quant.act_quant_fp8(kv, 32)
    ring = V41_WINDOW_KV.unpack(st.window).to(torch.bfloat16)
    assert torch.equal(ring[positions[-W:] % W], want[-W:])
    assert not torch.equal(want[:, -c.rope_head_dim :], kv[:, -c.rope_head_dim :])


def test_exact_numerics_keep_the_caches_unquantised(model):
    c = model.config
    attn = model.layers[3].attn
    x = torch.randn(6, c.dim, generator=torch.Generator().manual_seed(9))
    st = model.new_state(EXACT).layers[3]
    attn(x, [Segment(slice(0, 6), 0, st)], EXACT, [Shared()])
    latent, pos = attn.compressor(x, 0, None, EXACT)
    cs = attn.rope.cos_sin(pos)
    assert st.compressed.dtype == torch.float32 and torch.equal(st.compressed, attn.rope.apply(latent, cs))
    assert torch.equal(st.index_keys, attn.rope.apply(rms_norm(attn.wk(latent, EXACT), attn.k_norm, c.norm_eps), cs))


def test_queries_are_not_normalised_per_head(model):
    """Scaling wq_b scales V4.1's queries, so the attention changes; with V4's per-head RMS norm
    the same scaling would change nothing."""
    c = model.config
    attn = model.layers[2].attn
    x = torch.randn(9, c.dim, generator=torch.Generator().manual_seed(4))

    def run() -> torch.Tensor:
        st = model.new_state(EXACT)
        shared = [Shared()]
        model.layers[1].attn(x, [Segment(slice(0, 9), 0, st.layers[1])], EXACT, shared)  # publish the source's cache
        return attn(x, [Segment(slice(0, 9), 0, st.layers[2])], EXACT, shared)

    base, weight = run(), attn.wq_b.weight
    try:
        attn.wq_b.weight = weight * 3
        assert not torch.allclose(run(), base, rtol=1e-3, atol=1e-3)
        attn.q_head_norm = True  # what V4 does
        scaled = run()
        attn.wq_b.weight = weight
        torch.testing.assert_close(scaled, run(), rtol=1e-4, atol=1e-5)
    finally:
        attn.wq_b.weight = weight
        del attn.q_head_norm
    assert CSA2Attention.q_head_norm is False


def test_the_indexer_quantises_its_queries_without_a_hadamard_rotation(model):
    c = model.config
    scorer = model.layers[4].attn.indexer
    g = torch.Generator().manual_seed(5)
    x, qr = torch.randn(7, c.dim, generator=g).to(torch.bfloat16), torch.randn(7, c.q_lora_rank, generator=g).to(torch.bfloat16)
    keys = quant.fp4_fake_quant_ue8m0(torch.randn(11, c.index_head_dim, generator=g), 32).to(torch.bfloat16)
    cs = scorer.rope.cos_sin(torch.arange(7))
    q = quant.fp4_fake_quant_ue8m0(scorer.rope.apply(scorer.wq_b(qr, REFERENCE).view(7, c.index_n_heads, -1), cs), 32)
    w = scorer.weights_proj(x, REFERENCE).float() * (c.index_head_dim * c.index_n_heads) ** -0.5
    dots = torch.einsum("thd,nd->thn", q.double(), keys.double()).float().to(torch.bfloat16).float()
    want = (F.relu(dots) * w[..., None]).double().sum(1).float().to(torch.bfloat16).float()
    assert torch.equal(scorer.scores(x, qr, cs, keys, REFERENCE), want)
    rotated = IndexScorer.__new__(IndexScorer)
    rotated.__dict__ |= scorer.__dict__ | {"hadamard": True}
    assert not torch.equal(rotated.scores(x, qr, cs, keys, REFERENCE), want)


# ---- mHC, MoE, norms ------------------------------------------------------------------------------


def test_single_pass_mhc_collapses_with_the_previous_sites_pre_mix(model, monkeypatch):
    coefficients, collapses = [], []
    original_coefficients, original_collapse = HyperConnection.coefficients, v41.hc_collapse

    def coefficients_spy(self, *args):
        out = original_coefficients(self, *args)
        coefficients.append(out[0].clone())
        return out

    monkeypatch.setattr(HyperConnection, "coefficients", coefficients_spy)
    monkeypatch.setattr(v41, "hc_collapse", lambda x, pre: collapses.append(pre.clone()) or original_collapse(x, pre))
    model.forward(tokens(5), model.new_state(EXACT), EXACT)
    L = model.config.n_layers
    assert len(coefficients) == 2 * L and len(collapses) == 2 * L + 1
    assert torch.equal(collapses[0], torch.tensor([[1.0, 0, 0, 0]] * 5))  # the first collapse takes stream 0
    for b in range(L):
        assert torch.equal(collapses[2 * b + 1], coefficients[2 * b]), f"block {b}: the FFN collapses with the attention site's pre"
        assert torch.equal(collapses[2 * b + 2], coefficients[2 * b + 1]), f"block {b}: the FFN site's pre collapses what follows"
    assert not torch.equal(collapses[1], coefficients[1])  # V4's own-site collapse would differ


def test_the_gate_routes_image_tokens_with_bias_vl_and_normalises_with_1e_20(model):
    moe = model.layers[2].ffn
    assert moe.route_eps == 1e-20 and moe.bias_vl is not None and not torch.equal(moe.bias_vl, moe.bias)
    x = torch.randn(6, model.config.dim, generator=torch.Generator().manual_seed(6))
    ids = torch.zeros(6, dtype=torch.long)
    image = torch.tensor([False, True, False, True, True, False])
    favour_0 = moe.bias.clone()
    favour_0[0] = 100.0
    routed = dataclasses.replace(moe, bias_vl=favour_0)
    _, idx = routed.route(x, ids, image)
    _, text_idx = routed.route(x, ids, None)
    assert (idx[image] == 0).any(dim=1).all() and torch.equal(idx[~image], text_idx[~image])
    assert not (text_idx == 0).any(dim=1).all()
    # logits of −300 give sqrt(softplus) scores that underflow to zero in float32: zero weights, not 0/0
    ones, dim = torch.ones(6, model.config.dim), model.config.dim
    silent = dataclasses.replace(moe, gate=torch.full_like(moe.gate, -300.0 / dim))
    weights, _ = silent.route(ones, ids)
    assert (weights == 0).all()
    assert torch.isnan(dataclasses.replace(silent, route_eps=0.0).route(ones, ids)[0]).all()


def test_image_tokens_route_with_bias_vl_and_block_the_engram_look_back(model, monkeypatch):
    m = type(model).__new__(type(model))
    m.__dict__ |= model.__dict__ | {"config": model.config.replace(image_token_id=7)}
    seen_images, engram_masks = [], []
    route = type(model.layers[2].ffn).route
    monkeypatch.setattr(type(model.layers[2].ffn), "route", lambda self, x, ids, image=None: seen_images.append(image) or route(self, x, ids, image))
    call = Engram.__call__
    monkeypatch.setattr(Engram, "__call__", lambda self, x, h, text, num: engram_masks.append(text) or call(self, x, h, text, num))
    seq = torch.tensor([4, 7, 9, 10, 7, 12])
    state = m.new_state(EXACT)
    m.forward(seq, state, EXACT)
    assert all(torch.equal(image, seq == 7) for image in seen_images) and len(seen_images) == m.config.n_layers
    assert all(torch.equal(text, seq != 7) for text in engram_masks) and len(engram_masks) == 2
    assert state.engram.tolist() == [int(m.hasher.token_map[10]), DEAD, int(m.hasher.token_map[12])]


def test_the_shared_expert_is_clamped(model):
    ffn = model.layers[0].ffn
    assert ffn.shared.limit == model.config.swiglu_limit == 10.0
    x = 50 * torch.randn(3, model.config.dim, generator=torch.Generator().manual_seed(8))
    gate, up = ffn.shared.w1(x, EXACT), ffn.shared.w3(x, EXACT)
    assert gate.max() > 10 and up.abs().max() > 10  # the clamp bites
    h = F.silu(gate.double().clamp(max=10)) * up.double().clamp(-10, 10)
    torch.testing.assert_close(ffn.shared(x, EXACT).double(), h @ ffn.shared.w2.weight.T, rtol=1e-5, atol=1e-4)


def test_norms_use_eps_1e_20_in_float32(model):
    assert model.config.norm_eps == 1e-20
    tiny_values = torch.full((1, 64), 1e-8, dtype=torch.bfloat16)  # mean square 1e-16: far above 1e-20, far below 1e-6
    assert torch.allclose(rms_norm(tiny_values, None, model.config.norm_eps).float(), torch.ones(1, 64), rtol=1e-2)
    assert rms_norm(tiny_values, None, 1e-6).max() < 1e-3  # V4's eps would swamp such a vector
    assert model.layers[1].engram.eps == model.layers[1].attn.compressor.eps == 1e-20


def test_engram_runs_before_exactly_its_blocks(variant, monkeypatch):
    ran = []
    call = Engram.__call__
    monkeypatch.setattr(Engram, "__call__", lambda self, x, h, text, num: ran.append((self, h.clone())) or call(self, x, h, text, num))
    seq = tokens(9)
    state = variant.new_state(EXACT)
    variant.forward(seq, state, EXACT)
    layers = [i for i, block in enumerate(variant.layers) if block.engram is not None]
    assert layers == [0, 4] == list(variant.config.engram.layer_ids)
    assert [engram for engram, _ in ran] == [variant.layers[i].engram for i in layers]
    hashes, _ = variant.hasher(seq, variant.hasher.new_history(), torch.zeros(9, dtype=torch.bool))
    assert all(torch.equal(h, hashes[:, k]) for k, (_, h) in enumerate(ran))
