"""Shared fixtures: tiny random checkpoints written once per test session."""

from __future__ import annotations

from pathlib import Path

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
