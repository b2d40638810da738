"""Shared fixtures: tiny random checkpoints written once per test session."""

from __future__ import annotations

from pathlib import Path

import asyncio

import pytest

from dsuf.model.tiny import make_tiny

SMALL_VOCAB = {"vocab_size": 512}

# Tiny configs for the oracle tests. "default" is make-tiny's own structure
# ([SWA, SWA, CSA, HCA, CSA, HCA], HCA ratio 8, window 8, top-k 4, two hash layers);
# "variant" moves every knob that has a boundary: window 16, HCA ratio 16, top-k 2,
# one hash layer, three experts per token.
TINY_VARIANTS = {
    "default": (1, SMALL_VOCAB),
    "variant": (
        7,
        SMALL_VOCAB
        | {
            "sliding_window": 16,
            "compress_ratios": [0, 0, 4, 16, 4, 16, 0],
            "index_topk": 2,
            "num_hash_layers": 1,
            "num_experts_per_tok": 3,
        },
    ),
}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    """make(name, seed, overrides, plain) -> path of a tiny checkpoint, cached for the session."""
    root = tmp_path_factory.mktemp("tiny")
    made: dict[tuple, Path] = {}

    def make(name: str = "default", plain: bool = False, family: str = "v4") -> Path:
        seed, overrides = TINY_VARIANTS[name]
        key = (name, plain, family)
        if key not in made:
            out = root / f"{family}-{name}-{'plain' if plain else 'fp8'}"
            make_tiny(out, family=family, seed=seed, overrides=overrides, plain=plain)
            made[key] = out
        return made[key]

    return make


def transformers_model(ckpt: Path):
    """transformers' DeepseekV4ForCausalLM (float32, eager) on a plain tiny checkpoint.

    transformers maps compress ratios 4/128 to layer types itself; tiny HCA ratios (8, 16) go
    through its `layer_types` + `compress_rates` fields instead."""
    import json

    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    raw = json.loads((ckpt / "config.json").read_text())
    ratios = raw.pop("compress_ratios")[: raw["num_hidden_layers"]]
    hca = {r for r in ratios if r not in (0, 4)}
    assert len(hca) <= 1, "transformers has one HCA ratio per model"
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    raw["layer_types"] = [kinds.get(r, "heavily_compressed_attention") for r in ratios]
    raw["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca.pop() if hca else 128}
    config = DeepseekV4Config(**raw)
    return DeepseekV4ForCausalLM.from_pretrained(ckpt, config=config, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    """hf_model(name) -> transformers' model of the plain twin of tiny checkpoint `name`."""
    cache: dict[str, object] = {}

    def get(name: str = "default"):
        if name not in cache:
            cache[name] = transformers_model(tiny_dir(name, plain=True))
        return cache[name]

    return get


# Tiny V4.1 checkpoints. "default" is make-tiny's own structure (ratios [0, 2, 2, 1, 1, 1]:
# SWA, Full, Reuse, Full (candidate source), Reindex, Reuse; window 8, top-k 4, candidate
# blocks of 4 entries, top 3 blocks; Engram at layers 1 and 3). "variant" moves every knob that
# has a boundary: 7 layers [0, 2, 2, 2, 1, 1, 1] with sources [1, 4] and reindex layer 6, an odd
# window (5), top-k 3, candidate blocks of 2 entries, three experts per token, Engram at layer 0
# (before the first block) and 4 with trigrams and three heads. "seed2" is the default structure
# with other weights.
V41_VARIANTS = {
    "default": (1, SMALL_VOCAB),
    "seed2": (2, SMALL_VOCAB),
    "variant": (
        7,
        SMALL_VOCAB
        | {
            "num_hidden_layers": 7,
            "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 0, 0, 0],
            "kv_source_layer_ids": [1, 4],
            "index_source_layer_ids": [1, 4, 6],
            "candidate_source_layer_id": 4,
            "candidate_block_size": 2,
            "candidate_topk_blocks": 3,
            "sliding_window": 5,
            "index_topk": 3,
            "num_experts_per_tok": 3,
            "engram_layer_ids": [0, 4],
            "engram_max_ngram_size": 3,
            "engram_n_heads": 3,
            "engram_vocab_size": 100,
            "dspark_target_layer_ids": [4, 5, 6],
        },
    ),
}


@pytest.fixture(scope="session")
def tiny_v41(tmp_path_factory: pytest.TempPathFactory):
    """make(name) -> path of a tiny V4.1 checkpoint (with its tokenizer.json), cached for the session."""
    root = tmp_path_factory.mktemp("tiny-v41")
    made: dict[str, Path] = {}

    def make(name: str = "default") -> Path:
        if name not in made:
            seed, overrides = V41_VARIANTS[name]
            make_tiny(root / name, family="v41", seed=seed, overrides=overrides)
            made[name] = root / name
        return made[name]

    return make


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread; two threads contend on a shared CI machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def event_loop_for_queues():
    """A current event loop for code that makes asyncio queues outside a coroutine (the scheduler's requests)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield
    loop.close()
