"""The lightning indexer at decode against the reference: index scores against the reference's
scoring (layers.IndexScorer.scores after its query projection: FP4 queries and keys, float64 dots
rounded to float32 then bf16, ReLU, float32 head weights, float64 head sum rounded to bf16), the
top-k against the reference's select_topk (stable descending sort: ties to the lower index), and
the 68-byte key entries against the FP4 fake-quant they hold. V4-Flash: 64 index heads of 128."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsuf.gpu.indexer import (
    fp4_quantize,
    index_query_fp4,
    index_scores,
    pack_index_keys,
    topk_indices,
    unpack_index_keys,
)
from dsuf.model import quant
from dsuf.model.layers import Rope
from dsuf.model.v4 import select_topk

HEADS, DIM, TOPK = 64, 128, 512


def fp4_values(shape, device, octaves: int = 10) -> torch.Tensor:
    """Random FP4 fake-quantised values (bf16) as the reference holds its indexer queries / keys,
    with block magnitudes over `octaves` octaves."""
    spread = torch.randint(-6, octaves - 6, (*shape[:-1], shape[-1] // 32), device=device).float()
    x = torch.randn(*shape, device=device) * torch.exp2(spread).repeat_interleave(32, -1)
    return quant.fp4_fake_quant_ue8m0(x.to(torch.bfloat16), 32)


def reference_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """layers.IndexScorer.scores from its FP4 queries on: q [T, 64, 128], keys [n, 128], w [T, 64]."""
    dots = torch.einsum("thd,nd->thn", q.double(), keys.double()).float().to(torch.bfloat16).float()
    return (F.relu(dots) * w.unsqueeze(-1)).double().sum(dim=1).float().to(torch.bfloat16).float()


def test_fp4_quantize_is_the_reference_fake_quant(cuda):
    """fp4_quantize / pack_index_keys against quant.fp4_fake_quant_ue8m0, on raw values (with the
    e2m1 rounding ties and an all-zero block) and on values already quantised."""
    raw = torch.randn(500, DIM, device=cuda) * torch.exp2(torch.randint(-8, 8, (500, 4), device=cuda).float()).repeat_interleave(32, -1)
    raw[0, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * torch.tensor([1.0, -1.0]).repeat(16)
    raw[1, 32:64] = 0
    raw = raw.to(torch.bfloat16)
    ref = quant.fp4_fake_quant_ue8m0(raw, 32).float()
    for x in (raw, ref.to(torch.bfloat16)):
        q8, qs = fp4_quantize(x)
        assert torch.equal((q8.float().unflatten(-1, (4, 32)) * qs.unsqueeze(-1)).flatten(-2), ref)
        packed = pack_index_keys(x)
        assert packed.shape == (500, 68) and packed.dtype == torch.uint8
        assert torch.equal(unpack_index_keys(packed), ref)
    pool = torch.zeros(1000, 68, dtype=torch.uint8, device=cuda)
    rows = torch.randperm(1000, device=cuda)[:500]
    pack_index_keys(raw, pool, rows)
    assert torch.equal(unpack_index_keys(pool[rows]), ref)
    assert int((pool.sum(-1) != 0).sum()) <= 500, "wrote outside its rows"


@pytest.mark.parametrize("rows", [1, 37])
def test_index_query_fp4_is_rope_then_the_hadamard_rotation_then_fp4(cuda, rows):
    """wq_b's bf16 heads to what index_scores reads, in one launch: RoPE on the trailing 64 dims,
    the Hadamard rotation with its sums exact (as the compressor rotates index keys) times
    f32(128**-0.5), the FP4 fake-quant; bit for bit. The reference rotates by a float32 matmul,
    whose rounded running sums move a value across a bf16 rounding now and then."""
    x = torch.randn(rows, HEADS, DIM, device=cuda) * torch.exp2(torch.randint(-3, 4, (rows, HEADS, 1), device=cuda).float())
    x = x.to(torch.bfloat16)
    rope = Rope(64, 160000.0, (16.0, 65536, 32.0, 1.0))  # V4-Flash compressed layers: YaRN
    rope.freqs = rope.freqs.to(cuda)
    cos, sin = rope.cos_sin(torch.randint(0, 1 << 16, (rows,), device=cuda))
    q8, qs = index_query_fp4(x, cos, sin)
    rotated = rope.apply(x, (cos, sin))
    signs = torch.sign(quant.hadamard_matrix(DIM)).double().to(cuda)
    scale = float(torch.tensor(DIM**-0.5, dtype=torch.float32))
    exact = ((rotated.double() @ signs) * scale).float().to(torch.bfloat16)
    e8, es = fp4_quantize(exact)
    assert torch.equal(q8.view(torch.uint8), e8.view(torch.uint8)) and torch.equal(qs, es)
    r8, rs = fp4_quantize(quant.hadamard_transform(rotated))
    same = float(((q8.float() * qs.repeat_interleave(32, -1)) == (r8.float() * rs.repeat_interleave(32, -1))).float().mean())
    print(f"\n  index queries: {same:.5f} of the FP4 values as the reference's float32 rotation gives them")
    assert same > 0.999


# Block magnitudes over 10 octaves (the kernel's float64 path: block scales too far apart for exact
# float32 sums) or 3 (as after the Hadamard rotation: its float32 path), and both in one row.
@pytest.mark.parametrize("octaves", [10, 3, "3 and 10"])
# Rows' key counts, and the row stride where it is longer than the longest row (a cache sized for
# 1M context holding short rows: their keys spread over all CTAs).
@pytest.mark.parametrize("n_keys, max_keys", [([1000], 0), ([4096, 4000, 1, 3000, 4096, 17, 2048, 4095], 0), ([16384], 0), ([262144], 0), ([3000, 5], 262144)])
def test_index_scores(cuda, n_keys, max_keys, octaves):
    rows, max_keys = len(n_keys), max(max_keys, *n_keys)
    key_octaves = 3 if octaves == "3 and 10" else octaves
    q = fp4_values((rows, HEADS, DIM), cuda, 3 if octaves == "3 and 10" else octaves)
    # weights_proj(x) in bf16 times (128 * 64) ** -0.5 in float32, as the reference forms them.
    w = (torch.randn(rows, HEADS, device=cuda) * 4).to(torch.bfloat16).float() * (DIM**-0.5 * HEADS**-0.5)
    starts, pool = [], []
    for n in n_keys:  # each row's keys in its own stretch of one pool, after some padding
        starts.append(sum(k.shape[0] for k in pool) + 5)
        keys = fp4_values((n, DIM), cuda, key_octaves)
        if octaves == "3 and 10":  # every third key's blocks far apart: warps of either path
            keys[::3] = fp4_values((len(keys[::3]), DIM), cuda, 10)
        pool += [pack_index_keys(fp4_values((5, DIM), cuda)), pack_index_keys(keys)]
    pool = torch.cat(pool)
    key_start = torch.tensor(starts, dtype=torch.int32, device=cuda)
    n_dev = torch.tensor(n_keys, dtype=torch.int32, device=cuda)
    q8, qs = fp4_quantize(q)
    got = index_scores(q8, qs, w, pool, key_start, n_dev, max_keys)
    worst_rel, unequal = 0.0, 0
    for r, n in enumerate(n_keys):
        keys = unpack_index_keys(pool[starts[r] : starts[r] + n])
        ref = reference_scores(q[r : r + 1], keys, w[r : r + 1])[0]
        diff = (got[r, :n] - ref).abs()
        unequal += int((diff > 0).sum())
        worst_rel = max(worst_rel, float((diff / ref.abs().clamp_min(1e-30)).max()))
        assert bool((got[r, n:] == float("-inf")).all())
    print(f"\n  index scores {n_keys[:4]}{'…' if rows > 4 else ''}: {unequal} of {sum(n_keys)} differ from the reference, worst by {worst_rel:.1e} relative")
    # Bit-exact but where float64 sums in another order land on the other side of a rounding.
    assert unequal <= max(2, sum(n_keys) // 10000)
    assert worst_rel <= 2**-7  # one bf16 ulp


def test_a_prompt_chunks_rows_score_as_a_decode_steps(cuda):
    """A prompt chunk's rows share one sequence's keys, each seeing those before its position: the
    launch gives each row a CTA (its queries loaded once for all its key blocks) where a decode
    step's few rows spread their blocks over the SMs. Every key's score is the same, bit for bit."""
    rows, keys_max = 1200, 2048
    q8, qs = fp4_quantize(fp4_values((rows, HEADS, DIM), cuda, 3))
    w = (torch.randn(rows, HEADS, device=cuda) * 4).to(torch.bfloat16).float() * (DIM**-0.5 * HEADS**-0.5)
    pool = pack_index_keys(fp4_values((keys_max, DIM), cuda, 3))
    start = torch.zeros(rows, dtype=torch.int32, device=cuda)
    n = (torch.arange(rows, device=cuda) * keys_max // rows + 1).int()  # 1 .. 2047 keys
    chunk = index_scores(q8, qs, w, pool, start, n, keys_max)
    for first in (0, 597, rows - 8):  # a decode step of 8 of those rows
        step = index_scores(q8[first : first + 8], qs[first : first + 8], w[first : first + 8], pool, start[:8], n[first : first + 8], keys_max)
        assert torch.equal(step, chunk[first : first + 8])


def test_index_scores_form_the_head_weights_from_the_raw_projection(cuda):
    """The decode layer hands over weights_proj(x) as a float32 column slice of a wider projection:
    rounded to bf16 and scaled inside, it scores exactly as the weights formed beforehand."""
    rows, n = 3, 2000
    q8, qs = fp4_quantize(fp4_values((rows, HEADS, DIM), cuda))
    pool = pack_index_keys(fp4_values((rows * n, DIM), cuda))
    key_start = torch.arange(0, rows * n, n, dtype=torch.int32, device=cuda)
    n_dev = torch.full((rows,), n, dtype=torch.int32, device=cuda)
    projection = torch.randn(rows, 3 * HEADS, device=cuda) * 4  # [other outputs | weights_proj | more]
    raw = projection[:, HEADS : 2 * HEADS]
    scale = DIM**-0.5 * HEADS**-0.5
    formed = raw.to(torch.bfloat16).float() * scale
    want = index_scores(q8, qs, formed, pool, key_start, n_dev, n)
    got = index_scores(q8, qs, raw, pool, key_start, n_dev, n, weight_scale=scale, weights_bf16=True)
    assert raw.stride(0) == 3 * HEADS and torch.equal(got, want)


# Rows' key counts, and the row stride where it is longer than the longest row: a cache sized for
# 1M context holding short ones (most of the first pass's slices empty); rows of at most 2048 keys
# (topk_select_short), and long ones whose slices leave at most 2048 candidates (60000: 4 slices).
@pytest.mark.parametrize(
    "n_keys, stride", [([100], 0), ([2048, 700, 0, 1500, 513], 0), ([4096], 0), ([16384, 300, 16000], 0), ([60000], 0), ([262144, 1000], 0), ([131072, 300, 0], 0), ([1024, 5000, 20000, 0], 262144)]
)
@pytest.mark.parametrize("kind", ["bf16", "ties", "nudged", "float32"])
def test_topk(cuda, n_keys, stride, kind):
    """kind: the decode indexer's scores are bf16 values (the search then needs only their 16
    bits); ReLU'd scores repeat a lot ("ties": few distinct values, many zeros); "nudged": ties
    where a few keys at the k-th value are a float32 ulp above it (only the low bits tell them
    apart); float32: any scores."""
    rows, stride = len(n_keys), max(stride, *n_keys)
    scores = torch.randn(rows, stride, device=cuda)
    if kind != "float32":
        scores = scores.to(torch.bfloat16).float()
    if kind in ("ties", "nudged"):
        scores = (scores * 4).round().clamp_min(0) / 4
    for r, n in enumerate(n_keys):
        if kind == "nudged" and n > TOPK:
            kth = scores[r, :n].topk(TOPK).values[-1]
            at = (scores[r, :n] == kth).nonzero()[-3:, 0]
            scores[r, at] = torch.nextafter(kth, torch.tensor(float("inf"), device=cuda))
        scores[r, n:] = float("nan")  # past a row's count: never read
    n_dev = torch.tensor(n_keys, dtype=torch.int32, device=cuda)
    offset = torch.randint(0, 1000, (rows,), dtype=torch.int32, device=cuda)
    out = torch.full((rows, 128 + TOPK + 3), -7, dtype=torch.int32, device=cuda)
    topk_indices(scores, n_dev, TOPK, out=out, out_col=128, offset=offset)
    for r, n in enumerate(n_keys):
        k = min(TOPK, n)
        ref = select_topk(scores[r : r + 1, :n], k)[0].sort().values.int() + offset[r]
        assert torch.equal(out[r, 128 : 128 + k], ref), f"row {r}: picks differ"
        assert bool((out[r, 128 + k : 128 + TOPK] == -1).all())
    assert bool((out[:, :128] == -7).all()) and bool((out[:, 128 + TOPK :] == -7).all()), "wrote outside its columns"
