"""Model configuration: parse and validate the released `config.json` of the V4-Flash family.

One frozen dataclass holds every field the forward pass needs, under the names DeepSeek's
reference code uses. `load_config(dir)` reads `config.json` (HF names) and, where present,
`inference/config.json` (the reference's flat names), and insists that the two agree.
Anything unknown or inconsistent is a `ConfigError` whose one-line message names the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
    """Keys of V4-Flash-0731's DSpark draft heads (used by speculative decoding)."""

    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int


@dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint stores its weights (absent `quantization_config` ⇒ plain weights)."""

    weight_block: int = 128  # FP8 e4m3 weights carry one E8M0 scale per block × block tile
    expert_dtype: str = "fp4"  # routed experts: "fp4" (e2m1 packed in I8, E8M0 per 32) or "fp8"
    fp4_block: int = 32


@dataclass(frozen=True)
class ModelConfig:
    """The V4-Flash family (DeepSeek-V4-Flash, V4-Flash-0731) under the reference's names."""

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

    # ---- derived facts the forward pass asks for -------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def layer_kind(self, layer: int) -> str:
        """'swa' (window only), 'csa' (ratio 4, indexer) or 'hca' (any other ratio)."""
        ratio = self.compress_ratios[layer]
        return "swa" if ratio == 0 else "csa" if ratio == 4 else "hca"

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# HF key -> (reference key, converter). The reference's flat `inference/config.json` names are
# what the code uses; the HF names are what `config.json` carries.
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


def parse_config(raw: dict, name: str = "model") -> ModelConfig:
    """Validate an HF-style V4 `config.json` dict and return the engine's `ModelConfig`."""
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        _fail("model_type", f"expected 'deepseek_v4' (the V4-Flash family), got {model_type!r}")
    known = set(_HF_TO_REF) | set(_FIXED) | _IGNORED_KEYS | set(_DSPARK_KEYS) | {
        "bos_token_id", "eos_token_id", "rope_scaling", "compress_ratios", "quantization_config",
    }
    for key in raw:
        if key not in known:
            _fail(key, "unknown to the V4-Flash family")
    for key, want in _FIXED.items():
        if key in raw and raw[key] != want:
            _fail(key, f"only {want!r} is supported, got {raw[key]!r}")

    n_layers = _int(raw, "num_hidden_layers")
    dim = _int(raw, "hidden_size")
    n_heads = _int(raw, "num_attention_heads")
    head_dim = _int(raw, "head_dim")
    rope_head_dim = _int(raw, "qk_rope_head_dim", minimum=2)
    if rope_head_dim % 2 or rope_head_dim >= head_dim:
        _fail("qk_rope_head_dim", f"must be even and smaller than head_dim={head_dim}, got {rope_head_dim}")
    o_groups = _int(raw, "o_groups")
    if n_heads % o_groups:
        _fail("o_groups", f"must divide num_attention_heads={n_heads}, got {o_groups}")
    index_head_dim = _int(raw, "index_head_dim")
    if index_head_dim <= rope_head_dim or index_head_dim & (index_head_dim - 1):
        _fail("index_head_dim", f"must be a power of two above qk_rope_head_dim (Hadamard), got {index_head_dim}")

    ratios = _require(raw, "compress_ratios")
    if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ratios):
        _fail("compress_ratios", "must be a list of non-negative integers")
    if len(ratios) < n_layers:
        _fail("compress_ratios", f"has {len(ratios)} entries, fewer than num_hidden_layers={n_layers}")
    backbone, trailing = tuple(ratios[:n_layers]), tuple(ratios[n_layers:])
    if any(r != 0 for r in trailing):
        _fail("compress_ratios", f"entries past num_hidden_layers (MTP/DSpark) must be 0, got {list(trailing)}")
    if any(r == 1 for r in backbone):
        _fail("compress_ratios", "ratio 1 belongs to V4.1 (CSA2), not to the V4-Flash family")

    n_experts = _int(raw, "n_routed_experts")
    top_k = _int(raw, "num_experts_per_tok")
    if top_k > n_experts:
        _fail("num_experts_per_tok", f"exceeds n_routed_experts={n_experts}")
    n_hash = raw.get("num_hash_layers", 0)
    if isinstance(n_hash, bool) or not isinstance(n_hash, int) or not 0 <= n_hash <= n_layers:
        _fail("num_hash_layers", f"must be an integer in [0, {n_layers}], got {n_hash!r}")
    hc_mult = _int(raw, "hc_mult")

    rope = _dict(raw, "rope_scaling")
    rope_type = rope.get("type", rope.get("rope_type", "yarn" if rope else None))
    if rope and rope_type != "yarn":
        _fail("rope_scaling", f"only YaRN is supported, got type {rope_type!r}")
    yarn = {}
    if rope:
        for key in ("factor", "beta_fast", "beta_slow"):
            yarn[key] = _float(rope, key, name=f"rope_scaling.{key}")
        yarn["original"] = _int(rope, "original_max_position_embeddings", name="rope_scaling.original_max_position_embeddings")

    quant = None
    qc = _dict(raw, "quantization_config")
    if raw.get("quantization_config") is not None:
        if qc.get("quant_method") != "fp8":
            _fail("quantization_config.quant_method", f"only 'fp8' is supported, got {qc.get('quant_method')!r}")
        if qc.get("fmt", "e4m3") != "e4m3":
            _fail("quantization_config.fmt", f"only 'e4m3' is supported, got {qc.get('fmt')!r}")
        if qc.get("scale_fmt", "ue8m0") != "ue8m0":
            _fail("quantization_config.scale_fmt", f"only 'ue8m0' is supported, got {qc.get('scale_fmt')!r}")
        block = qc.get("weight_block_size", [128, 128])
        if not (isinstance(block, list) and len(block) == 2 and block[0] == block[1] and block[0] > 0):
            _fail("quantization_config.weight_block_size", f"must be a square block, got {block!r}")
        expert_dtype = qc.get("expert_dtype", raw.get("expert_dtype", "fp8"))
        if expert_dtype not in ("fp4", "fp8"):
            _fail("expert_dtype", f"must be 'fp4' or 'fp8', got {expert_dtype!r}")
        quant = QuantConfig(weight_block=block[0], expert_dtype=expert_dtype)
    elif raw.get("expert_dtype") not in (None, "fp4", "fp8", "bf16"):
        _fail("expert_dtype", f"unsupported value {raw.get('expert_dtype')!r}")

    dspark = None
    if any(k in raw for k in _DSPARK_KEYS):
        missing = [k for k in _DSPARK_KEYS if k not in raw]
        if missing:
            _fail(missing[0], "missing while other dspark_* keys are present")
        targets = raw["dspark_target_layer_ids"]
        if not isinstance(targets, list) or not all(isinstance(t, int) and 0 <= t < n_layers for t in targets):
            _fail("dspark_target_layer_ids", f"must list backbone layers in [0, {n_layers}), got {targets!r}")
        dspark = DSparkConfig(
            block_size=_int(raw, "dspark_block_size"),
            noise_token_id=_int(raw, "dspark_noise_token_id", minimum=0),
            target_layer_ids=tuple(targets),
            markov_rank=_int(raw, "dspark_markov_rank"),
        )

    config = ModelConfig(
        name=name,
        vocab_size=_int(raw, "vocab_size"),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        head_dim=head_dim,
        rope_head_dim=rope_head_dim,
        q_lora_rank=_int(raw, "q_lora_rank"),
        o_lora_rank=_int(raw, "o_lora_rank"),
        o_groups=o_groups,
        window_size=_int(raw, "sliding_window"),
        compress_ratios=backbone,
        n_routed_experts=n_experts,
        n_activated_experts=top_k,
        moe_inter_dim=_int(raw, "moe_intermediate_size"),
        n_hash_layers=n_hash,
        route_scale=_float(raw, "routed_scaling_factor"),
        swiglu_limit=_float(raw, "swiglu_limit", positive=False) if "swiglu_limit" in raw else 0.0,
        index_n_heads=_int(raw, "index_n_heads"),
        index_head_dim=index_head_dim,
        index_topk=_int(raw, "index_topk"),
        hc_mult=hc_mult,
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
        bos_token_id=_int(raw, "bos_token_id", minimum=0) if "bos_token_id" in raw else 0,
        eos_token_id=_int(raw, "eos_token_id", minimum=0) if "eos_token_id" in raw else 1,
        quant=quant,
        dspark=dspark,
        mtp_compress_ratios=trailing,
    )
    _check_shapes(config)
    return config


def _check_shapes(c: ModelConfig) -> None:
    if c.dim % c.hc_mult:
        _fail("hidden_size", f"must be divisible by hc_mult={c.hc_mult}")
    if c.n_heads * c.head_dim % c.o_groups:
        _fail("o_groups", "must divide num_attention_heads * head_dim")
    if c.quant is not None:
        block = c.quant.weight_block
        if c.nope_head_dim % 64:
            _fail("head_dim", "the nope part (head_dim - qk_rope_head_dim) must be a multiple of 64 for the FP8 KV cache")
        if c.moe_inter_dim % c.quant.fp4_block or c.dim % c.quant.fp4_block:
            _fail("moe_intermediate_size", f"expert widths must be multiples of the FP4 block {c.quant.fp4_block}")
        if c.dim % block or c.q_lora_rank % block:
            _fail("hidden_size", f"hidden_size and q_lora_rank must be multiples of the activation block {block}")


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


def _lookup(raw: dict, dotted: str) -> Any:
    value: Any = raw
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def check_inference_config(raw: dict, ref: dict) -> None:
    """The reference's flat config must agree with config.json wherever both state a value."""
    for key, value in ref.items():
        hf_key = _REF_TO_HF.get(key)
        if hf_key is None:
            _fail(f"inference/config.json:{key}", "unknown to the V4-Flash family")
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


def load_config(ckpt_dir: str | Path) -> ModelConfig:
    """Read `config.json` (and `inference/config.json` where present) from a checkpoint folder."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {ckpt_dir}")
    raw = _read_json_object(path)
    config = parse_config(raw, name=ckpt_dir.resolve().name)
    ref_path = ckpt_dir / "inference" / "config.json"
    if ref_path.is_file():
        check_inference_config(raw, _read_json_object(ref_path))
    return config
