"""Where the GPU path's decode step reads and writes in its caches (`dsuf.gpu.layer.step_index`,
`LayerCache`): pure torch, so it is specified here, on the CPU, against the reference's visibility
rules (`dsuf.model.v4`): window attention sees the last W positions, compressed entry j exists
once its group is complete and is visible to query i iff j < (i + 1) // ratio. A step may hold a
prompt chunk (rows of one sequence at consecutive positions): no row's write may land where an
earlier row of the chunk still reads. A longer prefill chunk keeps its KV in scratch entries after
the slots and hands its last W positions to the ring afterwards."""

from __future__ import annotations

import pytest
import torch

from dsuf.gpu.layer import PREFILL_CHUNK, LayerCache, layer_rope, ring_size, step_index
from dsuf.gpu.weights import V4_FLASH_CONFIG
from dsuf.model.config import parse_config

C = parse_config(V4_FLASH_CONFIG)
W = C.window_size
RING = ring_size(C)
CONTEXT = 4096
SLOTS = 5
POSITIONS = [0, 1, 3, 4, 126, 127, 128, 129, 511, 512, 1000, CONTEXT - 1]


SCRATCH = 2048


def index_of(ratio: int, slots: list[int], positions: list[int], chunk: bool = False):
    cache = LayerCache.new(C, ratio, SLOTS, CONTEXT, torch.device("cpu"), scratch=SCRATCH)
    scratch = cache.chunk_at(positions[0], len(positions)) if chunk else None
    ix = step_index(C, ratio, cache.n_max, layer_rope(C, ratio, torch.device("cpu")), torch.tensor(slots), torch.tensor(positions), scratch)
    return cache, ix


def test_each_slot_owns_its_ring_then_its_compressed_entries() -> None:
    assert RING == W + PREFILL_CHUNK
    for ratio, n_max in ((0, 0), (4, CONTEXT // 4), (128, CONTEXT // 128)):
        cache, _ = index_of(ratio, [0], [0])
        assert cache.stride == RING + n_max and cache.pool.shape[0] == SLOTS * (RING + n_max) + SCRATCH
        if ratio == 4:
            assert cache.keys.shape[0] == SLOTS * n_max and cache.idx_kv.shape[0] == SLOTS


def test_the_window_holds_exactly_the_last_w_positions() -> None:
    slots = [s % (SLOTS - 1) + 1 for s in range(len(POSITIONS))]
    cache, ix = index_of(0, slots, POSITIONS)
    for row, (slot, pos) in enumerate(zip(slots, POSITIONS)):
        base = slot * cache.stride
        assert int(ix.window_slot[row]) == base + pos % RING  # the ring slot of this token
        picked = sorted(int(e) for e in ix.attn_idx[row] if e >= 0)
        held = sorted(base + p % RING for p in range(max(0, pos - W + 1), pos + 1))  # ring slots of visible positions
        assert picked == held, f"position {pos}"
        assert ix.attn_idx.shape[1] == W


def test_hca_rows_attend_to_every_complete_group_and_write_the_one_they_complete() -> None:
    ratio = 128
    slots = [2] * len(POSITIONS)
    cache, ix = index_of(ratio, slots, POSITIONS)
    for row, pos in enumerate(POSITIONS):
        base = 2 * cache.stride
        compressed = sorted(int(e) for e in ix.attn_idx[row, W:] if e >= 0)
        assert compressed == [base + RING + j for j in range((pos + 1) // ratio)], f"position {pos}"
        assert bool((ix.attn_idx[row, int(ix.attn_used[row]) :] == -1).all()) and int(ix.attn_used[row]) == W + (pos + 1) // ratio
        assert int(ix.comp_slot[row]) == base + RING + pos // ratio  # written only if (pos + 1) % ratio == 0
        assert int(ix.comp_base[row]) == base + RING and int(ix.positions[row]) == pos


def test_csa_rows_score_the_visible_index_keys_and_leave_the_picks_to_the_top_k() -> None:
    slots = [1, 4, 3, 1, 2, 4, 3, 2, 1, 4, 3, 2]
    cache, ix = index_of(4, slots, POSITIONS)
    assert ix.attn_idx.shape[1] == W + C.index_topk and bool((ix.attn_idx[:, W:] == -1).all())
    for row, (slot, pos) in enumerate(zip(slots, POSITIONS)):
        assert int(ix.key_start[row]) == slot * cache.n_max
        assert int(ix.n_keys[row]) == (pos + 1) // 4
        assert int(ix.key_row[row]) == slot * cache.n_max + pos // 4
        assert int(ix.attn_used[row]) == W + min(C.index_topk, (pos + 1) // 4)  # the top-k fills no slot past it


def test_rope_tables_follow_each_rows_position() -> None:
    _, ix = index_of(4, [1, 2], [5, 70000 % CONTEXT])
    rope = layer_rope(C, 4, torch.device("cpu"))
    cos, sin = rope.cos_sin(torch.tensor([5, 70000 % CONTEXT]))
    assert torch.equal(ix.cos, cos) and torch.equal(ix.sin, sin)


def test_a_prompt_chunk_never_overwrites_what_its_earlier_rows_read() -> None:
    """A chunk of PREFILL_CHUNK rows of one sequence writes all its KV before any row attends: every
    row still finds the last W positions it sees in the ring, and no two rows write one entry."""
    for start in (0, 5, W - 1, 1000):
        positions = list(range(start, start + PREFILL_CHUNK))
        cache, ix = index_of(0, [3] * len(positions), positions)
        written = [int(e) for e in ix.window_slot]
        assert len(set(written)) == len(written)
        holds = {e: p for p, e in zip(positions, written)}  # what the chunk leaves in the ring
        for row, pos in enumerate(positions):
            for e in ix.attn_idx[row].tolist():
                if e >= 0 and e in holds:
                    assert holds[e] <= pos and holds[e] > pos - W, f"row at {pos} reads entry {e}, which holds position {holds[e]}"


def test_the_exported_window_is_the_references_ring() -> None:
    """LayerCache.window: the last W positions before pos, as rows of the reference's ring
    (position % W) and as pool entries (position % RING of the slot)."""
    cache, _ = index_of(0, [0], [0])
    for pos in (0, 1, W - 1, W, W + 7, 3 * RING + 5):
        rows, entries = cache.window(C, 2, pos)
        seen = list(range(max(0, pos - W), pos))
        assert rows.tolist() == [p % W for p in seen] and entries.tolist() == [2 * cache.stride + p % RING for p in seen]


def test_a_prefill_chunk_keeps_its_kv_in_the_scratch_and_hands_the_last_w_to_the_ring() -> None:
    """A prefill chunk (longer than the ring) writes row i's KV to scratch entry i; a row reads the
    window positions inside the chunk from the scratch and those before it from the ring; after
    attention the chunk's last W positions are copied to their ring entries."""
    slot = 3
    for start, rows in ((0, 1500), (700, 2048), (5, 60)):
        positions = list(range(start, start + rows))
        cache, ix = index_of(0, [slot] * rows, positions, chunk=True)
        scratch, base = SLOTS * cache.stride, slot * cache.stride
        assert ix.window_slot.tolist() == [scratch + i for i in range(rows)]
        assert ix.chunk_start == start
        for row in (0, 1, rows // 2, rows - 1):
            pos = positions[row]
            picked = sorted(int(e) for e in ix.attn_idx[row] if e >= 0)
            seen = range(max(0, pos - W + 1), pos + 1)
            assert picked == sorted(scratch + p - start if p >= start else base + p % RING for p in seen), f"row {row} of a chunk at {start}"
        src, dst = ix.ring_copy
        last = positions[-W:]
        assert src.tolist() == [scratch + p - start for p in last] and dst.tolist() == [base + p % RING for p in last]


def test_a_prefill_chunk_sees_no_further_than_its_last_row() -> None:
    """Known on the host for a chunk: HCA rows list only the entries the last row can see, CSA
    scores are bounded by the keys the last row sees."""
    start, rows = 1000, 1200
    positions = list(range(start, start + rows))
    _, hca = index_of(128, [1] * rows, positions, chunk=True)
    assert hca.attn_idx.shape[1] == W + (start + rows) // 128
    for row in (0, rows - 1):
        assert int((hca.attn_idx[row, W:] >= 0).sum()) == (positions[row] + 1) // 128
    _, csa = index_of(4, [1] * rows, positions, chunk=True)
    assert csa.max_keys == (start + rows) // 4 == int(csa.n_keys.max())


def test_a_prefill_chunk_longer_than_the_scratch_is_refused() -> None:
    cache = LayerCache.new(C, 4, SLOTS, CONTEXT, torch.device("cpu"), scratch=SCRATCH)
    assert cache.chunk_at(7, SCRATCH) == (SLOTS * cache.stride, 7)
    with pytest.raises(ValueError, match="scratch"):
        cache.chunk_at(0, SCRATCH + 1)
