"""Decode attention against the reference: the 584-byte FP8 KV entries against the reference's KV
fake-quant, the sparse MQA kernel against layers.sink_attention (reference numerics) over the
keys those entries hold (its output's inverse RoPE against layers.Rope.apply). V4-Flash shapes:
64 heads of 512 (448 nope + 64 rope), one KV head, attention sinks."""

from __future__ import annotations

import pytest
import torch
from gpu_checks import compare

from dsuf.gpu.attention import (
    KV_ENTRY_BYTES,
    attention_kernel,
    choose_splits,
    new_pool,
    pack_kv,
    sparse_attention,
    unpack_kv,
)
from dsuf.model import quant
from dsuf.model.layers import Numerics, Rope, sink_attention

HEADS, DIM, ROPE = 64, 512, 64
SCALE = DIM**-0.5


def random_kv(rows: int, device) -> torch.Tensor:
    """bf16 [rows, 512] like kv_norm outputs after RoPE: per-64-block magnitudes over a few
    octaves (so the FP8 scales differ) and a few near-zero blocks (the 1e-4 amax floor)."""
    block = torch.exp2(torch.randint(-4, 3, (rows, DIM // 64), device=device).float())
    block[torch.rand(rows, DIM // 64, device=device) < 0.02] = 1e-6
    return (torch.randn(rows, DIM, device=device) * block.repeat_interleave(64, 1)).to(torch.bfloat16)


def reference_kv(kv: torch.Tensor) -> torch.Tensor:
    """The reference's KV-cache fake-quant (v4._fp8_kv): FP8 blocks of 64 on the nope dims."""
    return torch.cat((quant.act_quant_fp8(kv[:, :-ROPE], 64), kv[:, -ROPE:]), dim=-1)


def test_pack_kv_matches_the_reference_fake_quant(cuda):
    rows, entries = 300, 1000
    kv = random_kv(rows, cuda)
    pool = torch.randint(0, 256, (entries, KV_ENTRY_BYTES), dtype=torch.uint8, device=cuda)  # poison
    before = pool.clone()
    slots = torch.randperm(entries, device=cuda)[:rows].int()
    slots[7] = -1  # skipped
    pack_kv(kv, pool, slots)
    written = slots >= 0
    assert torch.equal(unpack_kv(pool[slots[written].long()]), reference_kv(kv[written]))
    assert bool((pool[slots[written].long(), -1] == 0).all()), "pad byte"
    untouched = torch.ones(entries, dtype=torch.bool, device=cuda)
    untouched[slots[written].long()] = False
    assert torch.equal(pool[untouched], before[untouched])
    # Scales are UE8M0 exponents of DeepSeek's act_quant: amax / scale in (224, 448].
    codes = pool[slots[written].long(), 576:583].int()
    amax = kv[written, :448].float().abs().unflatten(-1, (7, 64)).amax(-1).clamp_min(1e-4)
    ratio = amax / torch.exp2((codes - 127).float())
    assert bool(((ratio > 224) & (ratio <= 448)).all())


def reference_attention(q, pool, idx, sink, num: Numerics | None = None):
    """layers.sink_attention per row over the keys its indices name (default: reference numerics,
    bf16 probabilities and output)."""
    num = num or Numerics()
    outs = []
    for r in range(q.shape[0]):
        keys = unpack_kv(pool[idx[r].clamp_min(0).long()])
        mask = (idx[r] >= 0)[None, :]
        outs.append(sink_attention(q[r : r + 1], keys, mask, sink, SCALE, num))
    return torch.cat(outs)


@pytest.mark.parametrize(
    "rows, window, compressed, missing",
    [
        (1, 128, 512, 0.0),  # CSA layer, batch 1: window + top-512
        (8, 128, 512, 0.05),  # batch 8, some slots empty (-1)
        (3, 128, 16, 0.0),  # HCA at 2k context: fewer entries than one split's share
        (1, 128, 8192, 0.0),  # HCA at 1M context: window + every compressed entry
        (8, 128, 2048, 0.1),
    ],
)
def test_sparse_attention(cuda, rows, window, compressed, missing):
    n = window + compressed
    entries = rows * n + 64
    pool = new_pool(entries, cuda)
    pack_kv(random_kv(entries, cuda), pool)
    idx = torch.randint(0, entries, (rows, n), device=cuda, dtype=torch.int32)
    idx[torch.rand(rows, n, device=cuda) < missing] = -1
    idx[:, 0] = torch.randint(0, entries, (rows,), device=cuda, dtype=torch.int32)  # ≥ 1 key a row
    # Queries like the per-head-normalised, RoPE'd q; some heads sharper than others.
    q = (torch.randn(rows, HEADS, DIM, device=cuda) * torch.exp(torch.randn(1, HEADS, 1, device=cuda))).to(torch.bfloat16)
    check_attention(q, pool, idx, f"{missing:.0%} missing")


def test_a_prompt_chunks_rows(cuda):
    """As many rows as SMs or more (a prompt chunk): one split a row, which the attention kernel
    finishes itself (no combine). A prompt's early rows see few compressed entries, so whole
    tiles of their slots are -1."""
    rows, window, compressed = 300, 128, 512
    n = window + compressed
    entries = rows * n + 64
    pool = new_pool(entries, cuda)
    pack_kv(random_kv(entries, cuda), pool)
    idx = torch.randint(0, entries, (rows, n), device=cuda, dtype=torch.int32)
    slot = torch.arange(n, device=cuda)
    seen = torch.arange(1, rows + 1, device=cuda) * compressed // rows  # row r sees (r + 1) / rows of the top-k
    idx[(slot[None, :] >= window) & (slot[None, :] - window >= seen[:, None])] = -1
    q = (torch.randn(rows, HEADS, DIM, device=cuda) * torch.exp(torch.randn(1, HEADS, 1, device=cuda))).to(torch.bfloat16)
    check_attention(q, pool, idx, "a prompt chunk")


def check_attention(q: torch.Tensor, pool: torch.Tensor, idx: torch.Tensor, what: str, used: torch.Tensor | None = None) -> None:
    rows, n = idx.shape
    sink = torch.randn(HEADS, device=q.device) * 2
    out = torch.full((rows, HEADS, DIM), float("nan"), dtype=torch.bfloat16, device=q.device)  # poison
    sparse_attention(q, pool, idx, sink, SCALE, out=out, used=used)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits, per_split, head_tile = choose_splits(n, rows, sms, head_cap=attention_kernel(HEADS, rows, sms)[2])
    ref = reference_attention(q, pool, idx, sink)
    rel, _ = compare(f"sparse attention {rows} rows x {n} entries ({splits} splits of {per_split}, {head_tile} heads a CTA, {what})", out, ref)
    # The kernel rounds probabilities to bf16 against each tile's running max, not the global max
    # as the reference does (DeepSeek's own kernel does the same), so where an output cancels
    # between large terms the two differ by more than an ulp of the output. Measured against the
    # unrounded attention (float64, no bf16 probabilities), it must be as accurate as the
    # reference numerics are.
    exact = reference_attention(q, pool, idx, sink, Numerics("exact", torch.float32)).double()
    k_err, r_err = out.double() - exact, ref.double() - exact
    k_rel, r_rel = float(k_err.norm() / exact.norm()), float(r_err.norm() / exact.norm())
    k_max, r_max = float(k_err.abs().max()), float(r_err.abs().max())
    print(f"  against unrounded attention: kernel rel {k_rel:.2e} max {k_max:.2e}; reference numerics rel {r_rel:.2e} max {r_max:.2e}")
    assert rel < 4e-3
    assert k_rel <= 1.5 * r_rel and k_max <= 2.0 * r_max
    assert torch.equal(sparse_attention(q, pool, idx, sink, SCALE, used=used), out), "not deterministic"


@pytest.mark.parametrize("rows, heads", [(1, 64), (1, 32), (8, 64), (8, 32), (300, 64)])
def test_rows_attend_over_the_slots_they_use_not_the_caches_room(cuda, rows, heads):
    """A server sized for long contexts gives an HCA row room for every compressed entry it could
    have (8,192 at 1M), nearly all -1 at a short context. Told the slots each row uses, the kernel
    spreads those over its CTAs as if the room were not there: bit for bit the output of the same
    rows without it."""
    window, seen, room = 128, 32, 8192
    n = window + seen
    pool = new_pool(rows * n, cuda)
    pack_kv(random_kv(rows * n, cuda), pool)
    idx = torch.randint(0, rows * n, (rows, n), device=cuda, dtype=torch.int32)
    roomy = torch.cat((idx, torch.full((rows, room), -1, dtype=torch.int32, device=cuda)), dim=1)
    used = torch.full((rows,), n, dtype=torch.int32, device=cuda)
    q = (torch.randn(rows, heads, DIM, device=cuda) * torch.exp(torch.randn(1, heads, 1, device=cuda))).to(torch.bfloat16)
    sink = torch.randn(heads, device=cuda) * 2
    assert torch.equal(sparse_attention(q, pool, roomy, sink, SCALE, used=used), sparse_attention(q, pool, idx, sink, SCALE))


def test_rows_of_one_step_using_different_slots(cuda):
    """Rows at different positions use different numbers of their slots: each row's own plan,
    checked against the reference over all the slots."""
    rows, window, room = 8, 128, 2048
    n = window + room
    pool = new_pool(rows * n, cuda)
    pack_kv(random_kv(rows * n, cuda), pool)
    idx = torch.randint(0, rows * n, (rows, n), device=cuda, dtype=torch.int32)
    used = torch.tensor([window + 3, window, n, window + 700, 1, window + 33, window + 1500, window + 64], dtype=torch.int32, device=cuda)
    idx[torch.arange(n, device=cuda)[None, :] >= used[:, None]] = -1
    q = (torch.randn(rows, HEADS, DIM, device=cuda) * torch.exp(torch.randn(1, HEADS, 1, device=cuda))).to(torch.bfloat16)
    check_attention(q, pool, idx, "rows using 1 to all of their slots", used=used)


@pytest.mark.parametrize("rows", [1, 4, 300])
@pytest.mark.parametrize("heads", [32, 16, 8])
def test_a_tensor_parallel_ranks_heads_attend_as_within_all_64(cuda, heads, rows):
    """A rank of a split model holds 64 / world query heads: the kernel takes them as they are
    (in CTAs of up to 32 heads, two an SM) and gives, bit for bit, what those heads get among all
    64. (One row: the 64 heads are split among four CTAs a split, 32 among two, 16 take one; 300
    rows, a prompt chunk's: a CTA a row finishes it.)"""
    n = 640
    pool = new_pool(rows * n, cuda)
    pack_kv(random_kv(rows * n, cuda), pool)
    idx = torch.randint(0, rows * n, (rows, n), device=cuda, dtype=torch.int32)
    q = (torch.randn(rows, HEADS, DIM, device=cuda) * torch.exp(torch.randn(1, HEADS, 1, device=cuda))).to(torch.bfloat16)
    sink = torch.randn(HEADS, device=cuda) * 2
    every = sparse_attention(q, pool, idx, sink, SCALE)
    first = heads * (HEADS // heads - 1)  # the last rank's heads
    share = sparse_attention(q[:, first : first + heads].contiguous(), pool, idx, sink[first : first + heads].contiguous(), SCALE)
    assert share.shape == (rows, heads, DIM) and torch.equal(share, every[:, first : first + heads])


@pytest.mark.parametrize("rows, heads", [(1, 64), (8, 32), (300, 64)])
def test_attention_with_the_inverse_rope_is_attention_then_the_rotation(cuda, rows, heads):
    """The output's rope dims rotated back in the splits' combine (or, one split a row, in the
    attention kernel): bit for bit the attention, then the reference's inverse rotation (each row at
    its own position)."""
    n = 128 + 512
    pool = new_pool(rows * n, cuda)
    pack_kv(random_kv(rows * n, cuda), pool)
    idx = torch.randint(0, rows * n, (rows, n), device=cuda, dtype=torch.int32)
    q = (torch.randn(rows, heads, DIM, device=cuda) * torch.exp(torch.randn(1, heads, 1, device=cuda))).to(torch.bfloat16)
    sink = torch.randn(heads, device=cuda) * 2
    rope = Rope(64, 160000.0, (16.0, 65536, 32.0, 1.0))
    rope.freqs = rope.freqs.to(cuda)
    cos, sin = rope.cos_sin(torch.randint(0, 1 << 20, (rows,), device=cuda))
    fused = sparse_attention(q, pool, idx, sink, SCALE, inverse_rope=(cos, sin))
    apart = rope.apply(sparse_attention(q, pool, idx, sink, SCALE), (cos, sin), inverse=True)
    assert torch.equal(fused, apart)
