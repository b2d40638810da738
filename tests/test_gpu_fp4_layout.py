"""The routed experts' FP4 kernel layout (`dsuf.gpu.moe.permute_fp4`, `fp4_kernel_layout`) and the conversion the MoE
kernels make of it (kernels_cu/fp4.cuh: `fp4_e4m3`, `fp4_e4m3_table`), specified on the CPU. The
kernels' byte permutes are emulated here bit for bit (PTX `prmt.b32`), so the layout, the tables
and the operations are checked together against the e2m1 values they must give."""

from __future__ import annotations

import pytest
import torch

from dsuf.gpu.moe import fp4_kernel_layout, permute_fp4
from dsuf.model.quant import E2M1_VALUES

LO, HI = 0x0C080400, 0x1C181410  # fp4_e4m3_unscaled: the decode kernels' table


def prmt(lo: int, hi: int, selector: int) -> int:
    """prmt.b32 in its default mode: byte n of the result is byte (selector nibble n) & 7 of
    {hi, lo}, or that byte's sign replicated where the nibble's bit 3 is set."""
    source, out = (hi << 32) | lo, 0
    for n in range(4):
        nibble = (selector >> 4 * n) & 0xF
        byte = (source >> 8 * (nibble & 7)) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * n
    return out


def fp4_e4m3(w: int, lo: int, hi: int) -> tuple[int, int]:
    mag = w & 0x77777777
    return prmt(lo, hi, mag) | (w & 0x80808080), prmt(lo, hi, mag >> 16) | ((w << 4) & 0x80808080)


def fp4_e4m3_table(o: int) -> tuple[int, int]:
    o8 = o << 3
    return 0x0C080000 + o8 * 0x01010000 + (max(o8, 4) << 8), HI + o8 * 0x01010101


def words(t: torch.Tensor) -> list[int]:
    return [int(x) & 0xFFFFFFFF for x in t.contiguous().view(torch.int32).reshape(-1)]


def placed(word: bytes) -> int:
    """A checkpoint word's bits where permute_fp4's docstring puts them: byte j's even element
    (low nibble) with its magnitude at bits 4j.. and its sign at 8j + 7, its odd element (high
    nibble) with its magnitude at 16 + 4j.. and its sign at 8j + 3."""
    out = 0
    for j, byte in enumerate(word):
        even, odd = byte & 0xF, byte >> 4
        out |= (even & 7) << 4 * j | (even >> 3) << 8 * j + 7 | (odd & 7) << 16 + 4 * j | (odd >> 3) << 8 * j + 3
    return out


def test_word_4t_plus_i_of_a_chunk_is_the_checkpoints_word_4i_plus_t_with_its_bits_placed():
    old = torch.randint(0, 256, (3, 256), dtype=torch.uint8)
    new = permute_fp4(old.view(torch.int8))
    assert new.dtype == torch.uint8 and new.shape == old.shape
    for row in range(3):
        got = words(new[row])
        for chunk in range(4):
            for t in range(4):
                for i in range(4):
                    at = 64 * chunk + 16 * i + 4 * t
                    assert got[16 * chunk + 4 * t + i] == placed(bytes(old[row, at : at + 4].tolist()))


def test_every_code_in_every_place_converts_to_its_e2m1_value_times_2_to_the_o_minus_6():
    """Every byte value in every byte place of a word, through the table of every shift o in
    0..12 (o = 0: the decode kernels' fixed table): the e4m3 bytes are exactly e2m1(code) *
    2**(o - 6), signed zeros included; byte j of `even` from byte j's low nibble, of `odd` from
    its high nibble."""
    assert fp4_e4m3_table(0) == (LO, HI)
    codes = torch.arange(256, dtype=torch.uint8)
    for j in range(4):
        chunk = torch.randint(0, 256, (256, 64), dtype=torch.uint8)
        chunk[:, j] = codes  # byte j of the chunk's word 0, which stays word 0
        converted = [words(row)[0] for row in permute_fp4(chunk)]
        for o in range(13):
            lo, hi = fp4_e4m3_table(o)
            for byte, w in zip(range(256), converted):
                even, odd = fp4_e4m3(w, lo, hi)
                for half, nibble in ((even, byte & 0xF), (odd, byte >> 4)):
                    want = (E2M1_VALUES[nibble] * 2.0 ** (o - 6)).reshape(1).to(torch.float8_e4m3fn).view(torch.uint8).item()
                    assert (half >> 8 * j) & 0xFF == want, (o, byte, j)


def test_a_tiles_chunk_is_one_run_of_its_rows_permuted_chunks():
    """fp4_kernel_layout: experts stacked [E, N, K/2]; chunk c (bytes 64c..64c + 63 of every row,
    permuted) of rows 128j..128j + 127 is the 8 KB at (j * K/128 + c) * 8 KB of the matrices'
    bytes, row 128j + r at 64r in it (the run moe_prefill_fp4 copies; a decode warp's 16 rows are
    1 KB of it)."""
    experts, n, k = 2, 384, 1024
    packed = torch.randint(-128, 128, (experts, n, k // 2), dtype=torch.int8)
    tiled = fp4_kernel_layout(packed)
    assert tiled.dtype == torch.uint8 and tiled.shape == packed.shape
    flat, rows = tiled.reshape(-1), permute_fp4(packed).reshape(experts * n, k // 2)
    chunks = k // 128
    for j in range(experts * n // 128):
        for c in range(chunks):
            run = flat[(j * chunks + c) * 8192 : (j * chunks + c + 1) * 8192].view(128, 64)
            assert torch.equal(run, rows[128 * j : 128 * (j + 1), 64 * c : 64 * (c + 1)]), (j, c)


def test_the_tiled_layout_needs_whole_tiles_of_rows():
    with pytest.raises(ValueError, match="multiple of 128"):
        fp4_kernel_layout(torch.zeros((2, 192, 512), dtype=torch.int8))
