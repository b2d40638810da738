"""The released checkpoint layout: which tensors exist, how they are stored and sharded, how to read them.

`checkpoint_schema(config)` lists every tensor of a V4-Flash or V4.1-Flash checkpoint under its
native name with its shape and safetensors dtype. The tiny-checkpoint writer produces exactly this
list and the loader checks a checkpoint against it, so the two can never drift apart.

Tensor parallelism (`shard_rule`): following DeepSeek's converter, dim 0 of `embed`, `head`,
`wq_b`, `wo_a`, `attn_sink`, the indexer's `wq_b` and `weights_proj` is split into contiguous
rank slices, dim 1 of `wo_b`; routed experts go to ranks by contiguous index ranges (per block:
V4.1's DSpark stages have fewer experts); V4.1's Engram tables are split by padded row ranges
(ceil(rows / world) per rank, the last one padded with zero rows); everything else is replicated.
A rank reads only its own slice of each tensor through safetensors slicing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint that does not match the layout its config describes."""


# safetensors dtype names <-> torch dtypes for everything the released checkpoints hold.
ST_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
    "I64": torch.int64,
}


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # a key of ST_DTYPES


@dataclass(frozen=True)
class ShardRule:
    """How a tensor is split over tensor-parallel ranks."""

    dim: int | None  # None: replicated
    expert: int | None = None  # routed expert index: the tensor lives on one rank only
    padded: bool = False  # ceil(size / world) per rank, the last slice padded (Engram tables)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _linear(specs: dict[str, TensorSpec], name: str, out_f: int, in_f: int, fmt: str, c: ModelConfig) -> None:
    """A linear layer's weight (and scale) in the given storage format: 'fp8', 'fp4', 'bf16'."""
    quant = c.quant
    if quant is None or fmt == "bf16":
        specs[f"{name}.weight"] = TensorSpec((out_f, in_f), "BF16")
    elif fmt == "fp8":
        b = quant.weight_block
        specs[f"{name}.weight"] = TensorSpec((out_f, in_f), "F8_E4M3")
        specs[f"{name}.scale"] = TensorSpec((_ceil_div(out_f, b), _ceil_div(in_f, b)), "F8_E8M0")
    elif fmt == "fp4":
        specs[f"{name}.weight"] = TensorSpec((out_f, in_f // 2), "I8")
        specs[f"{name}.scale"] = TensorSpec((out_f, in_f // quant.fp4_block), "F8_E8M0")
    else:
        raise ValueError(fmt)


def _hc(specs: dict[str, TensorSpec], prefix: str, c: ModelConfig, rows: int, n_scale: int) -> None:
    specs[f"{prefix}_fn"] = TensorSpec((rows, c.hc_mult * c.dim), "F32")
    specs[f"{prefix}_base"] = TensorSpec((rows,), "F32")
    specs[f"{prefix}_scale"] = TensorSpec((n_scale,), "F32")


def _compressor(specs: dict[str, TensorSpec], p: str, c: ModelConfig, ratio: int, width: int) -> None:
    coff = 2 if ratio == 4 else 1  # ratio-4 compressors pool overlapping windows: two series
    specs[f"{p}.ape"] = TensorSpec((ratio, coff * width), "F32")
    specs[f"{p}.wkv.weight"] = TensorSpec((coff * width, c.dim), "BF16")
    specs[f"{p}.wgate.weight"] = TensorSpec((coff * width, c.dim), "BF16")
    specs[f"{p}.norm.weight"] = TensorSpec((width,), "BF16")


def _block_head(s: dict[str, TensorSpec], c: ModelConfig, p: str) -> None:
    """What every block of both families has before its compressor: norms, mHC sites, the
    attention's query, window KV and output projections."""
    mix = (2 + c.hc_mult) * c.hc_mult
    s[f"{p}.attn_norm.weight"] = TensorSpec((c.dim,), "BF16")
    s[f"{p}.ffn_norm.weight"] = TensorSpec((c.dim,), "BF16")
    _hc(s, f"{p}.hc_attn", c, mix, 3)
    _hc(s, f"{p}.hc_ffn", c, mix, 3)
    a = f"{p}.attn"
    s[f"{a}.attn_sink"] = TensorSpec((c.n_heads,), "F32")
    _linear(s, f"{a}.wq_a", c.q_lora_rank, c.dim, "fp8", c)
    s[f"{a}.q_norm.weight"] = TensorSpec((c.q_lora_rank,), "BF16")
    _linear(s, f"{a}.wq_b", c.n_heads * c.head_dim, c.q_lora_rank, "fp8", c)
    _linear(s, f"{a}.wkv", c.head_dim, c.dim, "fp8", c)
    s[f"{a}.kv_norm.weight"] = TensorSpec((c.head_dim,), "BF16")
    _linear(s, f"{a}.wo_a", c.o_groups * c.o_lora_rank, c.n_heads * c.head_dim // c.o_groups, "fp8", c)
    _linear(s, f"{a}.wo_b", c.dim, c.o_groups * c.o_lora_rank, "fp8", c)


def _moe(s: dict[str, TensorSpec], c: ModelConfig, p: str, gate: dict[str, TensorSpec]) -> None:
    """The MoE of a block: the gate (its extra tensors in `gate`), routed and shared experts."""
    f = f"{p}.ffn"
    n_experts, _ = c.n_experts_of(p)
    s[f"{f}.gate.weight"] = TensorSpec((n_experts, c.dim), "BF16")
    s |= {f"{f}.gate.{k}": v for k, v in gate.items()}
    expert_fmt = c.quant.expert_dtype if c.quant else "bf16"
    for e in range(n_experts):
        _linear(s, f"{f}.experts.{e}.w1", c.moe_inter_dim, c.dim, expert_fmt, c)
        _linear(s, f"{f}.experts.{e}.w2", c.dim, c.moe_inter_dim, expert_fmt, c)
        _linear(s, f"{f}.experts.{e}.w3", c.moe_inter_dim, c.dim, expert_fmt, c)
    _linear(s, f"{f}.shared_experts.w1", c.moe_inter_dim, c.dim, "fp8", c)
    _linear(s, f"{f}.shared_experts.w2", c.dim, c.moe_inter_dim, "fp8", c)
    _linear(s, f"{f}.shared_experts.w3", c.moe_inter_dim, c.dim, "fp8", c)


def block_schema(c: ModelConfig, p: str, ratio: int, hash_layer: bool) -> dict[str, TensorSpec]:
    """The tensors of one V4 transformer block (a backbone layer or an MTP layer) under prefix p."""
    s: dict[str, TensorSpec] = {}
    _block_head(s, c, p)
    a = f"{p}.attn"
    if ratio:
        _compressor(s, f"{a}.compressor", c, ratio, c.head_dim)
    if ratio == 4:
        _linear(s, f"{a}.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank, "fp8", c)
        s[f"{a}.indexer.weights_proj.weight"] = TensorSpec((c.index_n_heads, c.dim), "BF16")
        _compressor(s, f"{a}.indexer.compressor", c, ratio, c.index_head_dim)
    if hash_layer:
        gate = {"tid2eid": TensorSpec((c.vocab_size, c.n_activated_experts), "I64")}
    else:
        gate = {"bias": TensorSpec((c.n_routed_experts,), "F32")}
    _moe(s, c, p, gate)
    return s


def v41_block_schema(c: ModelConfig, p: str, layer: int | None) -> dict[str, TensorSpec]:
    """The tensors of one V4.1 block: backbone layer `layer`, or a DSpark stage (layer None)."""
    assert c.csa2 is not None and c.engram is not None and c.quant is not None
    s: dict[str, TensorSpec] = {}
    _block_head(s, c, p)
    a = f"{p}.attn"
    if layer in c.csa2.kv_source_layers:  # the compressor and the index keys, from the pre-RoPE latent
        ratio = c.compress_ratios[layer]
        s[f"{a}.compressor.wkv.weight"] = TensorSpec((c.head_dim, c.dim), "BF16")
        if ratio > 1:  # ratio 1 has nothing to pool: no gate
            s[f"{a}.compressor.wgate.weight"] = TensorSpec((c.head_dim, c.dim), "BF16")
        s[f"{a}.compressor.norm.weight"] = TensorSpec((c.head_dim,), "BF16")
        s[f"{a}.indexer.wk.weight"] = TensorSpec((c.index_head_dim, c.head_dim), "BF16")
        s[f"{a}.indexer.k_norm.weight"] = TensorSpec((c.index_head_dim,), "BF16")
    if layer in c.csa2.index_source_layers:
        _linear(s, f"{a}.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank, "fp8", c)
        s[f"{a}.indexer.weights_proj.weight"] = TensorSpec((c.index_n_heads, c.dim), "BF16")
    if layer in c.engram.layer_ids:
        e, g = c.engram, f"{p}.engram"
        rows = e.num_embeddings[e.layer_ids.index(layer)]
        s[f"{g}.embed.weight"] = TensorSpec((rows, e.head_dim), "F8_E4M3")
        s[f"{g}.embed.scale"] = TensorSpec((rows, e.head_dim // c.quant.weight_block), "F8_E8M0")
        _linear(s, f"{g}.wkv", (c.hc_mult + 1) * c.dim, e.n_hash_columns * e.head_dim, "fp8", c)
        s[f"{g}.q_weight"] = TensorSpec((c.hc_mult, c.dim), "BF16")
        s[f"{g}.k_weight"] = TensorSpec((c.hc_mult, c.dim), "BF16")
    n_experts, _ = c.n_experts_of(p)
    gate = {"bias": TensorSpec((n_experts,), "F32")}
    if c.vision is not None:  # image-span tokens route with their own bias
        gate["bias_vl"] = TensorSpec((n_experts,), "F32")
    _moe(s, c, p, gate)
    return s


def vision_schema(c: ModelConfig) -> dict[str, TensorSpec]:
    """DeepSeek-ViT, the aligner and the image-span embeddings (loaded now, run by a later issue)."""
    v = c.vision
    assert v is not None
    s: dict[str, TensorSpec] = {}
    for name in ("image_start", "image_end", "image_newline"):
        s[name] = TensorSpec((c.dim,), "BF16")
    patch = 3 * v.patch_size**2
    s["vision.patch_embed.proj.weight"] = TensorSpec((v.dim, patch), "BF16")
    s["vision.patch_embed.proj.bias"] = TensorSpec((v.dim,), "BF16")
    for b in range(v.n_layers):
        p = f"vision.blocks.{b}"
        s[f"{p}.norm1.weight"] = TensorSpec((v.dim,), "BF16")
        s[f"{p}.norm2.weight"] = TensorSpec((v.dim,), "BF16")
        s[f"{p}.attn.wqkv.weight"] = TensorSpec((3 * v.dim, v.dim), "BF16")
        s[f"{p}.attn.wqkv.bias"] = TensorSpec((3 * v.dim,), "BF16")
        s[f"{p}.attn.wo.weight"] = TensorSpec((v.dim, v.dim), "BF16")
        s[f"{p}.attn.wo.bias"] = TensorSpec((v.dim,), "BF16")
        s[f"{p}.mlp.w1.weight"] = TensorSpec((2 * v.inter_dim, v.dim), "BF16")  # gate and up, fused
        s[f"{p}.mlp.w2.weight"] = TensorSpec((v.dim, v.inter_dim), "BF16")
    s["vision.norm.weight"] = TensorSpec((v.dim,), "BF16")
    unshuffled = v.dim * v.downsample_ratio**2
    s["aligner.w1.weight"] = TensorSpec((c.dim, unshuffled), "BF16")
    s["aligner.w1.bias"] = TensorSpec((c.dim,), "BF16")
    s["aligner.w2.weight"] = TensorSpec((c.dim, c.dim), "BF16")
    s["aligner.w2.bias"] = TensorSpec((c.dim,), "BF16")
    return s


def mtp_schema(c: ModelConfig, stage: int) -> dict[str, TensorSpec]:
    """A NextN MTP layer: a window-only block plus its input projections and own hc head."""
    p = f"mtp.{stage}"
    s = block_schema(c, p, ratio=0, hash_layer=False)
    _linear(s, f"{p}.e_proj", c.dim, c.dim, "fp8", c)
    _linear(s, f"{p}.h_proj", c.dim, c.dim, "fp8", c)
    for norm in ("enorm", "hnorm", "norm"):
        s[f"{p}.{norm}.weight"] = TensorSpec((c.dim,), "BF16")
    _hc(s, f"{p}.hc_head", c, c.hc_mult, 1)
    return s


def dspark_schema(c: ModelConfig, n_stages: int) -> dict[str, TensorSpec]:
    """DSpark draft stages (V4-Flash-0731, V4.1-Flash): window-only blocks fed by the target layers'
    features, with a Markov head and a confidence head on the last stage (and, in V4, an hc head).
    Loaded now, used by speculative decoding later."""
    assert c.dspark is not None
    s: dict[str, TensorSpec] = {}
    for stage in range(n_stages):
        p = f"mtp.{stage}"
        s |= v41_block_schema(c, p, None) if c.family == "v41" else block_schema(c, p, ratio=0, hash_layer=False)
    _linear(s, "mtp.0.main_proj", c.dim, len(c.dspark.target_layer_ids) * c.dim, "fp8", c)
    s["mtp.0.main_norm.weight"] = TensorSpec((c.dim,), "BF16")
    last = f"mtp.{n_stages - 1}"
    s[f"{last}.norm.weight"] = TensorSpec((c.dim,), "BF16")
    s[f"{last}.markov_head.embed.weight"] = TensorSpec((c.vocab_size, c.dspark.markov_rank), "BF16")
    s[f"{last}.markov_head.head.weight"] = TensorSpec((c.vocab_size, c.dspark.markov_rank), "BF16")
    s[f"{last}.confidence_head.proj.weight"] = TensorSpec((1, c.dim + c.dspark.markov_rank), "BF16")
    if c.family == "v4":
        _hc(s, f"{last}.hc_head", c, c.hc_mult, 1)
    return s


DSPARK_STAGES = 3  # V4-Flash-0731 ships three stages whatever num_nextn_predict_layers says


def checkpoint_schema(c: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor of a checkpoint of this config, by native name."""
    s: dict[str, TensorSpec] = {
        "embed.weight": TensorSpec((c.vocab_size, c.dim), "BF16"),
        "head.weight": TensorSpec((c.vocab_size, c.dim), "BF16"),
        "norm.weight": TensorSpec((c.dim,), "BF16"),
    }
    if c.family == "v41":  # single-pass mHC: no hc_head; the DSpark stages are counted by the config
        for layer in range(c.n_layers):
            s |= v41_block_schema(c, f"layers.{layer}", layer)
        if c.dspark is not None:
            s |= dspark_schema(c, c.n_mtp_layers)
        if c.vision is not None:
            s |= vision_schema(c)
        return s
    _hc(s, "hc_head", c, c.hc_mult, 1)
    for layer in range(c.n_layers):
        s |= block_schema(c, f"layers.{layer}", c.compress_ratios[layer], c.is_hash_layer(layer))
    if c.dspark is not None:
        s |= dspark_schema(c, DSPARK_STAGES)
    else:
        for stage in range(c.n_mtp_layers):
            s |= mtp_schema(c, stage)
    return s


# ---- tensor parallelism -------------------------------------------------------------------------

_SPLIT_DIM0 = re.compile(
    r"^(embed|head)\.weight$|\.attn\.wq_b\.(weight|scale)$|\.attn\.wo_a\.(weight|scale)$|\.attn_sink$"
    r"|\.indexer\.wq_b\.(weight|scale)$|\.indexer\.weights_proj\.weight$"
)
_SPLIT_DIM1 = re.compile(r"\.attn\.wo_b\.(weight|scale)$")
_PADDED_DIM0 = re.compile(r"\.engram\.embed\.(weight|scale)$")
_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")


def shard_rule(name: str) -> ShardRule:
    if m := _EXPERT.search(name):
        return ShardRule(dim=None, expert=int(m.group(1)))
    if _PADDED_DIM0.search(name):
        return ShardRule(dim=0, padded=True)
    if _SPLIT_DIM0.search(name):
        return ShardRule(dim=0)
    if _SPLIT_DIM1.search(name):
        return ShardRule(dim=1)
    return ShardRule(dim=None)


def expert_range(n_experts: int, rank: int, world: int) -> range:
    per = n_experts // world
    return range(rank * per, (rank + 1) * per)


def check_tp(c: ModelConfig, world: int) -> None:
    """Every split point must fall on a head, group and quantisation-block boundary."""
    problems = []
    if c.n_heads % world or c.o_groups % world:
        problems.append(f"num_attention_heads={c.n_heads} and o_groups={c.o_groups} must be divisible by {world}")
    if c.index_n_heads % world:
        problems.append(f"index_n_heads={c.index_n_heads} must be divisible by {world}")
    if c.n_routed_experts % world:
        problems.append(f"n_routed_experts={c.n_routed_experts} must be divisible by {world}")
    if c.dspark is not None and c.dspark.n_routed_experts is not None and c.dspark.n_routed_experts % world:
        problems.append(f"dspark_n_routed_experts={c.dspark.n_routed_experts} must be divisible by {world}")
    if c.vocab_size % world:
        problems.append(f"vocab_size={c.vocab_size} must be divisible by {world}")
    if c.quant is not None:
        b = c.quant.weight_block
        for what, rows in (
            ("wq_b rows per rank", c.n_heads * c.head_dim // world),
            ("wo_a rows per rank", c.o_groups * c.o_lora_rank // world),
            ("wo_b columns per rank", c.o_groups * c.o_lora_rank // world),
            ("indexer wq_b rows per rank", c.index_n_heads * c.index_head_dim // world),
        ):
            if rows % b:
                problems.append(f"{what} ({rows}) must be a multiple of the FP8 block {b}")
    if problems:
        raise CheckpointError(f"tensor parallelism {world} does not fit this model: " + "; ".join(problems))


def rank_tensor_names(schema: dict[str, TensorSpec], c: ModelConfig, rank: int, world: int, rule: Callable[[str], ShardRule] = shard_rule) -> list[str]:
    """The tensors a rank holds: all but the routed experts of other ranks."""
    return [n for n in schema if (e := rule(n).expert) is None or e in expert_range(c.n_experts_of(n)[0], rank, world)]


def slice_for_rank(shape: tuple[int, ...], rule: ShardRule, rank: int, world: int) -> tuple[slice, ...]:
    if rule.dim is None or world == 1:
        return tuple(slice(None) for _ in shape)
    per = -(-shape[rule.dim] // world) if rule.padded else shape[rule.dim] // world
    index = [slice(None)] * len(shape)
    index[rule.dim] = slice(rank * per, (rank + 1) * per)
    return tuple(index)


# ---- reading ------------------------------------------------------------------------------------


def read_index(ckpt_dir: Path) -> dict[str, str]:
    """tensor name -> shard file, from `model.safetensors.index.json` (or one `model.safetensors`)."""
    index_path = ckpt_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path} has no weight_map")
        return weight_map
    single = ckpt_dir / "model.safetensors"
    if single.is_file():
        with open_shard(single) as f:
            return {name: single.name for name in f.keys()}
    raise CheckpointError(f"no model.safetensors.index.json or model.safetensors in {ckpt_dir}")


def open_shard(path: Path):
    """safe_open(path), with a damaged or cut-short file named in the error (safetensors' own
    message does not say which of a checkpoint's files it read)."""
    try:
        return safe_open(path, "pt")
    except Exception as exc:
        raise CheckpointError(f"shard {path.name} cannot be read ({exc}; {path.stat().st_size} bytes): damaged or incomplete?") from None


def checkpoint_revision(ckpt_dir: str | Path) -> str:
    """A short name of the exact weights in `ckpt_dir`, cheap to compute at any size.

    Hashes the config files, the index and, per shard file, its size, its safetensors header (every
    tensor's name, dtype, shape and offsets) and the first and last 64 KiB of tensor data. Two
    checkpoints of one layout but different weights (e.g. random ones from different seeds) get
    different revisions; conversation-cache snapshots only move between servers whose revisions
    are equal (a full hash of 160 GB of weights would cost minutes at every start)."""
    ckpt_dir = Path(ckpt_dir)
    h = hashlib.blake2b(digest_size=8, person=b"dsuf-ckpt-rev1")
    for name in ("config.json", "inference/config.json", "model.safetensors.index.json"):
        path = ckpt_dir / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"-") + b"\0")
    edge = 64 << 10
    for shard in sorted(set(read_index(ckpt_dir).values())):
        with open(ckpt_dir / shard, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(shard.encode() + size.to_bytes(8, "little"))
            header_len = int.from_bytes(f.read(8), "little")  # safetensors: u64 length, JSON header, data
            h.update(f.read(header_len + edge))
            f.seek(max(0, size - edge))
            h.update(f.read())
    return h.hexdigest()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The converter's padding of a short last slice: zero weights, scales of E8M0 code 1."""
    code = 1 if t.dtype == torch.float8_e8m0fnu else 0
    fill = torch.full((rows - t.shape[0], *t.shape[1:]), code, dtype=torch.uint8)
    return torch.cat((t.view(torch.uint8), fill)).view(t.dtype)


# Plain (unquantised) checkpoints may store their bf16 tensors as float32.
_ACCEPTED_DTYPES = {"BF16": ("BF16", "F32")}


def _summarise(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" … (+{len(names) - limit} more)" if len(names) > limit else "")


def load_tensors(
    ckpt_dir: str | Path, c: ModelConfig, rank: int = 0, world: int = 1, rule: Callable[[str], ShardRule] = shard_rule
) -> dict[str, torch.Tensor]:
    """Read one tensor-parallel rank's slice of every tensor, checking names, shapes and dtypes;
    `rule` says how each tensor splits (default: the reference path's plan; the GPU path has its own).

    Returns tensors in their storage dtypes (FP8 e4m3, E8M0, packed I8, BF16, F32, I64).
    """
    ckpt_dir = Path(ckpt_dir)
    if not 0 <= rank < world:
        raise CheckpointError(f"tensor-parallel rank {rank} is outside a world of {world}")
    if world > 1 and rule is shard_rule:  # another plan checks its own split points
        check_tp(c, world)
    schema = checkpoint_schema(c)
    weight_map = read_index(ckpt_dir)
    missing = [n for n in schema if n not in weight_map]
    extra = [n for n in weight_map if n not in schema]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {_summarise(missing)}")
        if extra:
            parts.append(f"unexpected {len(extra)}: {_summarise(extra)}")
        raise CheckpointError(f"checkpoint {ckpt_dir} does not match its config: " + "; ".join(parts))

    wanted = rank_tensor_names(schema, c, rank, world, rule)
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(weight_map[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    wrong: list[str] = []
    for file, names in sorted(by_file.items()):
        path = ckpt_dir / file
        if not path.is_file():
            raise CheckpointError(f"shard {file} named in the index is missing from {ckpt_dir}")
        with open_shard(path) as f:
            present = set(f.keys())
            unindexed = [n for n in present if n not in weight_map]
            if unindexed:
                raise CheckpointError(f"shard {file} holds tensors the index does not name: {_summarise(unindexed)}")
            for name in names:
                if name not in present:
                    raise CheckpointError(f"tensor {name} is not in shard {file} as the index says")
                view = f.get_slice(name)
                spec = schema[name]
                shape, dtype = tuple(view.get_shape()), view.get_dtype()
                if shape != spec.shape or dtype not in _ACCEPTED_DTYPES.get(spec.dtype, (spec.dtype,)):
                    wrong.append(f"{name} is {dtype}{list(shape)}, expected {spec.dtype}{list(spec.shape)}")
                    continue
                how = rule(name)
                tensors[name] = view[slice_for_rank(shape, how, rank, world)]
                if how.padded:
                    tensors[name] = _pad_rows(tensors[name], -(-shape[0] // world))
    if wrong:
        raise CheckpointError(f"{len(wrong)} tensor(s) with the wrong dtype or shape: " + "; ".join(wrong[:8]))
    return tensors
