"""How a prompt chunk's routed pairs are cut into moe_prefill_fp4's tiles (`dsuf.gpu.moe.prefill_tiles`,
the kernel moe_prefill_tiles): made on the device so that the chunk's MoE never waits for the
host. The pairs are sorted by expert; each expert's run is cut into tiles of at most
PREFILL_COLS pairs, in expert order, and the rows after the last tile hold no pairs. The row count
depends on the pair count alone (it sizes the launch before the routing is known on the host) and
must hold the tiles of any routing."""

from __future__ import annotations

import pytest
import torch

from dsuf.gpu.moe import PREFILL_COLS, prefill_tiles

EXPERTS = 256


def expected_tiles(counts: list[int]) -> list[list[int]]:
    """(expert, first pair, pairs) of each tile, from the experts' pair counts."""
    tiles, start = [], 0
    for e, n in enumerate(counts):
        tiles += [[e, p, min(PREFILL_COLS, start + n - p)] for p in range(start, start + n, PREFILL_COLS)]
        start += n
    return tiles


def routings() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(5)
    spread = torch.multinomial(torch.rand(EXPERTS, generator=gen), 8192 * 6, replacement=True, generator=gen)
    return {
        "an 8k chunk's six experts a token": torch.bincount(spread, minlength=EXPERTS).tolist(),
        "every pair to one expert": [0] * 7 + [8192 * 6] + [0] * (EXPERTS - 8),
        "a pair an expert": [1] * EXPERTS,
        "one pair past a tile, every expert (most tiles for the pairs)": [PREFILL_COLS + 1] * EXPERTS,
        "whole tiles and empty experts": [PREFILL_COLS * (e % 3) for e in range(EXPERTS)],
        "no pairs": [0] * EXPERTS,
    }


@pytest.mark.parametrize("name", list(routings()))
def test_each_experts_run_in_tiles_of_at_most_prefill_cols_then_empty_rows(name: str, cuda: torch.device) -> None:
    counts = routings()[name]
    ends = torch.tensor(counts).cumsum(0).to(cuda)
    pairs = sum(counts)
    tiles = prefill_tiles(ends, pairs).cpu()
    assert tiles.dtype == torch.int32 and tuple(tiles.shape) == (pairs // PREFILL_COLS + EXPERTS, 3)
    want = expected_tiles(counts)
    assert tiles[: len(want)].tolist() == want
    assert bool((tiles[len(want) :, 2] == 0).all()), "rows after the tiles must hold no pairs"
