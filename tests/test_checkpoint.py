"""Specification of the released checkpoint layout (`checkpoint_schema`) and of the loader
(`load_tensors`): native names and dtypes, the tiny writer's round trip, corruption diagnostics
and tensor-parallel slicing."""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsuf.model.checkpoint import (
    ST_DTYPES,
    CheckpointError,
    check_tp,
    checkpoint_schema,
    load_tensors,
)
from dsuf.model.config import load_config, parse_config
from dsuf.model.tiny import dequantize_tensors, make_tiny, random_tensors, tiny_config_dict

DATA = Path("/work/shared/data")
V4_FLASH = DATA / "dsv4_flash_config.json"
V4_FLASH_0731 = DATA / "dsv4_flash_0731_config.json"

SEED = 5
SMALL_VOCAB = {"vocab_size": 512}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu)

needs_official = pytest.mark.skipif(not V4_FLASH.is_file(), reason="official configs not in /work/shared/data")


def official(path: Path = V4_FLASH):
    return parse_config(json.loads(path.read_text()))


@functools.lru_cache(maxsize=None)
def official_schema(path: Path = V4_FLASH):
    return checkpoint_schema(official(path))


def tensor_bytes(spec) -> int:
    return math.prod(spec.shape) * torch.empty((), dtype=ST_DTYPES[spec.dtype]).element_size()


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(raw_bytes(got), raw_bytes(want)), f"{name}: contents differ"


# ---- the released layout (schema only) ------------------------------------------------------------


@needs_official
def test_v4_flash_schema_totals():
    schema = official_schema()
    assert len(schema) == 69_187
    assert sum(tensor_bytes(s) for s in schema.values()) == 159_609_485_896


@needs_official
def test_v4_flash_0731_schema_totals():
    schema = official_schema(V4_FLASH_0731)
    assert len(schema) == 72_317
    assert {n.split(".")[1] for n in schema if n.startswith("mtp.")} == {"0", "1", "2"}  # three DSpark stages
    assert schema["mtp.0.main_proj.weight"].shape == (4096, 3 * 4096)
    assert schema["mtp.2.markov_head.head.weight"].shape == (129280, 256)
    assert "mtp.0.e_proj.weight" not in schema


@needs_official
@pytest.mark.parametrize(
    ("prefix", "count"),
    [
        ("layers.0.", 1565),  # window-only, hash-routed
        ("layers.1.", 1565),
        ("layers.2.", 1576),  # CSA (compressor + indexer), hash-routed
        ("layers.3.", 1569),  # HCA (compressor only)
        ("layers.42.", 1576),  # CSA, score-routed
        ("mtp.0.", 1575),
    ],
)
def test_v4_flash_tensors_per_block(prefix, count):
    schema = official_schema()
    assert sum(1 for n in schema if n.startswith(prefix)) == count


@needs_official
@pytest.mark.parametrize(
    ("name", "dtype", "shape"),
    [
        ("embed.weight", "BF16", (129280, 4096)),
        ("head.weight", "BF16", (129280, 4096)),
        ("hc_head_fn", "F32", (4, 4 * 4096)),
        ("layers.0.ffn.gate.tid2eid", "I64", (129280, 6)),
        ("layers.3.ffn.gate.bias", "F32", (256,)),
        ("layers.3.ffn.gate.weight", "BF16", (256, 4096)),
        ("layers.5.ffn.experts.7.w2.weight", "I8", (4096, 1024)),
        ("layers.5.ffn.experts.7.w2.scale", "F8_E8M0", (4096, 64)),
        ("layers.5.ffn.experts.7.w1.weight", "I8", (2048, 2048)),
        ("layers.5.ffn.shared_experts.w1.weight", "F8_E4M3", (2048, 4096)),
        ("layers.5.ffn.shared_experts.w1.scale", "F8_E8M0", (16, 32)),
        ("layers.0.attn.wq_b.weight", "F8_E4M3", (64 * 512, 1024)),
        ("layers.0.attn.wo_a.weight", "F8_E4M3", (8 * 1024, 64 * 512 // 8)),
        ("layers.0.attn.wo_b.scale", "F8_E8M0", (32, 64)),
        ("layers.0.attn.attn_sink", "F32", (64,)),
        ("layers.0.hc_attn_fn", "F32", (24, 4 * 4096)),
        ("layers.0.hc_attn_scale", "F32", (3,)),
        ("layers.2.attn.indexer.compressor.ape", "F32", (4, 256)),
        ("layers.2.attn.indexer.wq_b.weight", "F8_E4M3", (64 * 128, 1024)),
        ("layers.2.attn.indexer.weights_proj.weight", "BF16", (64, 4096)),
        ("layers.2.attn.compressor.ape", "F32", (4, 1024)),
        ("layers.3.attn.compressor.ape", "F32", (128, 512)),
        ("layers.3.attn.compressor.wkv.weight", "BF16", (512, 4096)),
        ("mtp.0.e_proj.scale", "F8_E8M0", (32, 32)),
        ("mtp.0.hc_head_base", "F32", (4,)),
    ],
)
def test_v4_flash_native_names_and_dtypes(name, dtype, shape):
    spec = official_schema()[name]
    assert (spec.dtype, spec.shape) == (dtype, shape)


@needs_official
@pytest.mark.parametrize(
    "absent",
    [
        "layers.0.attn.compressor.ape",  # window-only layers have no compressor
        "layers.3.attn.indexer.wq_b.weight",  # only CSA layers have an indexer
        "layers.3.ffn.gate.tid2eid",  # layers past num_hash_layers route by score
        "layers.0.ffn.gate.bias",  # hash layers have no routing bias
        "layers.43.attn_norm.weight",  # the MTP entry of compress_ratios is not a backbone layer
        "mtp.1.e_proj.weight",  # one MTP layer
        "layers.0.ffn.experts.256.w1.weight",
    ],
)
def test_v4_flash_schema_has_no_extra_tensors(absent):
    assert absent not in official_schema()


# ---- tiny checkpoints: written once per module ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, config) of a quantised tiny checkpoint."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny-fp8"
    return out, make_tiny(out, seed=SEED, overrides=SMALL_VOCAB)


@pytest.fixture(scope="module")
def expected(tiny):
    """The tensors the writer was given, regenerated independently from the seed."""
    return random_tensors(tiny[1], SEED)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-plain"
    return out, make_tiny(out, seed=SEED, overrides=SMALL_VOCAB, plain=True)


@pytest.fixture(scope="module")
def plain_loaded(plain):
    folder, config = plain
    return load_tensors(folder, config)


@pytest.fixture(scope="module")
def loaded(tiny):
    folder, config = tiny
    return load_tensors(folder, config)


def copy_of(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / folder.name
    shutil.copytree(folder, dst)
    return dst


def read_weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def write_weight_map(folder: Path, weight_map: dict[str, str]) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = weight_map
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def rewrite_shard_of(folder: Path, name: str, edit) -> str:
    """Load the shard holding `name`, apply edit(dict) in place, save it back; returns the shard file."""
    file = read_weight_map(folder)[name]
    tensors = load_file(folder / file)
    edit(tensors)
    save_file(tensors, folder / file, metadata={"format": "pt"})
    return file


def checkpoint_error(folder: Path, config) -> str:
    with pytest.raises(CheckpointError) as info:
        load_tensors(folder, config)
    return str(info.value)


# ---- round trip and released layout ---------------------------------------------------------------


def test_round_trip_returns_exactly_the_written_tensors(tiny, expected, loaded):
    _, config = tiny
    assert set(loaded) == set(expected) == set(checkpoint_schema(config))
    for name, want in expected.items():
        assert_same_tensor(loaded[name], want, name)


def test_loaded_tensors_have_the_schema_dtypes_and_shapes(tiny, loaded):
    _, config = tiny
    for name, spec in checkpoint_schema(config).items():
        assert loaded[name].dtype == ST_DTYPES[spec.dtype], name
        assert tuple(loaded[name].shape) == spec.shape, name
    kinds = {spec.dtype for spec in checkpoint_schema(config).values()}
    assert kinds == {"BF16", "F32", "F8_E4M3", "F8_E8M0", "I8", "I64"}


def test_tiny_tensors_are_random_not_constant(loaded):
    """Guards the round trip against a writer and a generator that agree on something trivial."""
    embed = loaded["embed.weight"].float()
    assert 0.5 < embed.std() < 2
    a, b = (raw_bytes(loaded[f"layers.{i}.attn.wq_a.weight"]) for i in (0, 1))
    assert not torch.equal(a, b)
    codes = raw_bytes(loaded["layers.0.ffn.experts.0.w1.weight"])
    assert codes.unique().numel() > 100  # packed FP4 pairs, not a constant fill
    tid2eid = loaded["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.min() >= 0 and tid2eid.max() < 8
    assert all(len(set(row)) == len(row) == 2 for row in tid2eid.tolist())  # k distinct experts per token


def test_tiny_config_json_has_the_official_keys(tiny):
    folder, config = tiny
    raw = json.loads((folder / "config.json").read_text())
    assert set(raw) == set(json.loads(V4_FLASH.read_text()))
    assert raw["vocab_size"] == 512 and raw["quantization_config"]["quant_method"] == "fp8"
    assert load_config(folder) == config.replace(name=folder.name)  # inference/config.json agrees


def test_tiny_index_covers_every_tensor_over_several_shards(tiny, expected):
    folder, _ = tiny
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == set(expected)
    files = set(weight_map.values())
    assert len(files) >= 2
    n = len(files)
    assert files == {f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)}
    for file in files:
        with safe_open(folder / file, "pt") as f:
            assert set(f.keys()) == {k for k, v in weight_map.items() if v == file}
    total = sum(t.numel() * t.element_size() for t in expected.values())
    assert index["metadata"]["total_size"] == total
    assert (folder / "inference" / "config.json").is_file()


def test_tiny_inference_config_has_the_reference_keys(tiny):
    folder, _ = tiny
    ref = json.loads((folder / "inference" / "config.json").read_text())
    official_ref = json.loads((DATA / "dsv4_flash_inference_config.json").read_text())
    assert set(ref) == set(official_ref)
    assert ref["dtype"] == "fp8" and ref["n_layers"] == 6 and ref["vocab_size"] == 512


def test_tiny_default_structure(tiny):
    _, config = tiny
    assert [config.layer_kind(i) for i in range(config.n_layers)] == ["swa", "swa", "csa", "hca", "csa", "hca"]
    assert config.n_hash_layers == 2 and config.n_routed_experts == 8 and config.n_mtp_layers == 1


# ---- the plain (BF16) twin ------------------------------------------------------------------------


def test_plain_twin_holds_the_dequantised_weights(tiny, expected, plain_loaded):
    _, quant_config = tiny
    want = dequantize_tensors(expected, quant_config)
    got = plain_loaded
    assert set(got) == set(want)
    assert not any(name.endswith(".scale") for name in got)
    for name, t in want.items():
        assert_same_tensor(got[name], t, name)
    # the quantised weights really were expanded, not copied
    assert got["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert got["layers.0.ffn.experts.0.w1.weight"].shape == (128, 128)
    assert {t.dtype for t in got.values()} == {torch.bfloat16, torch.float32, torch.int64}


def test_plain_twin_config_has_no_quantization(plain):
    folder, config = plain
    raw = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in raw
    assert config.quant is None
    assert json.loads((folder / "inference" / "config.json").read_text())["dtype"] == "bf16"
    assert load_config(folder).quant is None


def test_plain_checkpoint_stored_as_float32_still_loads(plain, plain_loaded, tmp_path):
    folder = copy_of(plain[0], tmp_path)
    config = plain[1]
    before = plain_loaded
    for file in set(read_weight_map(folder).values()):
        tensors = load_file(folder / file)
        save_file({k: v.float() if v.dtype == torch.bfloat16 else v for k, v in tensors.items()}, folder / file)
    with safe_open(folder / read_weight_map(folder)["embed.weight"], "pt") as f:
        assert f.get_slice("embed.weight").get_dtype() == "F32"
    after = load_tensors(folder, config)
    assert set(after) == set(before)
    for name, t in before.items():
        want = t.float() if t.dtype == torch.bfloat16 else t
        assert_same_tensor(after[name], want, name)


# ---- corrupted checkpoints ------------------------------------------------------------------------


def test_tensor_removed_is_reported_missing(tiny, tmp_path):
    folder, config = copy_of(tiny[0], tmp_path), tiny[1]
    name = "layers.2.attn.indexer.compressor.ape"
    rewrite_shard_of(folder, name, lambda t: t.pop(name))
    write_weight_map(folder, {k: v for k, v in read_weight_map(folder).items() if k != name})
    message = checkpoint_error(folder, config)
    assert "missing 1" in message and name in message


def test_tensor_absent_from_its_shard_is_named(tiny, tmp_path):
    folder, config = copy_of(tiny[0], tmp_path), tiny[1]
    name = "layers.4.ffn.gate.bias"
    file = rewrite_shard_of(folder, name, lambda t: t.pop(name))
    message = checkpoint_error(folder, config)
    assert name in message and file in message


def test_extra_tensor_is_reported_unexpected(tiny, tmp_path):
    folder, config = copy_of(tiny[0], tmp_path), tiny[1]
    extra = "layers.0.attn.compressor.ape"  # plausible name, but layer 0 is window-only
    file = rewrite_shard_of(folder, "layers.0.attn_norm.weight", lambda t: t.update({extra: torch.zeros(4, 256)}))
    write_weight_map(folder, read_weight_map(folder) | {extra: file})
    message = checkpoint_error(folder, config)
    assert "unexpected 1" in message and extra in message and "missing" not in message


def test_many_missing_tensors_are_counted(tiny, tmp_path):
    folder, config = copy_of(tiny[0], tmp_path), tiny[1]
    weight_map = read_weight_map(folder)
    gone = [n for n in weight_map if n.startswith("layers.5.ffn.experts.")]
    write_weight_map(folder, {k: v for k, v in weight_map.items() if k not in gone})
    message = checkpoint_error(folder, config)
    assert f"missing {len(gone)}" in message and "\n" not in message
    assert sorted(gone)[0] in message


def test_fp8_weight_saved_as_bf16_is_named_with_both_dtypes(tiny, tmp_path):
    folder, config = copy_of(tiny[0], tmp_path), tiny[1]
    name = "layers.2.attn.wq_b.weight"

    def to_bf16(tensors):
        tensors[name] = tensors[name].to(torch.bfloat16)

    rewrite_shard_of(folder, name, to_bf16)
    message = checkpoint_error(folder, config)
    assert name in message and "BF16" in message and "F8_E4M3" in message


def test_fp4_expert_saved_unpacked_is_named(tiny, tmp_path):
    folder, config = copy_of(tiny[0], tmp_path), tiny[1]
    name = "layers.3.ffn.experts.5.w3.weight"

    def unpack(tensors):
        tensors[name] = torch.zeros(128, 128, dtype=torch.bfloat16)

    rewrite_shard_of(folder, name, unpack)
    message = checkpoint_error(folder, config)
    assert name in message and "I8[128, 64]" in message


def test_wrong_shape_is_named_with_both_shapes(tiny, tmp_path):
    folder, config = copy_of(tiny[0], tmp_path), tiny[1]
    name = "layers.1.attn.attn_sink"

    def grow(tensors):
        tensors[name] = torch.zeros(5)

    rewrite_shard_of(folder, name, grow)
    message = checkpoint_error(folder, config)
    assert name in message and "[5]" in message and "[4]" in message


def test_deleted_shard_is_named(tiny, tmp_path):
    folder, config = copy_of(tiny[0], tmp_path), tiny[1]
    file = read_weight_map(folder)["layers.3.attn_norm.weight"]
    (folder / file).unlink()
    message = checkpoint_error(folder, config)
    assert file in message


def test_folder_without_weights(tiny, tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    shutil.copy(tiny[0] / "config.json", folder / "config.json")
    assert "model.safetensors" in checkpoint_error(folder, tiny[1])


def test_checkpoint_of_another_config_does_not_load(tiny):
    folder, config = tiny
    other = parse_config(tiny_config_dict("v4", SMALL_VOCAB | {"num_hash_layers": 1}))
    message = checkpoint_error(folder, other)
    assert "layers.1.ffn.gate.bias" in message and "layers.1.ffn.gate.tid2eid" in message


# ---- single-file checkpoints ----------------------------------------------------------------------


def test_single_file_checkpoint_loads(tiny, expected, tmp_path):
    folder = tmp_path / "single"
    folder.mkdir()
    shutil.copy(tiny[0] / "config.json", folder / "config.json")
    save_file({k: v.contiguous() for k, v in expected.items()}, folder / "model.safetensors")
    got = load_tensors(folder, tiny[1])
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert_same_tensor(got[name], want, name)


def test_single_file_checkpoint_with_extra_tensor_fails(tiny, expected, tmp_path):
    folder = tmp_path / "single"
    folder.mkdir()
    tensors = dict(expected) | {"layers.9.attn_norm.weight": torch.ones(128, dtype=torch.bfloat16)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    assert "layers.9.attn_norm.weight" in checkpoint_error(folder, tiny[1])


def test_a_shard_cut_short_is_named_in_the_error(tiny, tmp_path):
    folder = tmp_path / "cut"
    shutil.copytree(tiny[0], folder)
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])  # a download that stopped 100 bytes early
    message = checkpoint_error(folder, tiny[1])
    assert message.startswith(f"shard {shard.name} cannot be read (") and "damaged or incomplete" in message


# ---- tensor parallelism ---------------------------------------------------------------------------

# The split points of DeepSeek's converter, written out independently of the library's rules.
DIM0_SUFFIXES = (
    ".attn.wq_b.weight", ".attn.wq_b.scale", ".attn.wo_a.weight", ".attn.wo_a.scale", ".attn.attn_sink",
    ".indexer.wq_b.weight", ".indexer.wq_b.scale", ".indexer.weights_proj.weight",
)
DIM1_SUFFIXES = (".attn.wo_b.weight", ".attn.wo_b.scale")
EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")


def split_dim(name: str) -> int | None:
    if name in ("embed.weight", "head.weight") or name.endswith(DIM0_SUFFIXES):
        return 0
    if name.endswith(DIM1_SUFFIXES):
        return 1
    return None


@pytest.fixture(scope="module")
def ranks(tiny):
    folder, config = tiny
    return [load_tensors(folder, config, rank=r, world=2) for r in range(2)]


def test_tp2_split_tensors_concatenate_to_the_full_tensor(loaded, ranks):
    split = [n for n in loaded if split_dim(n) is not None]
    assert any(n.endswith(".indexer.wq_b.scale") for n in split) and any(n.endswith("wo_b.scale") for n in split)
    for name in split:
        dim = split_dim(name)
        halves = [r[name] for r in ranks]
        assert halves[0].shape[dim] * 2 == loaded[name].shape[dim], name
        assert halves[0].shape == halves[1].shape, name
        whole = torch.cat([raw_bytes(h) if h.dtype in FP8_DTYPES else h for h in halves], dim=dim)
        full = loaded[name]
        assert torch.equal(whole, raw_bytes(full) if full.dtype in FP8_DTYPES else full), name


def test_tp2_replicated_tensors_are_identical_on_both_ranks(loaded, ranks):
    replicated = [n for n in loaded if split_dim(n) is None and not EXPERT.search(n)]
    assert "layers.0.ffn.gate.tid2eid" in replicated and "layers.2.attn.compressor.wkv.weight" in replicated
    assert "layers.0.ffn.shared_experts.w2.scale" in replicated and "mtp.0.e_proj.weight" in replicated
    for name in replicated:
        for r in ranks:
            assert_same_tensor(r[name], loaded[name], name)


def test_tp2_routed_experts_are_split_into_contiguous_ranges(tiny, loaded, ranks):
    _, config = tiny
    assert config.n_routed_experts == 8
    for rank, mine in enumerate(([0, 1, 2, 3], [4, 5, 6, 7])):
        held = {int(m.group(1)) for n in ranks[rank] if (m := EXPERT.search(n))}
        assert held == set(mine)
        for name in loaded:
            if (m := EXPERT.search(name)) and int(m.group(1)) in mine:
                assert_same_tensor(ranks[rank][name], loaded[name], name)
    experts_of = [{n for n in r if EXPERT.search(n)} for r in ranks]
    assert not experts_of[0] & experts_of[1]
    assert experts_of[0] | experts_of[1] == {n for n in loaded if EXPERT.search(n)}


def test_tp2_ranks_hold_nothing_else(loaded, ranks):
    non_expert = {n for n in loaded if not EXPERT.search(n)}
    for r in ranks:
        assert {n for n in r if not EXPERT.search(n)} == non_expert


def test_tp_world_3_is_rejected(tiny):
    folder, config = tiny
    with pytest.raises(CheckpointError) as info:
        check_tp(config, 3)
    message = str(info.value)
    assert "3" in message and "num_attention_heads" in message and "n_routed_experts" in message
    with pytest.raises(CheckpointError):
        load_tensors(folder, config, rank=0, world=3)


def test_tp_world_4_is_rejected_on_tiny_default(tiny):
    _, config = tiny  # 4 heads, 2 output groups of rank 128: wo_a has 64 rows per rank at TP 4
    with pytest.raises(CheckpointError) as info:
        check_tp(config, 4)
    message = str(info.value)
    assert "wo_a rows per rank (64)" in message and "128" in message and "o_groups" in message


def test_tp2_fits_tiny_default(tiny):
    check_tp(tiny[1], 2)


def test_rank_outside_world_is_rejected(tiny):
    folder, config = tiny
    with pytest.raises(ValueError):
        load_tensors(folder, config, rank=2, world=2)


@needs_official
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_v4_flash_fits_tensor_parallel(world):
    check_tp(official(), world)
    check_tp(official(V4_FLASH_0731), world)


@needs_official
def test_v4_flash_does_not_fit_tp16():
    with pytest.raises(CheckpointError, match="o_groups=8"):
        check_tp(official(), 16)
