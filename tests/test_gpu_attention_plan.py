"""How the decode attention spreads a row over CTAs (`dsuf.gpu.attention.choose_splits`, which
sparse_attn.cu's attn_plan mirrors): pure arithmetic, specified here on the CPU. A launch is sized
for the index list's length (n_idx slots); each row is then planned from the slots it uses, within
that launch's CTAs. Its splits must fit the partial outputs allocated for the launch's plan (else
the kernel would write past them); a row using every slot gets the launch's own plan; a row whose
own plan fits the launch gets exactly that plan (a long-context server's short rows run as in a
cache sized for them)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from dsuf.gpu.attention import TILE, attention_kernel, choose_splits, launch_room

SMS = (132, 148)  # H200, B200
ROWS = (1, 2, 3, 8, 16, 32, 64, 132, 300)
HEADS = (64, 32, 16, 8)
N_IDX = (128, 160, 640, 2176, 8320, 128 + 65536 // 128)


def launches() -> Iterator[tuple[int, int, int, int, int, int, int]]:
    """(sms, rows, heads, n_idx, most heads a CTA of the kernel holds, CTAs a row, splits of room
    a row) of every launch shape checked."""
    for sms, rows, heads, n_idx in itertools.product(SMS, ROWS, HEADS, N_IDX):
        cap = attention_kernel(heads, rows, sms)[2]
        yield sms, rows, heads, n_idx, cap, *launch_room(n_idx, rows, sms, heads, cap)


def test_the_kernel_for_a_launch() -> None:
    """CTAs of up to 32 heads (two an SM) for a rank of 32 heads or fewer and for prompt chunks,
    whose rows fill the SMs; 64 heads at decode in one CTA's reach (16-head tiles split wider)."""
    for sms, rows, heads in itertools.product(SMS, ROWS, HEADS):
        name, shared, cap = attention_kernel(heads, rows, sms)
        assert cap == (32 if heads <= 32 or rows >= sms else 64)
        assert name == ("sparse_attn_decode_h32" if cap == 32 else "sparse_attn_decode")
        assert shared <= (227 << 10) // (2 if cap == 32 else 1), "the CTAs an SM must fit its shared memory"


def test_a_row_plans_within_the_launch_and_its_partial_outputs() -> None:
    for sms, rows, heads, n_idx, cap, ctas, room in launches():
        for used in range(1, n_idx + 1, TILE // 2):
            splits, per_split, head_tile = choose_splits(used, rows, sms, heads, ctas=ctas, head_cap=cap)
            where = f"sms {sms}, rows {rows}, heads {heads}, n_idx {n_idx}, used {used}"
            assert head_tile <= cap, f"{where}: more heads than a CTA holds"
            assert splits * math.ceil(heads / head_tile) <= ctas, where
            assert splits <= room, where
            assert splits * per_split >= used and (splits - 1) * per_split < used, f"{where}: a split empty or a slot left out"


def test_a_row_using_every_slot_gets_the_launchs_plan() -> None:
    for sms, rows, heads, n_idx, cap, ctas, _ in launches():
        assert choose_splits(n_idx, rows, sms, heads, ctas=ctas, head_cap=cap) == choose_splits(n_idx, rows, sms, heads, head_cap=cap)


def test_a_short_row_in_a_long_list_runs_as_in_a_list_sized_for_it() -> None:
    for sms, rows, heads, n_idx, cap, ctas, _ in launches():
        for used in range(1, n_idx + 1, TILE // 2):
            if launch_room(used, rows, sms, heads, cap)[0] <= ctas:
                assert choose_splits(used, rows, sms, heads, ctas=ctas, head_cap=cap) == choose_splits(used, rows, sms, heads, head_cap=cap)
    # The case the change was made for: an HCA row at 4k context in caches for 1M tokens, batch 1.
    assert choose_splits(160, 1, 132, 64, ctas=launch_room(128 + (1 << 20) // 128, 1, 132, 64)[0]) == choose_splits(160, 1, 132, 64) == (5, 32, 16)
