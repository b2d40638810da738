"""How the FP4 decode launches split K (`dsuf.gpu.moe.fp4_splits`), specified on the CPU at a TP=2
rank's shapes on an H200 (132 SMs, 3 CTAs an SM at batch 1): a launch whose output tiles alone give
every SM a CTA does not split K (its partial sums' round trip through global memory would cost more
than the shorter streams save), a smaller one splits it to fill the SMs, and a CTA never takes more
128-element chunks of activations than its shared memory holds."""

from __future__ import annotations

from dsuf.gpu.moe import FP4_MAX_CHUNKS, fp4_splits

SMS, D, INTER = 132, 4096, 1024  # a TP=2 rank's experts: w1/w3 [1024, 4096], w2 [4096, 1024]


def test_a_launch_whose_tiles_fill_the_sms_does_not_split_k():
    assert fp4_splits(6, D, INTER, 1, 3, SMS) == 1  # batch 1's w2: 192 tiles


def test_a_launch_of_fewer_tiles_splits_k_to_fill_the_sms():
    assert fp4_splits(6, INTER, D, 2, 3, SMS) == 4  # batch 1's gate/up: 96 tiles, 384 CTAs


def test_a_cta_never_takes_more_chunks_than_its_shared_memory_holds():
    # batch 8's gate/up fills the SMs with tiles, but K = 4096 is 32 chunks
    assert fp4_splits(48, INTER, D, 2, 4, SMS) == -(-(D // 128) // FP4_MAX_CHUNKS) == 2
