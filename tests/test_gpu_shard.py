"""The GPU path's tensor-parallel shard plan (dsuf.gpu.tp), on the CPU: which tensors split along
which dimension, that the ranks' parts put back together are the whole tensors, that a rank reads
its parts straight from a checkpoint in the released layout, and which splits are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsuf.gpu import tp
from dsuf.gpu.weights import V4_FLASH_CONFIG
from dsuf.model.checkpoint import load_tensors
from dsuf.model.config import parse_config
from dsuf.model.tiny import make_tiny

# The tiny model with widths that 2, 4 and 8 ranks can split on FP8 blocks of 128: experts of
# 1024, eight heads of 128, eight output groups of 128.
TINY = {"moe_intermediate_size": 1024, "num_attention_heads": 8, "o_groups": 8}
WORLDS = (2, 4, 8)


@pytest.mark.parametrize(
    "name, dim",
    [
        ("head.weight", 0), ("embed.weight", None),
        ("layers.3.attn.wq_b.weight", 0), ("layers.3.attn.wq_b.scale", 0), ("layers.3.attn.attn_sink", 0),
        ("layers.3.attn.wo_a.weight", 0), ("layers.3.attn.wo_b.weight", 1), ("layers.3.attn.wo_b.scale", 1),
        ("layers.3.attn.wq_a.weight", None), ("layers.3.attn.wkv.weight", None), ("layers.3.attn.compressor.wkv.weight", None),
        ("layers.2.attn.indexer.wq_b.weight", None), ("layers.2.attn.indexer.weights_proj.weight", None),
        ("layers.3.ffn.gate.weight", None), ("layers.3.ffn.gate.bias", None), ("layers.0.ffn.gate.tid2eid", None),
        ("layers.3.ffn.experts.17.w1.weight", 0), ("layers.3.ffn.experts.17.w3.scale", 0), ("layers.3.ffn.experts.17.w2.weight", 1),
        ("layers.3.ffn.experts.stacked.w1.weight", 1), ("layers.3.ffn.experts.stacked.w2.scale", 2),
        ("layers.3.ffn.shared_experts.w1.weight", 0), ("layers.3.ffn.shared_experts.w2.scale", 1),
        ("layers.3.hc_attn_fn", None), ("norm.weight", None),
    ],
)
def test_what_splits_where(name, dim):
    """Query heads, the output projections, every expert's intermediate dimension and the vocabulary
    split; the KV head, compressors, indexer, router, norms, mHC and the embedding are replicated."""
    assert tp.shard_dim(name) == dim


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    return folder, make_tiny(folder, "v4", seed=3, overrides=TINY)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.fixture(scope="module")
def whole(tiny):
    folder, c = tiny
    return load_tensors(folder, c, rule=tp.shard_rule)


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_read_their_parts_of_a_checkpoint_and_together_hold_it_all(tiny, whole, world):
    folder, c = tiny
    tp.check_tp(c, world)
    ranks = [load_tensors(folder, c, rank=r, world=world, rule=tp.shard_rule) for r in range(world)]
    assert all(set(r) == set(whole) for r in ranks)  # every expert on every rank (a slice of each)
    split = 0
    for name, full in whole.items():
        dim = tp.shard_dim(name)
        if dim is None:
            assert all(torch.equal(raw(r[name]), raw(full)) for r in ranks), name
            continue
        split += 1
        parts = [raw(r[name]) for r in ranks]
        assert all(p.shape[dim] * world == full.shape[dim] for p in parts) and torch.equal(torch.cat(parts, dim), raw(full)), name
    assert split > 8 * c.n_layers  # experts' w1/w2/w3 and scales in every layer, and more


@pytest.mark.parametrize("world", WORLDS)
def test_the_plan_on_tensors_in_memory_matches_the_plan_on_the_checkpoint(tiny, whole, world):
    """tp.shard (random weights, made whole then split) takes the same parts as the loader."""
    folder, c = tiny
    for r in range(world):
        mine = tp.shard(dict(whole), r, world)
        read = load_tensors(folder, c, rank=r, world=world, rule=tp.shard_rule)
        assert all(torch.equal(raw(mine[n]), raw(read[n])) for n in read)


def test_v4_flash_splits_over_2_4_and_8_gpus_and_other_counts_are_refused(tiny):
    c = parse_config(V4_FLASH_CONFIG)
    for world in (1, 2, 4, 8):
        tp.check_tp(c, world)
    for world in (3, 6, 16):
        with pytest.raises(ValueError, match="the ranks must be 1, 2, 4 or 8"):
            tp.check_tp(c, world)
    _, small = tiny
    narrow = dataclasses.replace(small, moe_inter_dim=256, o_groups=2)
    with pytest.raises(ValueError, match=r"moe_inter_dim 256 \(needs a multiple of 512\).*wo_a rows"):
        tp.check_tp(narrow, 4)  # its FP8 blocks cannot split four ways


def test_collectives_stage_the_largest_message_of_a_step():
    c = parse_config(V4_FLASH_CONFIG)
    assert tp.slot_bytes(c, 2, 256) == 256 * c.vocab_size // 2 * 4  # the logits' share outweighs the hidden state
    assert tp.slot_bytes(c, 8, 1) == max(2 * c.dim, 4 * c.vocab_size // 8)
