"""V4.1-Flash's nested config, its inference-config names and its checkpoint layout: the released
files parse to the right facts and the right tensor list, every inconsistency is a one-line
ConfigError naming the field, and tensor parallelism slices Engram tables by padded row ranges."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from dsuf.model.checkpoint import ST_DTYPES, CheckpointError, check_tp, checkpoint_schema, load_tensors
from dsuf.model.config import ConfigError, load_any_config, load_v41_config, parse_config, parse_v41_config, v41_inference_config
from dsuf.model.tiny import make_tiny, tiny_config_dict

DATA = Path("/work/shared/data")
V41 = DATA / "dsv41_flash_config.json"
V41_INFERENCE = DATA / "dsv41_flash_inference_config.reconstructed.json"

needs_official = pytest.mark.skipif(not V41.is_file(), reason="official configs not in /work/shared/data")


def official() -> dict:
    return json.loads(V41.read_text())


def folder_with(tmp_path: Path, config: dict, inference: dict | None = None) -> Path:
    folder = tmp_path / "DeepSeek-V4.1-Flash"
    (folder / "inference").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if inference is not None:
        (folder / "inference" / "config.json").write_text(json.dumps(inference))
    return folder


def assert_config_error(call, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and field in message, message


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


# ---- the released files ------------------------------------------------------------------------


@needs_official
def test_v41_flash_config_parses_to_the_released_facts():
    c = parse_v41_config(official())
    assert c.family == "v41" and c.n_layers == 40 and c.dim == 5120 and c.q_lora_rank == 1280
    assert c.n_heads == 64 and c.head_dim == 512 and c.rope_head_dim == 64 and c.o_groups == 8 and c.o_lora_rank == 1024
    assert c.n_routed_experts == 384 and c.n_activated_experts == 6 and c.moe_inter_dim == 2304 and c.n_hash_layers == 0
    assert c.norm_eps == 1e-20 and c.hc_eps == 1e-6 and c.swiglu_limit == 10.0 and c.route_scale == 1.5
    assert c.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 and c.mtp_compress_ratios == (0, 0, 0)
    assert c.index_n_heads == 32 and c.index_head_dim == 128 and c.index_topk == 512
    assert c.csa2.kv_source_layers == (2, 8, 14, 20) and c.csa2.index_source_layers == (2, 8, 14, 20, 24, 28, 32, 36)
    assert (c.csa2.candidate_source_layer, c.csa2.candidate_topk_blocks, c.csa2.candidate_block_size) == (20, 2048, 8)
    assert c.quant.weight_block == 32 and c.quant.expert_dtype == "fp4"
    e = c.engram
    assert e.layer_ids == (1, 14) and e.num_embeddings == (384006168, 384016682) and e.compressed_vocab_size == 99092
    assert (e.max_ngram_size, e.n_heads, e.head_dim, e.pad_token_id) == (4, 8, 256, 2) and e.n_hash_columns == 24
    assert c.dspark.target_layer_ids == (37, 38, 39) and (c.dspark.n_routed_experts, c.dspark.n_activated_experts) == (128, 3)
    assert c.n_mtp_layers == 3 and c.image_token_id == 129264 and c.eos_token_id == 1
    assert c.vision.n_layers == 32 and c.vision.dim == 1024 and c.vision.max_wh_ratio is None


@needs_official
def test_v41_layer_roles_and_the_cache_each_layer_reads():
    c = parse_v41_config(official())
    kinds = [c.layer_kind(i) for i in range(40)]
    assert kinds[:2] == ["swa", "swa"]
    assert [i for i, k in enumerate(kinds) if k == "full"] == [2, 8, 14, 20]
    assert [i for i, k in enumerate(kinds) if k == "reindex"] == [24, 28, 32, 36]
    assert kinds.count("reuse") == 40 - 2 - 4 - 4
    reads = {layer: c.kv_source_of(layer) for layer in range(2, 40)}
    assert all(reads[i] == 2 for i in range(3, 8)) and all(reads[i] == 8 for i in range(9, 14))
    assert all(reads[i] == 14 for i in range(15, 20)) and all(reads[i] == 20 for i in range(21, 40))


@needs_official
def test_v41_folder_loads_and_agrees_with_its_inference_config(tmp_path):
    folder = folder_with(tmp_path, official(), json.loads(V41_INFERENCE.read_text()))
    c = load_v41_config(folder)
    assert c.name == "DeepSeek-V4.1-Flash" and load_any_config(folder) == c
    assert v41_inference_config(official()) == json.loads(V41_INFERENCE.read_text())  # the flat names, key for key


@needs_official
@pytest.mark.parametrize(
    ("key", "value", "hf_field"),
    [
        ("kv_source_layers", [2, 8, 14], "text_config.kv_source_layer_ids"),
        ("candidate_source_layer", 14, "text_config.candidate_source_layer_id"),
        ("engram_pad_id", 3, "text_config.engram_pad_token_id"),
        ("dspark_n_activated_experts", 6, "text_config.dspark_num_experts_per_tok"),
        ("norm_eps", 1e-6, "text_config.rms_norm_eps"),
        ("expert_dtype", "fp8", "quantization_config.expert_dtype"),
        ("vision_max_n_token", 2048, "vision_config.max_image_tokens"),
        ("image_token_id", 129279, "image_token_id"),
    ],
)
def test_v41_inference_config_disagreement_names_both_fields(tmp_path, key, value, hf_field):
    inference = json.loads(V41_INFERENCE.read_text()) | {key: value}
    folder = folder_with(tmp_path, official(), inference)
    with pytest.raises(ConfigError) as info:
        load_v41_config(folder)
    assert key in str(info.value) and hf_field in str(info.value)


@needs_official
def test_load_any_config_picks_the_family_and_the_v4_parser_refuses_v41(tmp_path):
    v4 = tmp_path / "v4"
    v4.mkdir()
    shutil.copy(DATA / "dsv4_flash_config.json", v4 / "config.json")
    assert load_any_config(v4).family == "v4"
    assert load_any_config(folder_with(tmp_path, official())).family == "v41"
    assert_config_error(lambda: parse_config(official()), "model_type")
    assert_config_error(lambda: parse_v41_config(json.loads((DATA / "dsv4_flash_config.json").read_text())), "model_type")


def edited(**changes) -> dict:
    """The official V4.1 config with text_config keys changed."""
    raw = official()
    raw["text_config"] |= changes
    return raw


BAD = {
    "prime rule": (dict(engram_num_embeddings=[384006168, 384016683]), "engram_num_embeddings"),
    "source of ratio 0": (dict(kv_source_layer_ids=[1, 8, 14, 20]), "kv_source_layer_ids"),
    "reuse layer with another ratio": (dict(kv_source_layer_ids=[2, 8, 14, 21]), "compress_ratios"),
    "source without indexer": (dict(index_source_layer_ids=[8, 14, 20, 24]), "index_source_layer_ids"),
    "candidate not the last source": (dict(candidate_source_layer_id=14), "candidate_source_layer_id"),
    "reindex below the candidate": (dict(index_source_layer_ids=[2, 8, 14, 16, 20]), "index_source_layer_ids"),
    "candidate budget below top-k": (dict(candidate_topk_blocks=8, candidate_block_size=8, index_topk=512), "candidate_topk_blocks"),
    "ratio 4": (dict(compress_ratios=[0, 0] + [4] * 18 + [1] * 20 + [0, 0, 0]), "compress_ratios"),
    "engram layer outside": (dict(engram_layer_ids=[1, 40]), "engram_layer_ids"),
    "engram rows not per 32": (dict(engram_head_dim=48), "engram_head_dim"),
    "unknown text key": (dict(num_hash_layers=3), "text_config.num_hash_layers"),
    "dspark top-k above experts": (dict(dspark_num_experts_per_tok=200), "dspark_num_experts_per_tok"),
}


@needs_official
@pytest.mark.parametrize("case", list(BAD))
def test_bad_v41_config_is_one_line_error_naming_the_field(case):
    changes, field = BAD[case]
    assert_config_error(lambda: parse_v41_config(edited(**changes)), field)


@needs_official
def test_v41_needs_its_quantization_and_text_config():
    raw = official()
    del raw["quantization_config"]
    assert_config_error(lambda: parse_v41_config(raw), "quantization_config")
    raw = official()
    del raw["text_config"]
    assert_config_error(lambda: parse_v41_config(raw), "text_config")
    raw = official()
    raw["vision_config"]["num_hidden_layers"] = 0
    assert_config_error(lambda: parse_v41_config(raw), "vision_config.num_hidden_layers")


# ---- the checkpoint layout ------------------------------------------------------------------------


@needs_official
def test_v41_schema_matches_the_released_checkpoint_totals():
    """model.md §2: 96,085 tensors, 475.3 GiB (two ≈98 GB FP8 Engram tables included)."""
    schema = checkpoint_schema(parse_v41_config(official()))
    assert len(schema) == 96085
    total = sum(math.prod(s.shape) * torch.empty((), dtype=ST_DTYPES[s.dtype]).element_size() for s in schema.values())
    assert round(total / 2**30, 1) == 475.2  # 510,286,023,000 B; model.md rounds it to 475.3 GiB


@needs_official
@pytest.mark.parametrize(
    ("name", "dtype", "shape"),
    [
        ("layers.0.attn.wq_a.scale", "F8_E8M0", (40, 160)),
        ("layers.0.attn.wq_b.weight", "F8_E4M3", (32768, 1280)),
        ("layers.5.attn.wo_b.scale", "F8_E8M0", (160, 256)),
        ("layers.3.ffn.gate.bias_vl", "F32", (384,)),
        ("layers.3.ffn.experts.383.w2.weight", "I8", (5120, 1152)),
        ("layers.3.ffn.experts.383.w2.scale", "F8_E8M0", (5120, 72)),
        ("layers.2.attn.compressor.wgate.weight", "BF16", (512, 5120)),
        ("layers.20.attn.indexer.wk.weight", "BF16", (128, 512)),
        ("layers.24.attn.indexer.wq_b.scale", "F8_E8M0", (128, 40)),
        ("layers.24.attn.indexer.weights_proj.weight", "BF16", (32, 5120)),
        ("layers.1.engram.embed.weight", "F8_E4M3", (384006168, 256)),
        ("layers.14.engram.embed.scale", "F8_E8M0", (384016682, 8)),
        ("layers.1.engram.wkv.scale", "F8_E8M0", (800, 192)),
        ("layers.1.engram.q_weight", "BF16", (4, 5120)),
        ("mtp.0.main_proj.weight", "F8_E4M3", (5120, 15360)),
        ("mtp.1.ffn.experts.127.w1.weight", "I8", (2304, 2560)),
        ("mtp.2.confidence_head.proj.weight", "BF16", (1, 5376)),
        ("vision.blocks.31.mlp.w1.weight", "BF16", (5632, 1024)),
        ("aligner.w1.weight", "BF16", (5120, 9216)),
        ("image_newline", "BF16", (5120,)),
    ],
)
def test_v41_native_names_and_dtypes(name, dtype, shape):
    spec = checkpoint_schema(parse_v41_config(official()))[name]
    assert (spec.dtype, spec.shape) == (dtype, shape)


@needs_official
@pytest.mark.parametrize(
    "absent",
    ["hc_head_fn", "layers.20.attn.compressor.wgate.weight", "layers.3.attn.compressor.wkv.weight", "layers.24.attn.indexer.wk.weight",
     "layers.21.attn.indexer.wq_b.weight", "layers.0.ffn.gate.tid2eid", "layers.2.attn.compressor.ape", "mtp.0.ffn.experts.128.w1.weight",
     "mtp.2.hc_head_fn", "layers.2.engram.wkv.weight"],
)
def test_v41_schema_has_no_v4_or_misplaced_tensors(absent):
    assert absent not in checkpoint_schema(parse_v41_config(official()))


@needs_official
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_v41_flash_fits_tensor_parallel(world):
    check_tp(parse_v41_config(official()), world)


def test_tiny_v41_round_trip_and_tp2_slices(tiny_v41):
    folder = tiny_v41("default")
    config = load_any_config(folder)
    full = load_tensors(folder, config)
    assert full.keys() == checkpoint_schema(config).keys()
    ranks = [load_tensors(folder, config, rank=r, world=2) for r in range(2)]
    # Engram tables: ceil(rows / 2) per rank; the last slice is padded with zero rows and scale code 1.
    for layer, rows in zip(config.engram.layer_ids, config.engram.num_embeddings):
        for leaf in ("weight", "scale"):
            name = f"layers.{layer}.engram.embed.{leaf}"
            per = -(-rows // 2)
            parts = [r[name].view(torch.uint8) for r in ranks]
            assert all(p.shape[0] == per for p in parts), name
            whole = torch.cat(parts)
            assert torch.equal(whole[:rows], full[name].view(torch.uint8)), name
            assert torch.all(whole[rows:] == (1 if leaf == "scale" else 0)), name
    # DSpark stages split their own (smaller) expert count.
    held = [{n for n in r if n.startswith("mtp.0.ffn.experts.")} for r in ranks]
    assert {n.split(".")[4] for n in held[0]} == {"0", "1"} and {n.split(".")[4] for n in held[1]} == {"2", "3"}
    assert {n.split(".")[4] for n in ranks[1] if n.startswith("layers.2.ffn.experts.")} == {"4", "5", "6", "7"}
    with pytest.raises(CheckpointError, match="dspark_n_routed_experts"):
        check_tp(config.replace(dspark=config.dspark.__class__(**{**config.dspark.__dict__, "n_routed_experts": 3})), 2)


def test_tiny_v41_engram_tables_follow_the_prime_rule_and_overrides_route_to_text_config():
    raw = tiny_config_dict("v41", {"vocab_size": 300, "engram_vocab_size": 200, "vision_config.hidden_size": 64, "image_token_id": 9})
    text = raw["text_config"]
    assert text["vocab_size"] == 300 and raw["vision_config"]["hidden_size"] == 64 and raw["image_token_id"] == 9
    c = parse_v41_config(copy.deepcopy(raw))
    assert all(rows > 6 * 200 for rows in c.engram.num_embeddings)  # 3 n-gram sizes × 2 heads of primes above 200


def test_make_tiny_v41_refuses_plain(tmp_path):
    with pytest.raises(ValueError, match="FP8"):
        make_tiny(tmp_path / "x", family="v41", plain=True)
