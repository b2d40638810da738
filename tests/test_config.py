"""Specification of config parsing: the released V4-Flash configs parse to the right facts, and every
kind of config the engine cannot serve is a one-line `ConfigError` that names the offending field."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from dsuf.model.config import ConfigError, load_config, parse_config

DATA = Path("/work/shared/data")
V4_FLASH = DATA / "dsv4_flash_config.json"
V4_FLASH_INFERENCE = DATA / "dsv4_flash_inference_config.json"
V4_FLASH_0731 = DATA / "dsv4_flash_0731_config.json"
V41_FLASH = DATA / "dsv41_flash_config.json"

pytestmark = pytest.mark.skipif(not V4_FLASH.is_file(), reason="official configs not in /work/shared/data")


def official(path: Path = V4_FLASH) -> dict:
    return json.loads(path.read_text())


def checkpoint_folder(tmp_path: Path, config: dict | str, inference: dict | str | None = None) -> Path:
    """A checkpoint folder holding config.json and, optionally, inference/config.json."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if inference is not None:
        (folder / "inference").mkdir()
        (folder / "inference" / "config.json").write_text(inference if isinstance(inference, str) else json.dumps(inference))
    return folder


def assert_config_error(raw_or_call, field: str) -> ConfigError:
    """The config fails with a ConfigError whose single-line message names `field`."""
    with pytest.raises(ConfigError) as info:
        if callable(raw_or_call):
            raw_or_call()
        else:
            parse_config(raw_or_call)
    message = str(info.value)
    assert "\n" not in message, f"message is not one line: {message!r}"
    assert field in message, f"message does not name {field!r}: {message!r}"
    return info.value


# ---- the official files ----------------------------------------------------------------------


def check_v4_flash_facts(c) -> None:
    assert c.n_layers == 43
    assert c.vocab_size == 129280 and c.dim == 4096
    assert c.n_heads == 64 and c.head_dim == 512 and c.rope_head_dim == 64 and c.nope_head_dim == 448
    assert c.q_lora_rank == 1024 and c.o_lora_rank == 1024 and c.o_groups == 8
    assert c.window_size == 128
    assert len(c.compress_ratios) == 43
    assert [c.layer_kind(i) for i in range(4)] == ["swa", "swa", "csa", "hca"]
    assert c.compress_ratios[2:42] == (4, 128) * 20 and c.compress_ratios[42] == 4
    assert c.n_routed_experts == 256 and c.n_activated_experts == 6 and c.moe_inter_dim == 2048
    assert c.n_hash_layers == 3
    assert [c.is_hash_layer(i) for i in range(4)] == [True, True, True, False]
    assert c.index_n_heads == 64 and c.index_head_dim == 128 and c.index_topk == 512
    assert c.hc_mult == 4 and c.hc_sinkhorn_iters == 20 and c.hc_eps == 1e-6
    assert c.rope_theta == 10000 and c.compress_rope_theta == 160000
    assert c.rope_factor == 16 and c.original_seq_len == 65536 and c.beta_fast == 32 and c.beta_slow == 1
    assert c.swiglu_limit == 10.0 and c.route_scale == 1.5 and c.norm_eps == 1e-6
    assert c.n_mtp_layers == 1 and c.bos_token_id == 0 and c.eos_token_id == 1
    assert c.quant is not None and c.quant.weight_block == 128
    assert c.quant.expert_dtype == "fp4" and c.quant.fp4_block == 32


def test_v4_flash_config_parses():
    c = parse_config(official())
    check_v4_flash_facts(c)
    assert c.mtp_compress_ratios == (0,)  # the 44th entry belongs to the MTP layer
    assert c.dspark is None


def test_v4_flash_0731_config_parses_with_dspark():
    c = parse_config(official(V4_FLASH_0731))
    check_v4_flash_facts(c)
    assert c.mtp_compress_ratios == (0, 0, 0)
    assert c.dspark is not None
    assert c.dspark.target_layer_ids == (40, 41, 42)
    assert c.dspark.block_size == 5 and c.dspark.noise_token_id == 128799 and c.dspark.markov_rank == 256


def test_load_config_reads_folder_with_inference_config(tmp_path):
    folder = tmp_path / "DeepSeek-V4-Flash"
    (folder / "inference").mkdir(parents=True)
    shutil.copy(V4_FLASH, folder / "config.json")
    shutil.copy(V4_FLASH_INFERENCE, folder / "inference" / "config.json")
    c = load_config(folder)
    check_v4_flash_facts(c)
    assert c.name == "DeepSeek-V4-Flash"
    assert c == parse_config(official(), name="DeepSeek-V4-Flash")


def test_load_config_0731_folder_without_inference_config(tmp_path):
    folder = tmp_path / "DeepSeek-V4-Flash-0731"
    folder.mkdir()
    shutil.copy(V4_FLASH_0731, folder / "config.json")
    c = load_config(folder)
    assert c.dspark is not None and c.dspark.target_layer_ids == (40, 41, 42)


def test_parse_config_does_not_modify_its_input():
    raw = official(V4_FLASH_0731)
    before = copy.deepcopy(raw)
    parse_config(raw)
    assert raw == before


def test_rope_scaling_accepts_rope_type_spelling():
    raw = official()
    rope = raw["rope_scaling"]
    rope["rope_type"] = rope.pop("type")
    assert parse_config(raw).rope_factor == 16


# ---- inference/config.json cross-check --------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "hf_field"),
    [
        ("n_layers", 44, "num_hidden_layers"),
        ("window_size", 256, "sliding_window"),
        ("rope_factor", 4, "rope_scaling.factor"),
        ("original_seq_len", 4096, "rope_scaling.original_max_position_embeddings"),
        ("compress_ratios", [0, 0, 4], "compress_ratios"),
        ("expert_dtype", "fp8", "expert_dtype"),
        ("dtype", "bf16", "quantization_config"),
    ],
)
def test_inference_config_disagreement_names_the_field(tmp_path, key, value, hf_field):
    inference = official(V4_FLASH_INFERENCE) | {key: value}
    folder = checkpoint_folder(tmp_path, official(), inference)
    error = assert_config_error(lambda: load_config(folder), key)
    assert "inference/config.json" in str(error)
    assert hf_field in str(error)


def test_inference_config_unknown_key_fails(tmp_path):
    inference = official(V4_FLASH_INFERENCE) | {"kv_source_layers": [2, 8]}
    folder = checkpoint_folder(tmp_path, official(), inference)
    assert_config_error(lambda: load_config(folder), "kv_source_layers")


def test_inference_config_invalid_json_is_a_config_error(tmp_path):
    folder = checkpoint_folder(tmp_path, official(), "{not json")
    assert_config_error(lambda: load_config(folder), "inference/config.json")


# ---- bad configs ----------------------------------------------------------------------------------


def edited(**changes) -> dict:
    """The official V4-Flash config with keys changed (value None: key removed)."""
    raw = official()
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    return raw


RATIOS = official()["compress_ratios"]
ROPE = official()["rope_scaling"]
QUANT = official()["quantization_config"]

BAD_CONFIGS = {
    # name: (raw config, the field its message must name)
    "unknown key": (edited(kv_source_layer_ids=[2, 8]), "kv_source_layer_ids"),
    "missing hidden_size": (edited(hidden_size=None), "hidden_size"),
    "missing vocab_size": (edited(vocab_size=None), "vocab_size"),
    "missing compress_ratios": (edited(compress_ratios=None), "compress_ratios"),
    "missing compress_rope_theta": (edited(compress_rope_theta=None), "compress_rope_theta"),
    "hidden_size as string": (edited(hidden_size="4096"), "hidden_size"),
    "hidden_size as float": (edited(hidden_size=4096.0), "hidden_size"),
    "num_hidden_layers as bool": (edited(num_hidden_layers=True), "num_hidden_layers"),
    "rope_theta as string": (edited(rope_theta="10000"), "rope_theta"),
    "num_hash_layers above layers": (edited(num_hash_layers=44), "num_hash_layers"),
    "compress_ratios not a list": (edited(compress_ratios="4,128"), "compress_ratios"),
    "compress_ratios negative": (edited(compress_ratios=[-4] + RATIOS[1:]), "compress_ratios"),
    "compress_ratios too short": (edited(compress_ratios=RATIOS[:42]), "compress_ratios"),
    "non-zero trailing ratio": (edited(compress_ratios=RATIOS[:43] + [4]), "compress_ratios"),
    "ratio 1 (V4.1 CSA2)": (edited(compress_ratios=[0, 0, 1] + RATIOS[3:]), "compress_ratios"),
    "num_key_value_heads 8": (edited(num_key_value_heads=8), "num_key_value_heads"),
    "tie_word_embeddings": (edited(tie_word_embeddings=True), "tie_word_embeddings"),
    "scoring_func softmax": (edited(scoring_func="softmax"), "scoring_func"),
    "hidden_act gelu": (edited(hidden_act="gelu"), "hidden_act"),
    "rope_scaling linear": (edited(rope_scaling=ROPE | {"type": "linear"}), "rope_scaling"),
    "rope_scaling without factor": (
        edited(rope_scaling={k: v for k, v in ROPE.items() if k != "factor"}),
        "rope_scaling.factor",
    ),
    "o_groups not dividing heads": (edited(o_groups=7), "o_groups"),
    "top-k above experts": (edited(num_experts_per_tok=257), "num_experts_per_tok"),
    "odd rope head dim": (edited(qk_rope_head_dim=63), "qk_rope_head_dim"),
    "index_head_dim not a power of two": (edited(index_head_dim=96), "index_head_dim"),
    "quant method": (edited(quantization_config=QUANT | {"quant_method": "awq"}), "quantization_config.quant_method"),
    "non-square weight block": (
        edited(quantization_config=QUANT | {"weight_block_size": [128, 64]}),
        "quantization_config.weight_block_size",
    ),
    "expert dtype": (edited(expert_dtype="fp16"), "expert_dtype"),
    "V4.1 model_type": (edited(model_type="deepseek_v41"), "model_type"),
    "V4.1 official file": (official(V41_FLASH), "model_type"),
    "one dspark key only": (edited(dspark_block_size=5), "dspark_"),
    "dspark target outside backbone": (
        official(V4_FLASH_0731) | {"dspark_target_layer_ids": [41, 42, 43]},
        "dspark_target_layer_ids",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_is_one_line_config_error_naming_the_field(case):
    raw, field = BAD_CONFIGS[case]
    assert_config_error(raw, field)


def test_dspark_partial_keys_name_the_missing_one():
    raw = official(V4_FLASH_0731)
    del raw["dspark_markov_rank"]
    assert_config_error(raw, "dspark_markov_rank")


def test_trailing_ratio_message_shows_the_trailing_entries():
    error = assert_config_error(edited(compress_ratios=RATIOS[:43] + [128]), "compress_ratios")
    assert "128" in str(error)


def test_short_ratios_message_gives_both_counts():
    error = assert_config_error(edited(compress_ratios=RATIOS[:40]), "compress_ratios")
    assert "40" in str(error) and "43" in str(error)


# Values of the wrong type in fields that are optional or nested must fail the same way.
BAD_TYPES = {
    "rope_scaling as string": (edited(rope_scaling="yarn"), "rope_scaling"),
    "rope_scaling.factor as string": (edited(rope_scaling=ROPE | {"factor": "sixteen"}), "rope_scaling.factor"),
    "quantization_config as list": (edited(quantization_config=["fp8"]), "quantization_config"),
    "max_position_embeddings as string": (edited(max_position_embeddings="1M"), "max_position_embeddings"),
    "eos_token_id as string": (edited(eos_token_id="</s>"), "eos_token_id"),
    "num_nextn_predict_layers as string": (edited(num_nextn_predict_layers="one"), "num_nextn_predict_layers"),
}


@pytest.mark.parametrize("case", list(BAD_TYPES))
def test_wrong_type_in_optional_field_is_config_error(case):
    raw, field = BAD_TYPES[case]
    assert_config_error(raw, field)


def test_negative_mtp_layer_count_is_rejected():
    assert_config_error(edited(num_nextn_predict_layers=-1), "num_nextn_predict_layers")


def test_unknown_key_with_newline_still_gives_one_line_message():
    assert_config_error(edited(**{"bad\nkey": 1}), "unknown")


# ---- checkpoint folders --------------------------------------------------------------------------


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert "config.json" in str(info.value) and "\n" not in str(info.value)


def test_config_json_not_valid_json(tmp_path):
    folder = checkpoint_folder(tmp_path, '{"hidden_size": 4096,')
    assert_config_error(lambda: load_config(folder), "config.json")


def test_config_json_not_an_object(tmp_path):
    folder = checkpoint_folder(tmp_path, "[]")
    assert_config_error(lambda: load_config(folder), "config.json")


def test_bad_config_json_in_folder_fails_with_the_field(tmp_path):
    folder = checkpoint_folder(tmp_path, edited(num_key_value_heads=4))
    assert_config_error(lambda: load_config(folder), "num_key_value_heads")


def test_v41_folder_is_rejected(tmp_path):
    folder = checkpoint_folder(tmp_path, official(V41_FLASH))
    assert_config_error(lambda: load_config(folder), "model_type")
