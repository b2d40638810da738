"""Model configuration: parse and validate the released `config.json` of both model families.

One frozen dataclass holds every field the forward pass needs, under the names DeepSeek's
reference code uses:

- the V4-Flash family (DeepSeek-V4-Flash, V4-Flash-0731): a flat `config.json`, read by
  `parse_config` / `load_config`;
- V4.1-Flash: a nested `config.json` (`text_config`, `vision_config`, `quantization_config` with
  `expert_dtype`), read by `parse_v41_config` / `load_v41_config`.

`load_any_config(dir)` picks the family from `model_type`. Each loader also reads
`inference/config.json` (the reference's flat names) where present and insists that the two agree.
Anything unknown or inconsistent is a `ConfigError` whose one-line message names the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engram import table_primes


class ConfigError(ValueError):
    """A config that cannot be served; the message is one line and names the field."""


# Keys that only matter to transformers' bookkeeping: accepted and ignored.
_IGNORED_KEYS = frozenset(
    {
        "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
        "initializer_range", "attention_dropout", "pad_token_id", "topk_method", "max_position_embeddings",
    }
)


@dataclass(frozen=True)
class DSparkConfig:
    """Keys of the DSpark draft heads of V4-Flash-0731 and V4.1-Flash (used by speculative decoding)."""

    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    n_routed_experts: int | None = None  # V4.1: the stages' own MoE (None: the backbone's)
    n_activated_experts: int | None = None


@dataclass(frozen=True)
class CSA2Config:
    """V4.1's sparse attention: which layers compress (and share) the KV and which run an indexer."""

    kv_source_layers: tuple[int, ...]  # Full layers: compress, publish the KV and the index keys
    index_source_layers: tuple[int, ...]  # every layer that runs an indexer (the kv sources included)
    candidate_source_layer: int  # its indexer picks the candidate blocks of the later index layers
    candidate_topk_blocks: int
    candidate_block_size: int


@dataclass(frozen=True)
class EngramConfig:
    """V4.1's n-gram memory: hash tables read at `layer_ids`, before those blocks."""

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]  # table rows per Engram layer (sums of its primes)
    max_ngram_size: int
    vocab_size: int  # where the search for each (n-gram size, head) prime starts
    n_heads: int
    head_dim: int
    pad_token_id: int
    compressed_vocab_size: int  # of the tokenizer's normalised vocabulary; the multipliers depend on it

    @property
    def n_hash_columns(self) -> int:
        """Rows gathered per position: one per (n-gram size 2 … max, head)."""
        return (self.max_ngram_size - 1) * self.n_heads


@dataclass(frozen=True)
class VisionConfig:
    """V4.1's DeepSeek-ViT and aligner (weights loaded and checked; the forward is not built yet)."""

    n_layers: int
    dim: int
    n_heads: int
    inter_dim: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: float | None


@dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint stores its weights (absent `quantization_config` ⇒ plain weights)."""

    weight_block: int = 128  # FP8 e4m3 weights carry one E8M0 scale per block × block tile
    expert_dtype: str = "fp4"  # routed experts: "fp4" (e2m1 packed in I8, E8M0 per 32) or "fp8"
    fp4_block: int = 32


@dataclass(frozen=True)
class ModelConfig:
    """Either family under the reference's names; `family` is "v4" (DeepSeek-V4-Flash,
    V4-Flash-0731) or "v41" (V4.1-Flash, with `csa2` and `engram` set)."""

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    window_size: int
    compress_ratios: tuple[int, ...]  # one per backbone layer (trailing MTP entries dropped)
    n_routed_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    n_hash_layers: int
    route_scale: float
    swiglu_limit: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    original_seq_len: int
    beta_fast: float
    beta_slow: float
    max_seq_len: int
    n_mtp_layers: int
    bos_token_id: int
    eos_token_id: int
    quant: QuantConfig | None = None
    dspark: DSparkConfig | None = None
    mtp_compress_ratios: tuple[int, ...] = field(default=())
    family: str = "v4"
    csa2: CSA2Config | None = None
    engram: EngramConfig | None = None
    vision: VisionConfig | None = None
    image_token_id: int | None = None

    # ---- derived facts the forward pass asks for -------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def layer_kind(self, layer: int) -> str:
        """V4: 'swa' (window only), 'csa' (ratio 4, indexer) or 'hca' (any other ratio).
        V4.1 (CSA2 roles): 'swa', 'full' (a KV source), 'reindex' (an index source reading the
        candidate source's cache) or 'reuse' (the latest published picks on the nearest source)."""
        ratio = self.compress_ratios[layer]
        if self.csa2 is None:
            return "swa" if ratio == 0 else "csa" if ratio == 4 else "hca"
        if ratio == 0:
            return "swa"
        if layer in self.csa2.kv_source_layers:
            return "full"
        return "reindex" if layer in self.csa2.index_source_layers else "reuse"

    def kv_source_of(self, layer: int) -> int:
        """V4.1: the KV source whose compressed cache a layer reads (the nearest at or below it)."""
        assert self.csa2 is not None
        return max(s for s in self.csa2.kv_source_layers if s <= layer)

    def n_experts_of(self, prefix: str) -> tuple[int, int]:
        """(routed experts, experts per token) of the block under `prefix` (V4.1's DSpark stages
        have their own, smaller MoE)."""
        d = self.dspark
        if prefix.startswith("mtp.") and d is not None and d.n_routed_experts is not None:
            return d.n_routed_experts, d.n_activated_experts or self.n_activated_experts
        return self.n_routed_experts, self.n_activated_experts

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# HF key -> reference key. The reference's flat `inference/config.json` names are what the code
# uses; the HF names are what `config.json` carries (V4.1: inside `text_config`).
_HF_TO_REF: dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_lora_rank": "o_lora_rank",
    "o_groups": "o_groups",
    "sliding_window": "window_size",
    "n_routed_experts": "n_routed_experts",
    "num_experts_per_tok": "n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "num_hash_layers": "n_hash_layers",
    "routed_scaling_factor": "route_scale",
    "swiglu_limit": "swiglu_limit",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
    "num_nextn_predict_layers": "n_mtp_layers",
    "scoring_func": "score_func",
    "n_shared_experts": "n_shared_experts",
    "expert_dtype": "expert_dtype",
}

# Fields that must hold exactly these values: the engine implements only this architecture.
_FIXED = {
    "num_key_value_heads": 1,
    "hidden_act": "silu",
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "attention_bias": False,
    "tie_word_embeddings": False,
}

_DSPARK_KEYS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")
_V41_DSPARK_KEYS = _DSPARK_KEYS + ("dspark_n_routed_experts", "dspark_num_experts_per_tok")
_CSA2_KEYS = (
    "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size",
)
_ENGRAM_KEYS = (
    "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads",
    "engram_head_dim", "engram_pad_token_id", "engram_compressed_vocab_size",
)
_VISION_KEYS = (
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "patch_size",
    "rope_theta", "downsample_ratio", "max_image_tokens", "min_pixels", "max_wh_ratio",
)


def _fail(field_name: str, why: str) -> None:
    raise ConfigError(f"config field {field_name!r}: {why}")


def _require(raw: dict, key: str, name: str | None = None) -> Any:
    if key not in raw:
        _fail(name or key, "missing")
    return raw[key]


def _int(raw: dict, key: str, minimum: int = 1, name: str | None = None) -> int:
    value = _require(raw, key, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(name or key, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _float(raw: dict, key: str, positive: bool = True, name: str | None = None) -> float:
    value = _require(raw, key, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (positive and not value > 0):
        _fail(name or key, f"must be a {'positive ' if positive else ''}number, got {value!r}")
    return float(value)


def _dict(raw: dict, key: str) -> dict:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail(key, f"must be an object, got {value!r}")
    return value


def _layers(raw: dict, key: str, n_layers: int) -> tuple[int, ...]:
    """A list of distinct backbone layer ids in ascending order."""
    value = _require(raw, key)
    ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n_layers for v in value)
    if not ok or sorted(set(value)) != value:
        _fail(key, f"must list distinct layers in [0, {n_layers}) in ascending order, got {value!r}")
    return tuple(value)


def _check_keys(raw: dict, known: set[str], family: str, prefix: str = "") -> None:
    for key in raw:
        if key not in known:
            _fail(prefix + key, f"unknown to the {family} family")
    for key, want in _FIXED.items():
        if key in raw and raw[key] != want:
            _fail(prefix + key, f"only {want!r} is supported, got {raw[key]!r}")


def _shared_fields(raw: dict) -> dict[str, Any]:
    """The `ModelConfig` fields both families spell alike (V4's top level, V4.1's text_config)."""
    n_layers = _int(raw, "num_hidden_layers")
    n_heads = _int(raw, "num_attention_heads")
    head_dim = _int(raw, "head_dim")
    rope_head_dim = _int(raw, "qk_rope_head_dim", minimum=2)
    if rope_head_dim % 2 or rope_head_dim >= head_dim:
        _fail("qk_rope_head_dim", f"must be even and smaller than head_dim={head_dim}, got {rope_head_dim}")
    o_groups = _int(raw, "o_groups")
    if n_heads % o_groups:
        _fail("o_groups", f"must divide num_attention_heads={n_heads}, got {o_groups}")
    index_head_dim = _int(raw, "index_head_dim")
    if index_head_dim <= rope_head_dim:
        _fail("index_head_dim", f"must be above qk_rope_head_dim={rope_head_dim} (RoPE takes its last dims), got {index_head_dim}")

    ratios = _require(raw, "compress_ratios")
    if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ratios):
        _fail("compress_ratios", "must be a list of non-negative integers")
    if len(ratios) < n_layers:
        _fail("compress_ratios", f"has {len(ratios)} entries, fewer than num_hidden_layers={n_layers}")
    backbone, trailing = tuple(ratios[:n_layers]), tuple(ratios[n_layers:])
    if any(r != 0 for r in trailing):
        _fail("compress_ratios", f"entries past num_hidden_layers (MTP/DSpark) must be 0, got {list(trailing)}")

    n_experts = _int(raw, "n_routed_experts")
    top_k = _int(raw, "num_experts_per_tok")
    if top_k > n_experts:
        _fail("num_experts_per_tok", f"exceeds n_routed_experts={n_experts}")

    rope = _dict(raw, "rope_scaling")
    rope_type = rope.get("type", rope.get("rope_type", "yarn" if rope else None))
    if rope and rope_type != "yarn":
        _fail("rope_scaling", f"only YaRN is supported, got type {rope_type!r}")
    yarn = {}
    if rope:
        for key in ("factor", "beta_fast", "beta_slow"):
            yarn[key] = _float(rope, key, name=f"rope_scaling.{key}")
        yarn["original"] = _int(rope, "original_max_position_embeddings", name="rope_scaling.original_max_position_embeddings")

    return dict(
        vocab_size=_int(raw, "vocab_size"),
        dim=_int(raw, "hidden_size"),
        n_layers=n_layers,
        n_heads=n_heads,
        head_dim=head_dim,
        rope_head_dim=rope_head_dim,
        q_lora_rank=_int(raw, "q_lora_rank"),
        o_lora_rank=_int(raw, "o_lora_rank"),
        o_groups=o_groups,
        window_size=_int(raw, "sliding_window"),
        compress_ratios=backbone,
        mtp_compress_ratios=trailing,
        n_routed_experts=n_experts,
        n_activated_experts=top_k,
        moe_inter_dim=_int(raw, "moe_intermediate_size"),
        route_scale=_float(raw, "routed_scaling_factor"),
        swiglu_limit=_float(raw, "swiglu_limit", positive=False) if "swiglu_limit" in raw else 0.0,
        index_n_heads=_int(raw, "index_n_heads"),
        index_head_dim=index_head_dim,
        index_topk=_int(raw, "index_topk"),
        hc_mult=_int(raw, "hc_mult"),
        hc_sinkhorn_iters=_int(raw, "hc_sinkhorn_iters"),
        hc_eps=_float(raw, "hc_eps"),
        norm_eps=_float(raw, "rms_norm_eps"),
        rope_theta=_float(raw, "rope_theta"),
        compress_rope_theta=_float(raw, "compress_rope_theta"),
        rope_factor=yarn.get("factor", 1.0),
        original_seq_len=yarn.get("original", 0),
        beta_fast=yarn.get("beta_fast", 32.0),
        beta_slow=yarn.get("beta_slow", 1.0),
        max_seq_len=_int(raw, "max_position_embeddings") if "max_position_embeddings" in raw else 1 << 20,
        n_mtp_layers=_int(raw, "num_nextn_predict_layers", minimum=0) if "num_nextn_predict_layers" in raw else 1,
    )


def _special_tokens(raw: dict) -> dict[str, int]:
    return {
        "bos_token_id": _int(raw, "bos_token_id", minimum=0) if "bos_token_id" in raw else 0,
        "eos_token_id": _int(raw, "eos_token_id", minimum=0) if "eos_token_id" in raw else 1,
    }


def _quant(raw: dict, expert_dtype_default: Any) -> QuantConfig | None:
    """`quantization_config` (absent ⇒ plain weights). V4 keeps `expert_dtype` at the top level,
    V4.1 inside `quantization_config`."""
    if raw.get("quantization_config") is None:
        if raw.get("expert_dtype") not in (None, "fp4", "fp8", "bf16"):
            _fail("expert_dtype", f"unsupported value {raw.get('expert_dtype')!r}")
        return None
    qc = _dict(raw, "quantization_config")
    if qc.get("quant_method") != "fp8":
        _fail("quantization_config.quant_method", f"only 'fp8' is supported, got {qc.get('quant_method')!r}")
    if qc.get("fmt", "e4m3") != "e4m3":
        _fail("quantization_config.fmt", f"only 'e4m3' is supported, got {qc.get('fmt')!r}")
    if qc.get("scale_fmt", "ue8m0") != "ue8m0":
        _fail("quantization_config.scale_fmt", f"only 'ue8m0' is supported, got {qc.get('scale_fmt')!r}")
    block = qc.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1] and block[0] > 0):
        _fail("quantization_config.weight_block_size", f"must be a square block, got {block!r}")
    expert_dtype = qc.get("expert_dtype", expert_dtype_default)
    if expert_dtype not in ("fp4", "fp8"):
        _fail("expert_dtype", f"must be 'fp4' or 'fp8', got {expert_dtype!r}")
    return QuantConfig(weight_block=block[0], expert_dtype=expert_dtype)


def _dspark(raw: dict, n_layers: int, keys: tuple[str, ...]) -> DSparkConfig | None:
    if not any(k in raw for k in keys):
        return None
    missing = [k for k in keys if k not in raw]
    if missing:
        _fail(missing[0], "missing while other dspark_* keys are present")
    targets = raw["dspark_target_layer_ids"]
    if not isinstance(targets, list) or not all(isinstance(t, int) and 0 <= t < n_layers for t in targets):
        _fail("dspark_target_layer_ids", f"must list backbone layers in [0, {n_layers}), got {targets!r}")
    experts = {}
    if "dspark_n_routed_experts" in keys:
        experts = {
            "n_routed_experts": _int(raw, "dspark_n_routed_experts"),
            "n_activated_experts": _int(raw, "dspark_num_experts_per_tok"),
        }
        if experts["n_activated_experts"] > experts["n_routed_experts"]:
            _fail("dspark_num_experts_per_tok", f"exceeds dspark_n_routed_experts={experts['n_routed_experts']}")
    return DSparkConfig(
        block_size=_int(raw, "dspark_block_size"),
        noise_token_id=_int(raw, "dspark_noise_token_id", minimum=0),
        target_layer_ids=tuple(targets),
        markov_rank=_int(raw, "dspark_markov_rank"),
        **experts,
    )


def parse_config(raw: dict, name: str = "model") -> ModelConfig:
    """Validate an HF-style V4 `config.json` dict and return the engine's `ModelConfig`."""
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        _fail("model_type", f"expected 'deepseek_v4' (the V4-Flash family), got {model_type!r}")
    known = set(_HF_TO_REF) | set(_FIXED) | _IGNORED_KEYS | set(_DSPARK_KEYS) | {
        "bos_token_id", "eos_token_id", "rope_scaling", "compress_ratios", "quantization_config",
    }
    _check_keys(raw, known, "V4-Flash")
    fields = _shared_fields(raw)
    n_layers, index_head_dim = fields["n_layers"], fields["index_head_dim"]
    if index_head_dim & (index_head_dim - 1):
        _fail("index_head_dim", f"must be a power of two above qk_rope_head_dim (Hadamard), got {index_head_dim}")
    if any(r == 1 for r in fields["compress_ratios"]):
        _fail("compress_ratios", "ratio 1 belongs to V4.1 (CSA2), not to the V4-Flash family")
    n_hash = raw.get("num_hash_layers", 0)
    if isinstance(n_hash, bool) or not isinstance(n_hash, int) or not 0 <= n_hash <= n_layers:
        _fail("num_hash_layers", f"must be an integer in [0, {n_layers}], got {n_hash!r}")
    config = ModelConfig(
        name=name,
        **fields,
        **_special_tokens(raw),
        n_hash_layers=n_hash,
        quant=_quant(raw, raw.get("expert_dtype", "fp8")),
        dspark=_dspark(raw, n_layers, _DSPARK_KEYS),
    )
    _check_shapes(config)
    return config


def _csa2(text: dict, ratios: tuple[int, ...], index_topk: int) -> CSA2Config:
    n = len(ratios)
    kv, index = _layers(text, "kv_source_layer_ids", n), _layers(text, "index_source_layer_ids", n)
    candidate = _int(text, "candidate_source_layer_id", minimum=0)
    blocks, block_size = _int(text, "candidate_topk_blocks"), _int(text, "candidate_block_size")
    for layer in kv + index:
        if ratios[layer] == 0:
            _fail("kv_source_layer_ids" if layer in kv else "index_source_layer_ids", f"layer {layer} has compress ratio 0")
    for layer, ratio in enumerate(ratios):
        if ratio > 2:
            _fail("compress_ratios", f"CSA2 compresses 2:1 or 1:1, layer {layer} has ratio {ratio}")
        below = [s for s in kv if s <= layer]
        if ratio and not below:
            _fail("kv_source_layer_ids", f"layer {layer} compresses but no KV source is at or below it")
        if ratio and ratios[below[-1]] != ratio:
            _fail("compress_ratios", f"layer {layer} has ratio {ratio} but reads layer {below[-1]}'s cache of ratio {ratios[below[-1]]}")
    if not set(kv) <= set(index):
        _fail("index_source_layer_ids", f"must include every KV source {list(kv)}: a source indexes its own keys")
    if not kv or candidate != kv[-1]:
        _fail("candidate_source_layer_id", f"must be the last KV source {kv[-1] if kv else None}, got {candidate}")
    for layer in index:
        if layer not in kv and layer < candidate:
            _fail("index_source_layer_ids", f"layer {layer} indexes without compressing, so it must come after the candidate source {candidate}")
    if (blocks - 1) * block_size + 1 < index_topk:
        _fail("candidate_topk_blocks", f"(candidate_topk_blocks - 1) * candidate_block_size + 1 must reach index_topk={index_topk}, so the candidate blocks always hold enough entries to pick from")
    return CSA2Config(kv, index, candidate, blocks, block_size)


def _engram(text: dict, n_layers: int) -> EngramConfig:
    layers = _layers(text, "engram_layer_ids", n_layers)
    config = EngramConfig(
        layer_ids=layers,
        num_embeddings=(),
        max_ngram_size=_int(text, "engram_max_ngram_size", minimum=2),
        vocab_size=_int(text, "engram_vocab_size", minimum=2),
        n_heads=_int(text, "engram_n_heads"),
        head_dim=_int(text, "engram_head_dim"),
        pad_token_id=_int(text, "engram_pad_token_id", minimum=0),
        compressed_vocab_size=_int(text, "engram_compressed_vocab_size"),
    )
    rows = _require(text, "engram_num_embeddings")
    # The table layout follows from the prime rule; a mismatch means the tables are laid out differently.
    want = [sum(p for per_n in layer for p in per_n) for layer in table_primes(config)]
    if rows != want:
        _fail("engram_num_embeddings", f"{rows!r} disagrees with the prime rule, which gives {want}")
    return dataclasses.replace(config, num_embeddings=tuple(rows))


def _vision(raw: dict) -> VisionConfig | None:
    if raw.get("vision_config") is None:
        return None
    v = _dict(raw, "vision_config")
    _check_keys(v, set(_VISION_KEYS), "V4.1-Flash", prefix="vision_config.")
    if v.get("model_type", "deepseek_v41_vision") != "deepseek_v41_vision":
        _fail("vision_config.model_type", f"expected 'deepseek_v41_vision', got {v.get('model_type')!r}")
    ratio = v.get("max_wh_ratio")
    if ratio is not None:
        ratio = _float(v, "max_wh_ratio", name="vision_config.max_wh_ratio")

    def vint(key: str) -> int:
        return _int(v, key, name=f"vision_config.{key}")

    return VisionConfig(
        n_layers=vint("num_hidden_layers"),
        dim=vint("hidden_size"),
        n_heads=vint("num_attention_heads"),
        inter_dim=vint("intermediate_size"),
        patch_size=vint("patch_size"),
        rope_theta=_float(v, "rope_theta", name="vision_config.rope_theta"),
        downsample_ratio=vint("downsample_ratio"),
        max_image_tokens=vint("max_image_tokens"),
        min_pixels=vint("min_pixels"),
        max_wh_ratio=ratio,
    )


_V41_TOP_KEYS = frozenset(
    {
        "architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "bos_token_id", "eos_token_id",
        "pad_token_id", "image_token_id", "quantization_config", "text_config", "vision_config", "tie_word_embeddings",
        "use_cache",
    }
)


def parse_v41_config(raw: dict, name: str = "model") -> ModelConfig:
    """Validate a V4.1-Flash `config.json` dict (nested) and return the engine's `ModelConfig`."""
    if raw.get("model_type") != "deepseek_v41":
        _fail("model_type", f"expected 'deepseek_v41' (V4.1-Flash), got {raw.get('model_type')!r}")
    _check_keys(raw, set(_V41_TOP_KEYS), "V4.1-Flash")
    if raw.get("quantization_config") is None:
        _fail("quantization_config", "missing: V4.1's Engram tables only exist in FP8")
    text = _dict(raw, "text_config")
    if not text:
        _fail("text_config", "missing")
    if text.get("model_type", "deepseek_v41_text") != "deepseek_v41_text":
        _fail("text_config.model_type", f"expected 'deepseek_v41_text', got {text.get('model_type')!r}")
    known = (set(_HF_TO_REF) - {"num_hash_layers", "expert_dtype"}) | set(_FIXED) | _IGNORED_KEYS | set(_V41_DSPARK_KEYS) | {
        "rope_scaling", "compress_ratios", *_CSA2_KEYS, *_ENGRAM_KEYS,
    }
    _check_keys(text, known, "V4.1-Flash", prefix="text_config.")
    fields = _shared_fields(text)
    image_token = _int(raw, "image_token_id", minimum=0) if "image_token_id" in raw else None
    config = ModelConfig(
        name=name,
        **fields,
        **_special_tokens(raw),
        n_hash_layers=0,
        quant=_quant(raw, None),
        dspark=_dspark(text, fields["n_layers"], _V41_DSPARK_KEYS),
        family="v41",
        csa2=_csa2(text, fields["compress_ratios"], fields["index_topk"]),
        engram=_engram(text, fields["n_layers"]),
        vision=_vision(raw),
        image_token_id=image_token,
    )
    _check_shapes(config)
    return config


# V4.1's KV fake-quant blocks are fixed by the reference: window FP8 per 32, compressed FP4 per 16,
# index keys FP4 per 32.
V41_KV_BLOCK = 32


def _check_shapes(c: ModelConfig) -> None:
    if c.dim % c.hc_mult:
        _fail("hidden_size", f"must be divisible by hc_mult={c.hc_mult}")
    if c.n_heads * c.head_dim % c.o_groups:
        _fail("o_groups", "must divide num_attention_heads * head_dim")
    if c.family == "v41" and (c.head_dim % V41_KV_BLOCK or c.index_head_dim % V41_KV_BLOCK):
        _fail("head_dim", f"head_dim and index_head_dim must be multiples of {V41_KV_BLOCK}, the KV cache's FP8/FP4 block")
    if c.quant is not None:
        block = c.quant.weight_block
        if c.family == "v4" and c.nope_head_dim % 64:
            _fail("head_dim", "the nope part (head_dim - qk_rope_head_dim) must be a multiple of 64 for the FP8 KV cache")
        if c.moe_inter_dim % c.quant.fp4_block or c.dim % c.quant.fp4_block:
            _fail("moe_intermediate_size", f"expert widths must be multiples of the FP4 block {c.quant.fp4_block}")
        if c.dim % block or c.q_lora_rank % block:
            _fail("hidden_size", f"hidden_size and q_lora_rank must be multiples of the activation block {block}")
        if c.engram is not None and c.engram.head_dim % block:
            _fail("engram_head_dim", f"must be a multiple of {block}: each table row has one E8M0 scale per {block} values")


# Reference (`inference/config.json`) key -> HF key, for the consistency check.
_REF_TO_HF = {ref: hf for hf, ref in _HF_TO_REF.items()} | {
    "original_seq_len": "rope_scaling.original_max_position_embeddings",
    "rope_factor": "rope_scaling.factor",
    "beta_fast": "rope_scaling.beta_fast",
    "beta_slow": "rope_scaling.beta_slow",
    "compress_ratios": "compress_ratios",
    "score_func": "scoring_func",
    "dtype": "quantization_config",
    "scale_fmt": "quantization_config.scale_fmt",
} | {key: key for key in _DSPARK_KEYS}

# V4.1's flat names: most are V4's under `text_config.`; watch the renamed ones.
_V41_REF_TO_HF = {
    ref: ("" if hf.startswith("quantization_config") else "text_config.") + hf
    for ref, hf in _REF_TO_HF.items()
    if ref not in ("n_hash_layers", "expert_dtype")
} | {
    "expert_dtype": "quantization_config.expert_dtype",
    "kv_source_layers": "text_config.kv_source_layer_ids",
    "index_source_layers": "text_config.index_source_layer_ids",
    "candidate_source_layer": "text_config.candidate_source_layer_id",
    "candidate_topk_blocks": "text_config.candidate_topk_blocks",
    "candidate_block_size": "text_config.candidate_block_size",
    "engram_pad_id": "text_config.engram_pad_token_id",
    "dspark_n_routed_experts": "text_config.dspark_n_routed_experts",
    "dspark_n_activated_experts": "text_config.dspark_num_experts_per_tok",
    "image_token_id": "image_token_id",
    "vision_n_layers": "vision_config.num_hidden_layers",
    "vision_dim": "vision_config.hidden_size",
    "vision_n_heads": "vision_config.num_attention_heads",
    "vision_inter_dim": "vision_config.intermediate_size",
    "vision_patch_size": "vision_config.patch_size",
    "vision_rope_theta": "vision_config.rope_theta",
    "vision_downsample_ratio": "vision_config.downsample_ratio",
    "vision_max_n_token": "vision_config.max_image_tokens",
    "vision_min_pixels": "vision_config.min_pixels",
    "vision_max_wh_ratio": "vision_config.max_wh_ratio",
} | {key: f"text_config.{key}" for key in _ENGRAM_KEYS if key != "engram_pad_token_id"}


def v41_inference_config(raw: dict) -> dict:
    """The reference's flat `inference/config.json` for a (valid) nested V4.1 config dict (it names
    the storage dtype but not the scale format)."""
    flat = {ref: _lookup(raw, hf) for ref, hf in _V41_REF_TO_HF.items() if ref not in ("dtype", "scale_fmt") and _has(raw, hf)}
    return flat | {"dtype": "fp8"}


def _has(raw: dict, dotted: str) -> bool:
    section, _, key = dotted.rpartition(".")
    parent = _lookup(raw, section) if section else raw
    return isinstance(parent, dict) and key in parent


def _lookup(raw: dict, dotted: str) -> Any:
    value: Any = raw
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def check_inference_config(raw: dict, ref: dict, table: dict[str, str] = _REF_TO_HF, family: str = "V4-Flash") -> None:
    """The reference's flat config must agree with config.json wherever both state a value."""
    for key, value in ref.items():
        hf_key = table.get(key)
        if hf_key is None:
            _fail(f"inference/config.json:{key}", f"unknown to the {family} family")
        if key == "dtype":
            if (value == "fp8") != ("quantization_config" in raw):
                _fail("inference/config.json:dtype", f"{value!r} disagrees with config.json's quantization_config")
            continue
        hf_value = _lookup(raw, hf_key)
        if hf_value is not None and hf_value != value:
            _fail(f"inference/config.json:{key}", f"{value!r} disagrees with config.json {hf_key}={hf_value!r}")


def _read_json_object(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(raw).__name__}")
    return raw


def _read_config(ckpt_dir: str | Path) -> tuple[Path, dict]:
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {ckpt_dir}")
    return ckpt_dir, _read_json_object(path)


def _inference_config(ckpt_dir: Path) -> dict | None:
    ref_path = ckpt_dir / "inference" / "config.json"
    return _read_json_object(ref_path) if ref_path.is_file() else None


def load_config(ckpt_dir: str | Path) -> ModelConfig:
    """Read a V4-Flash-family `config.json` (and `inference/config.json` where present)."""
    ckpt_dir, raw = _read_config(ckpt_dir)
    config = parse_config(raw, name=ckpt_dir.resolve().name)
    if (ref := _inference_config(ckpt_dir)) is not None:
        check_inference_config(raw, ref)
    return config


def load_v41_config(ckpt_dir: str | Path) -> ModelConfig:
    """Read a V4.1-Flash `config.json` (and `inference/config.json` where present)."""
    ckpt_dir, raw = _read_config(ckpt_dir)
    config = parse_v41_config(raw, name=ckpt_dir.resolve().name)
    if (ref := _inference_config(ckpt_dir)) is not None:
        check_inference_config(raw, ref, _V41_REF_TO_HF, "V4.1-Flash")
    return config


def load_any_config(ckpt_dir: str | Path) -> ModelConfig:
    """Read either family's config, chosen by `model_type` ('deepseek_v41' is V4.1-Flash)."""
    _, raw = _read_config(ckpt_dir)
    return load_v41_config(ckpt_dir) if raw.get("model_type") == "deepseek_v41" else load_config(ckpt_dir)
