"""V4.1's cache row formats (model.md §5): window KV 512 × e4m3 + 16 UE8M0 scales (528 B),
compressed KV 512 × e2m1 + 32 E4M3 scales per 16 (288 B), index keys 128 × e2m1 + 4 UE8M0 scales
(68 B). Packing is the fake-quant, bit for bit, so a packed state decodes to exactly what the
reference's bf16 caches hold."""

from __future__ import annotations

import pytest
import torch

from dsuf.model import quant as q
from dsuf.model.state import V41_COMPRESSED_KV, V41_INDEX_KEYS, V41_WINDOW_KV


def rows(n: int, width: int, block: int, seed: int) -> torch.Tensor:
    """Random rows whose blocks span 2^-20 … 2^10, with exact zeros and ties mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g) * torch.exp2(torch.randint(-20, 10, (n, width // block), generator=g).float()).repeat_interleave(block, 1)
    x[0] = 0  # an all-zero row: the scale floors
    x[1, :block] = torch.tensor([6.0, 3.5, 2.5, 0.25, 0.75, 5.0, -1.25, -1.75] * (block // 8))  # e2m1 ties
    return x


@pytest.mark.parametrize(
    ("fmt", "width", "size", "fake"),
    [
        (V41_WINDOW_KV, 512, 528, lambda x: q.act_quant_fp8(x, 32)),
        (V41_COMPRESSED_KV, 512, 288, lambda x: q.fp4_fake_quant_e4m3(x, 16)),
        (V41_INDEX_KEYS, 128, 68, lambda x: q.fp4_fake_quant_ue8m0(x, 32)),
    ],
    ids=["window-fp8", "compressed-fp4-e4m3", "index-fp4-ue8m0"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_is_the_fake_quant_bit_for_bit(fmt, width, size, fake, dtype):
    x = rows(64, width, fmt.block, seed=width + size).to(dtype)
    packed = fmt.pack(x)
    assert packed.dtype == torch.uint8 and packed.shape == (64, size) == (64, fmt.row_bytes(width))
    assert fmt.width(size) == width
    values = fmt.unpack(packed)
    assert torch.equal(values, fake(x).float())
    assert torch.equal(values.to(torch.bfloat16).float(), values)  # every cached value is exact in bf16


def test_fp4_rows_with_e4m3_scales_byte_layout():
    """256 bytes of codes (even element in the low nibble), then 32 E4M3 scale bytes."""
    x = torch.zeros(1, 512)
    x[0, 0], x[0, 1] = 6.0, -0.5  # block 0: amax 6 -> scale 1 (e4m3 0x38)
    x[0, 16:32] = 0.75  # block 1: amax 0.75 -> scale 0.125 (e4m3 0x20), every value 6
    packed = V41_COMPRESSED_KV.pack(x)[0]
    assert packed[0].item() == 0x7 | (0x9 << 4)  # +6 low, -0.5 high
    assert packed[8:16].tolist() == [0x77] * 8
    assert packed[256].item() == 0x38 and packed[257].item() == 0x20
    assert packed[258].item() == torch.tensor(2.0**-9).to(torch.float8_e4m3fn).view(torch.uint8).item()  # floored empty block


def test_fp4_e4m3_scales_may_round_down_and_the_values_clamp_at_six():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 7.0, 2.0  # 7/6 -> e4m3 1.125: 7 / 1.125 > 6 clamps to 6
    values = V41_COMPRESSED_KV.unpack(V41_COMPRESSED_KV.pack(torch.cat((x, torch.zeros(1, 496)), 1)))[0, :2]
    assert values.tolist() == [6.75, 2.25]


def test_fp8_rows_with_ue8m0_scales_byte_layout():
    x = torch.zeros(1, 512)
    x[0, 0], x[0, 1] = 448.0, -1.0  # block 0: scale 1 (code 127)
    x[0, 32] = 449.0  # block 1: scale 2 (code 128), 449/2 -> 224
    packed = V41_WINDOW_KV.pack(x)[0]
    assert packed[:2].view(torch.float8_e4m3fn).float().tolist() == [448.0, -1.0]
    assert packed[512].item() == 127 and packed[513].item() == 128
    assert V41_WINDOW_KV.unpack(packed[None])[0, 32].item() == 448.0
