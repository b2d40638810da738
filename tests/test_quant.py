"""Specification tests for dsuf.model.quant: the codecs must be bit-exact."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsuf.model import quant as q

F32 = torch.float32


def bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns, for comparisons that must also see -0 and every ulp."""
    return t.to(F32).contiguous().view(torch.int32)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def ref_ceil_log2(v: np.ndarray) -> np.ndarray:
    """ceil(log2 v) for positive finite v via frexp (v = m * 2**e, 0.5 <= m < 1)."""
    m, e = np.frexp(v.astype(np.float64))
    return np.where(m == 0.5, e - 1, e)


# ---------------------------------------------------------------- e4m3 ----

ALL_E4M3_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
E4M3_ALL = ALL_E4M3_BYTES.view(torch.float8_e4m3fn).to(F32)
FINITE = ~torch.isnan(E4M3_ALL)


def test_e4m3_has_exactly_two_nan_bytes():
    assert (~FINITE).nonzero().flatten().tolist() == [0x7F, 0xFF]


def test_every_e4m3_byte_round_trips_through_round_e4m3():
    vals = E4M3_ALL[FINITE]
    back = q.round_e4m3(vals).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(back, ALL_E4M3_BYTES[FINITE])  # includes -0 (0x80) and subnormals


def test_e4m3_midpoints_round_to_even_mantissa():
    # Non-negative values in increasing order are bytes 0x00..0x7E; negatives mirror.
    pos = E4M3_ALL[:0x7F]
    assert torch.all(pos[1:] > pos[:-1])
    mid = (pos[:-1] + pos[1:]) / 2  # <= 5 significant bits: exact in float32
    lower = torch.arange(0x7E)
    even_byte = torch.where(lower % 2 == 0, lower, lower + 1)
    expect = pos[even_byte]
    assert torch.equal(bits(q.round_e4m3(mid)), bits(expect))
    assert torch.equal(bits(q.round_e4m3(-mid)), bits(-expect))
    # A hair either side of a midpoint goes to the nearer neighbour, not the even one.
    below = torch.nextafter(mid, torch.full_like(mid, -1.0))
    above = torch.nextafter(mid, torch.full_like(mid, 1e9))
    assert torch.equal(q.round_e4m3(below), pos[:-1])
    assert torch.equal(q.round_e4m3(above), pos[1:])


def test_e4m3_hand_examples():
    x = torch.tensor([1.0625, 1.1875, 2**-10, 3 * 2**-10, 2**-10 * 0.99, 248.0, 232.0, 17.0])
    # 1.0625 = midpoint of 1 and 1.125 -> 1 (even); 1.1875 -> 1.25 (even);
    # 2^-10 = half the smallest subnormal -> 0; 3*2^-10 between 2^-9 and 2^-8 -> 2^-8 (even);
    # 248 between 240 and 256 -> 256 (even); 232 between 224 and 240 -> 224 (even); 17 between 16 and 18 -> 16.
    expect = torch.tensor([1.0, 1.25, 0.0, 2**-8, 0.0, 256.0, 224.0, 16.0])
    assert torch.equal(q.round_e4m3(x), expect)


def test_e4m3_saturates_at_448():
    x = torch.tensor([448.0, 449.0, 464.0, 480.0, 1e6, math.inf, -449.0, -1e30, -math.inf])
    expect = torch.tensor([448.0, 448.0, 448.0, 448.0, 448.0, 448.0, -448.0, -448.0, -448.0])
    assert torch.equal(q.round_e4m3(x), expect)
    assert q.round_e4m3(x).dtype == F32


# ---------------------------------------------------------------- e2m1 ----

MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_table_and_decode():
    assert q.E2M1_VALUES.dtype == F32
    assert q.E2M1_VALUES.tolist() == MAGS + [-m for m in MAGS]
    assert torch.signbit(q.E2M1_VALUES[8])  # code 8 is -0
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(bits(q.e2m1_decode(codes)), bits(q.E2M1_VALUES))
    assert torch.equal(q.e2m1_encode(q.E2M1_VALUES[torch.arange(16) != 8]),
                       codes[torch.arange(16) != 8])


@pytest.mark.parametrize(
    "x, code",
    [
        (0.25, 0), (1.25, 2), (2.5, 4), (5.0, 6),      # ties down to the even mantissa
        (0.75, 2), (1.75, 4), (3.5, 6),                # ties up to the even mantissa
        (-0.25, 8), (-1.25, 10), (-2.5, 12), (-5.0, 14),
        (-0.75, 10), (-1.75, 12), (-3.5, 14),
        (0.0, 0), (-0.1, 8), (0.1, 0), (-0.0, 0),      # -0 code only for negative inputs
        (6.0, 7), (7.0, 7), (100.0, 7), (-1e9, 15),   # saturate at ±6
        (5.01, 7), (4.99, 6), (0.26, 1), (0.74, 1),
    ],
)
def test_e2m1_encode_cases(x, code):
    assert q.e2m1_encode(torch.tensor([x])).item() == code


def _brute_force_e2m1(x: np.ndarray) -> np.ndarray:
    """Nearest table value by exhaustive search; ties go to the even code."""
    mags = np.array(MAGS, dtype=np.float64)
    a = np.minimum(np.abs(x.astype(np.float64)), 6.0)
    d = np.abs(a[:, None] - mags[None, :])
    best = d == d.min(axis=1, keepdims=True)
    even = best & (np.arange(8)[None, :] % 2 == 0)
    idx = np.where(best.sum(axis=1) > 1, even.argmax(axis=1), best.argmax(axis=1))
    return np.where(x < 0, idx | 8, idx).astype(np.uint8)


def test_e2m1_matches_brute_force_nearest():
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=g) * 3
    mids = torch.tensor(MAGS[:-1]) / 2 + torch.tensor(MAGS[1:]) / 2
    ties = torch.cat((mids, -mids)).repeat(10)
    x = torch.cat((rand, ties, torch.tensor([0.0, 6.0, -6.0, 9.0, -9.0])))
    expect = torch.from_numpy(_brute_force_e2m1(x.numpy()))
    assert torch.equal(q.e2m1_encode(x), expect)
    assert torch.equal(bits(q.round_e2m1(x)), bits(q.e2m1_decode(expect)))


def test_pack_unpack_fp4():
    assert q.pack_fp4(torch.tensor([1, 2], dtype=torch.uint8)).view(torch.uint8).tolist() == [0x21]
    packed = q.pack_fp4(torch.tensor([[15, 8, 0, 7]], dtype=torch.uint8))
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x8F, 0x70]]
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g).to(torch.uint8)
    p = q.pack_fp4(codes)
    assert p.shape == (3, 5, 32)
    assert torch.equal(q.unpack_fp4(p), codes)
    assert torch.equal(q.unpack_fp4(p.view(torch.uint8)), codes)
    with pytest.raises(ValueError):
        q.pack_fp4(torch.zeros(3, dtype=torch.uint8))


# ---------------------------------------------------------------- e8m0 ----

def test_e8m0_round_trip_all_codes():
    codes = torch.arange(255, dtype=torch.int32).to(torch.uint8)
    dec = q.e8m0_decode(codes)
    assert dec.dtype == F32
    assert dec.tolist() == [math.ldexp(1.0, c - 127) for c in range(255)]  # incl. 2^-127
    assert q.e8m0_decode(torch.tensor([127], dtype=torch.uint8)).item() == 1.0
    assert torch.equal(q.e8m0_decode(codes.view(torch.float8_e8m0fnu)), dec)
    assert torch.equal(dec, codes.view(torch.float8_e8m0fnu).to(F32))  # agrees with torch
    assert torch.equal(q.e8m0_encode(dec), codes)
    assert q.e8m0_encode(dec).dtype == torch.uint8
    assert torch.isnan(q.e8m0_decode(torch.tensor([255], dtype=torch.uint8))).all()


@pytest.mark.parametrize("bad", [3.0, 0.75, 0.0, -0.0, -1.0, math.inf, math.nan, 2.0**-128])
def test_e8m0_encode_rejects_non_powers_of_two(bad):
    with pytest.raises(ValueError):
        q.e8m0_encode(torch.tensor([1.0, bad]))


def test_ceil_log2_exact_matches_frexp():
    g = torch.Generator().manual_seed(2)
    x = torch.exp2(torch.randn(5000, generator=g) * 30)
    p2 = torch.exp2(torch.arange(-126, 128, dtype=F32))
    x = torch.cat((x, p2, torch.nextafter(p2, torch.zeros_like(p2)), torch.nextafter(p2, p2 * 4)))
    x = x[torch.isfinite(x) & (x >= 2.0**-126)]
    got = q.ceil_log2_exact(x)
    assert got.dtype == torch.int32
    assert got.tolist() == ref_ceil_log2(x.numpy()).tolist()


# ------------------------------------------------------- weight codecs ----

def test_fp8_weight_round_trip_ragged_blocks():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(130, 200, generator=g) * torch.exp2(torch.randint(-8, 8, (130, 1), generator=g))
    w[128:, 128:] = 0.0  # an all-zero ragged corner block uses the amax floor
    qw, s = q.quant_fp8_weight(w, 128)
    assert qw.dtype == torch.float8_e4m3fn and qw.shape == (130, 200)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (2, 2)
    scale = q.e8m0_decode(s)
    for i in range(2):
        for j in range(2):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = max(blk.abs().max().item(), 1e-4)
            assert scale[i, j].item() == 2.0 ** math.ceil(math.log2(np.float32(amax / 448.0)))
    full = scale.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :200]
    deq = q.dequant_fp8_weight(qw, s, 128)
    assert torch.equal(deq, q.round_e4m3(w / full) * full)
    assert torch.equal(q.dequant_fp8_weight(qw, s.view(torch.uint8), 128), deq)
    # Already-quantised weights survive a second trip unchanged.
    qw2, s2 = q.quant_fp8_weight(deq, 128)
    assert torch.equal(q.dequant_fp8_weight(qw2, s2, 128), deq)
    with pytest.raises(ValueError):
        q.dequant_fp8_weight(qw, s[:1], 128)


def test_fp4_weight_round_trip():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 128, generator=g) * torch.exp2(torch.randint(-10, 10, (6, 4), generator=g)
                                                     ).repeat_interleave(32, 1)
    w[0, :32] = 0.0
    packed, s = q.quant_fp4_weight(w)
    assert packed.dtype == torch.int8 and packed.shape == (6, 64)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (6, 4)
    scale = q.e8m0_decode(s)
    assert scale[0, 0].item() == 2.0**-126  # the amax floor
    amax = w.unflatten(1, (4, 32)).abs().amax(-1).clamp_min(6 * 2.0**-126)
    assert torch.all(scale >= amax / 6) and torch.all(scale < amax / 3)
    full = scale.repeat_interleave(32, 1)
    deq = q.dequant_fp4_weight(packed, s)
    assert torch.equal(deq, q.round_e2m1(w / full) * full)
    # Re-quantising the dequantised weight reproduces its values exactly.  (Codes and
    # scales may change: a block whose amax rounded down to 3*scale gets half the
    # scale, and a -0 code becomes +0.)
    packed2, s2 = q.quant_fp4_weight(deq)
    assert torch.equal(q.dequant_fp4_weight(packed2, s2), deq)


def test_fp4_weight_hand_example():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([12.0, -3.0, 1.0, 5.0])  # amax 12 -> scale 2
    packed, s = q.quant_fp4_weight(w)
    assert s.view(torch.uint8).item() == 128
    # 12/2=6 -> 7; -1.5 -> 11; 0.5 -> 1; 2.5 ties down to 2 -> 4
    assert packed.view(torch.uint8)[0, :2].tolist() == [0xB7, 0x41]
    assert q.dequant_fp4_weight(packed, s)[0, :4].tolist() == [12.0, -3.0, 1.0, 4.0]


# --------------------------------------------------- activation quant ----

def test_act_quant_fp8_values_are_representable():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 512, generator=g) * torch.exp2(torch.randint(-20, 20, (8, 4), generator=g)
                                                     ).repeat_interleave(128, 1)
    y = q.act_quant_fp8(x, 128)
    xb, yb = x.unflatten(1, (4, 128)), y.unflatten(1, (4, 128))
    amax = np.maximum(xb.abs().amax(-1).numpy(), np.float32(1e-4))
    k = ref_ceil_log2(amax * np.float32(1 / 448))  # float32 multiply, as the kernel does
    scale = torch.from_numpy(np.ldexp(np.float32(1), k).astype(np.float32))[..., None]
    ratio = yb / scale
    assert torch.equal(q.round_e4m3(ratio), ratio) and ratio.abs().max() <= 448
    assert torch.equal(yb, q.round_e4m3(xb / scale) * scale)


def test_act_quant_fp8_hand_examples():
    x = torch.zeros(4, 4)
    x[0] = torch.tensor([448.0, 1.0, -3.0, 0.3])   # amax 448 -> scale 1
    x[1] = torch.tensor([449.0, 1.0, -3.0, 17.0])  # amax 449 -> scale 2
    x[2] = torch.tensor([5e-5, -1e-5, 0.0, 3e-5])  # amax < 1e-4 -> floor -> scale 2^-22
    y = q.act_quant_fp8(x, 4)
    assert y[0].tolist() == [448.0, 1.0, -3.0, float(q.round_e4m3(torch.tensor(0.3)))]
    # 449/2 = 224.5 -> 224; 17/2 = 8.5 ties to 8 (even) -> 16
    assert y[1].tolist() == [448.0, 1.0, -3.0, 16.0]
    s = 2.0**-22
    # 5e-5/s = 209.7 -> 208 (step 16); 1e-5/s = 41.9 -> 40 (step 4); 3e-5/s = 125.8 -> 128 (step 8)
    assert y[2].tolist() == [208 * s, -40 * s, 0.0, 128 * s]
    assert y[3].tolist() == [0.0] * 4
    # The scale is 2^ceil(log2(amax/448)) exactly at and just past a power of two; the
    # smallest subnormal step (2^-9 * scale) shows which scale was picked.
    above = torch.nextafter(torch.tensor(448.0), torch.tensor(1e9)).item()
    z = torch.tensor([[224.0, 2.0**-10], [448.0, 2.0**-9], [above, 2.0**-9], [896.0, 2.0**-8]])
    assert q.act_quant_fp8(z, 2).tolist() == [
        [224.0, 2.0**-10],  # scale 1/2
        [448.0, 2.0**-9],   # scale 1
        [448.0, 0.0],       # scale 2: 2^-10 is a tie between 0 and 2^-9 -> 0
        [896.0, 2.0**-8],   # scale 2
    ]


def test_act_quant_fp8_idempotent_and_bf16():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(16, 256, generator=g) * 10
    y = q.act_quant_fp8(x, 128)
    assert torch.equal(q.act_quant_fp8(y, 128), y)
    xb = x.to(torch.bfloat16)
    yb = q.act_quant_fp8(xb, 128)
    assert yb.dtype == torch.bfloat16
    assert_bit_equal(yb, q.act_quant_fp8(xb.float(), 128).to(torch.bfloat16))
    with pytest.raises(ValueError):
        q.act_quant_fp8(torch.zeros(2, 100), 128)


def test_fp4_fake_quant_ue8m0_hand_examples():
    x = torch.tensor([
        [6.0, 3.0, 1.2, -0.3],    # amax 6 -> scale 1
        [7.0, 2.5, -0.6, 0.0],    # amax 7 -> scale 2: 3.5->4, 1.25->1, -0.3->-0.5
        [0.0, 0.0, 0.0, 0.0],     # floor: scale 2^-126, all zero
        [1.0, 0.25, 0.75, -1.0],  # amax 1 -> 1/6 -> scale 2^-2: 4, 1, 3, -4
    ])
    y = q.fp4_fake_quant_ue8m0(x, 4)
    assert y.tolist() == [
        [6.0, 3.0, 1.0, -0.5],
        [8.0, 2.0, -1.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],
        [1.0, 0.25, 0.75, -1.0],
    ]
    xb = torch.tensor([[7.0, 2.5, -0.6, 0.0]], dtype=torch.bfloat16)
    assert q.fp4_fake_quant_ue8m0(xb, 4).dtype == torch.bfloat16
    assert torch.equal(q.fp4_fake_quant_ue8m0(y, 4), y)  # idempotent


def test_fp4_fake_quant_e4m3_hand_examples():
    x = torch.zeros(3, 16)
    x[0, :3] = torch.tensor([6.0, 2.0, -0.7])  # amax 6 -> scale 1
    x[1, :3] = torch.tensor([7.0, 2.0, -0.7])  # 7/6 -> e4m3 1.125 (rounds down); 7/1.125 > 6
    x[2, :2] = torch.tensor([1e-6, -1e-6])     # floor: scale 2^-9, rounds to 0
    y = q.fp4_fake_quant_e4m3(x)
    assert y[0, :3].tolist() == [6.0, 2.0, -0.5]
    # 7/1.125 = 6.22 -> clamp 6 -> 6.75; 2/1.125 = 1.78 -> 2 -> 2.25; 0.7/1.125 = 0.62 -> 0.5
    assert y[1, :3].tolist() == [6.75, 2.25, -0.5625]
    assert torch.all(y[:, 3:] == 0) and torch.all(y[2] == 0)
    # amax/6 is a float32 division: 7.125/6 = 1.1875 is an e4m3 tie -> 1.25 (even), while
    # the float32 just below 7.125 divides to just under the tie -> 1.125.
    below = torch.nextafter(torch.tensor(7.125), torch.tensor(0.0)).item()
    z = torch.zeros(2, 16)
    z[0, 0], z[1, 0] = 7.125, below
    assert q.fp4_fake_quant_e4m3(z)[:, 0].tolist() == [7.5, 6.75]  # 6 * 1.25, 6 * 1.125


def test_fp4_fake_quant_e4m3_never_exceeds_six_scales():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-12, 8, (64, 16), generator=g)
                                                      ).repeat_interleave(16, 1)
    y = q.fp4_fake_quant_e4m3(x, 16)
    xb, yb = x.unflatten(1, (16, 16)), y.unflatten(1, (16, 16))
    scale = q.round_e4m3(xb.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-9) / 6)
    assert torch.all(yb.abs() <= 6 * scale)
    assert torch.equal(yb, q.round_e2m1((xb / scale).clamp(-6, 6)) * scale)
    assert torch.any(xb.abs() > 6 * scale)  # the clamp matters: some scales rounded down


# ------------------------------------------------------------ hadamard ----

def test_hadamard_small_orders():
    r = 2**-0.5
    assert torch.equal(q.hadamard_matrix(1), torch.ones(1, 1))
    assert torch.equal(q.hadamard_matrix(2), torch.tensor([[r, r], [r, -r]], dtype=F32))
    h4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=F32) / 2
    assert torch.equal(q.hadamard_matrix(4), h4)
    assert q.hadamard_matrix(64) is q.hadamard_matrix(64)  # cached
    with pytest.raises(ValueError):
        q.hadamard_matrix(12)


@pytest.mark.parametrize("n", [8, 128, 1024])
def test_hadamard_orthonormal(n):
    h = q.hadamard_matrix(n).double()
    assert torch.equal(h, h.T)
    assert (h @ h - torch.eye(n, dtype=torch.float64)).abs().max() < 1e-6


def test_hadamard_transform_preserves_dot_products():
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(10, 256, generator=g), torch.randn(10, 256, generator=g)
    ta, tb = q.hadamard_transform(a), q.hadamard_transform(b)
    assert ((ta * tb).sum(-1) - (a * b).sum(-1)).abs().max() < 1e-4
    assert (q.hadamard_transform(ta) - a).abs().max() < 1e-5  # H is an involution
    bf = q.hadamard_transform(a.to(torch.bfloat16))
    assert bf.dtype == torch.bfloat16
