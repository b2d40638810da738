"""The V4.1 reference path keeps V4's state contract: prefill in one piece, prefill in chunks of any
size and token-by-token decode give the same logits bit for bit in both numerics modes; a state
written to bytes and read back continues exactly; batches change nothing; snapshots cost what
model.md §5 says per token; the CLI makes, runs and generates with V4.1 checkpoints.

The sequences cross every window (8, 5), ratio-2 group and candidate-block boundary and are longer
than the candidate budget (top blocks × block size entries) and than top-k × ratio, so both
indexer levels really select."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dsuf.cli import greedy, run_logits
from dsuf.kvcache.snapshot import Named, restore_state, snapshot_state
from dsuf.model import load_model
from dsuf.model.config import load_any_config, parse_v41_config
from dsuf.model.layers import Numerics
from dsuf.model.state import V41_COMPRESSED_KV, V41_INDEX_KEYS, V41_WINDOW_KV, SequenceState, StateError
from dsuf.model.v41 import V41Model

EXACT = Numerics("exact", torch.float32)
REFERENCE = Numerics("reference", torch.bfloat16)
MODES = pytest.mark.parametrize("num", [EXACT, REFERENCE], ids=["exact", "reference"])
T = 41


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def models(tiny_v41):
    cache: dict[str, V41Model] = {}

    def get(name: str = "default") -> V41Model:
        if name not in cache:
            cache[name] = load_model(tiny_v41(name))
        return cache[name]

    return get


def tokens(n: int = T, seed: int = 11) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["default", "seed2", "variant"])
@MODES
def test_prefill_chunked_prefill_and_decode_agree_exactly(models, name, num):
    model = models(name)
    c = model.config
    budget = c.csa2.candidate_topk_blocks * c.csa2.candidate_block_size
    assert T > budget and T // 2 > c.index_topk and T > 2 * c.window_size  # both indexer levels select
    seq = tokens(seed=len(name))
    prefill = run_logits(model, seq, "prefill", 0, num)
    assert prefill.shape == (T, 512) and torch.isfinite(prefill).all()
    for mode, chunk in (("chunked", 3), ("chunked", 7), ("decode", 1)):
        got = run_logits(model, seq, mode, chunk, num)
        assert torch.equal(got, prefill), f"{name} {num.mode} {mode}({chunk}): rel err {float((got - prefill).norm() / prefill.norm()):.2e}"


def test_reference_numerics_stay_near_exact_while_really_quantising(models):
    """FP8 activations and FP8/FP4 caches cost a few percent on a tiny random model, no more."""
    model, seq = models(), tokens(12)
    exact = run_logits(model, seq, "prefill", 0, EXACT)
    ref = run_logits(model, seq, "prefill", 0, REFERENCE)
    err = float((ref - exact).norm() / exact.norm())
    assert 1e-3 < err < 0.1, err


@MODES
@pytest.mark.parametrize("split", [1, 2, 9, 13, 30])  # inside a group, at a ratio-2 boundary, past the window, mid-block
def test_a_restored_state_continues_exactly_like_the_original(models, num, split):
    model, seq = models(), tokens()
    original = model.new_state(num)
    model.forward(seq[:split], original, num)
    restored = SequenceState.from_bytes(model.config, original.to_bytes())
    assert restored.pos == split and restored.packed == (num.mode == "reference")
    a, b = original.named_tensors(), restored.named_tensors()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(model.forward(seq[split:], restored, num), model.forward(seq[split:], original, num))


def test_state_holds_the_four_kinds_of_v41_memory(models):
    model = models()
    c = model.config
    state = model.new_state(REFERENCE)
    model.forward(tokens(37), state, REFERENCE)
    named = state.named_tensors()
    for i in range(c.n_layers):
        assert named[f"layers.{i}.window"].shape == (c.window_size, V41_WINDOW_KV.row_bytes(c.head_dim))
    # only the KV sources (1: ratio 2, 3: ratio 1) keep compressed entries and index keys
    assert {n.split(".")[1] for n in named if n.endswith("compressed")} == {"1", "3"}
    assert named["layers.1.compressed"].shape == (18, V41_COMPRESSED_KV.row_bytes(c.head_dim))
    assert named["layers.3.compressed"].shape == (37, V41_COMPRESSED_KV.row_bytes(c.head_dim))
    assert named["layers.1.index_keys"].shape == (18, V41_INDEX_KEYS.row_bytes(c.index_head_dim))
    assert named["layers.1.compressor.kv"].shape == (2, c.head_dim) and "layers.3.compressor.kv" not in named
    assert named["engram.history"].tolist() == model.hasher.token_map[tokens(37)[-3:]].tolist()
    assert all(t.dtype == torch.uint8 for n, t in named.items() if n.endswith(("window", "compressed", "index_keys")))


def test_snapshot_bytes_per_token_are_the_packed_formats(models):
    """Each ratio-2 source adds (288 + 68)/2-style rows every other token, the ratio-1 source every
    token; the tiny widths are 128 (72 + 68 bytes per row)."""
    model = models()
    c = model.config
    sizes = {}
    for n in (20, 40):
        state = model.new_state(REFERENCE)
        model.forward(tokens(n), state, REFERENCE)
        sizes[n] = len(state.to_bytes())
    row = V41_COMPRESSED_KV.row_bytes(c.head_dim) + V41_INDEX_KEYS.row_bytes(c.index_head_dim)
    assert row == 72 + 68
    per_token = sum(row / c.compress_ratios[s] for s in c.csa2.kv_source_layers)
    assert (sizes[40] - sizes[20]) / 20 == per_token == 210


def test_released_v41_snapshots_cost_890_bytes_per_token():
    """model.md §5: 890 B/token (layers 2, 8, 14 at ratio 2 and 20 at ratio 1, 288 + 68 B each)
    and 40 windows of 128 × 528 B; 10,000 tokens hold 8,900,000 + 2,703,360 bytes."""
    path = "/work/shared/data/dsv41_flash_config.json"
    if not os.path.isfile(path):
        pytest.skip("official configs not in /work/shared/data")
    c = parse_v41_config(json.loads(Path(path).read_text()))

    def state_after(n: int) -> SequenceState:
        state = SequenceState.new(c, torch.bfloat16, packed=True)
        for s in c.csa2.kv_source_layers:
            layer = state.layers[s]
            entries = n // c.compress_ratios[s]
            layer.compressed = torch.zeros(entries, layer.compressed.shape[1], dtype=torch.uint8)
            layer.index_keys = torch.zeros(entries, layer.index_keys.shape[1], dtype=torch.uint8)
        state.pos = n
        return state

    empty, full = state_after(0), state_after(10_000)
    assert (full.nbytes() - empty.nbytes()) / 10_000 == 890
    assert len(full.to_bytes()) - full.nbytes() < 4096  # the rest of a snapshot is its tensor table
    windows = sum(t.numel() for name, t in empty.named_tensors().items() if name.endswith("window"))
    assert windows == 40 * 128 * 528 == 2_703_360
    partial = sum(t.numel() * t.element_size() for name, t in empty.named_tensors().items() if ".compressor." in name or name.startswith("engram"))
    assert full.nbytes() - partial == 8_900_000 + 2_703_360
    assert partial < 32 << 10  # the partial groups and the Engram history: a few KB


def test_conversation_cache_snapshots_carry_v41_states(models):
    """The worker's snapshot path (kvcache.snapshot) takes V4.1 states unchanged."""
    model, seq = models(), tokens(15)
    state = model.new_state(REFERENCE)
    model.forward(seq, state, REFERENCE)
    blob = snapshot_state(state, model.config.name, "rev", Named("ab" * 16, 15))
    restored = restore_state(model.config, blob, model_id=model.config.name, revision="rev", tokens=Named("ab" * 16, 15))
    nxt = torch.tensor([7])
    assert torch.equal(model.forward(nxt, restored, REFERENCE), model.forward(nxt, state, REFERENCE))


def test_states_fit_only_the_numerics_and_model_they_were_made_for(models):
    model = models()
    with pytest.raises(ValueError, match="packed"):
        model.forward(tokens(3), model.new_state(Numerics("reference", torch.float32)), Numerics("exact", torch.float32))
    with pytest.raises(ValueError, match="bfloat16"):
        model.forward(tokens(3), model.new_state(REFERENCE), EXACT)
    state = model.new_state(REFERENCE)
    model.forward(tokens(5), state, REFERENCE)
    with pytest.raises(StateError):
        SequenceState.from_bytes(models("variant").config, state.to_bytes())  # other layers and windows


def test_a_batch_of_sequences_gets_the_logits_each_would_get_alone(models):
    model = models()
    seqs = [tokens(n, seed=s) for n, s in ((9, 1), (1, 2), (23, 3))]
    for num in (EXACT, REFERENCE):
        alone = []
        for seq in seqs:
            state = model.new_state(num)
            model.forward(seq[:5], state, num)
            alone.append(model.forward(seq[5:] if seq.shape[0] > 5 else seq[-1:], state, num, last_only=True))
        states = [model.new_state(num) for _ in seqs]
        model.forward_batch([(seq[:5], st) for seq, st in zip(seqs, states)], num)
        together = model.forward_batch([(seq[5:] if seq.shape[0] > 5 else seq[-1:], st) for seq, st in zip(seqs, states)], num)
        assert all(torch.equal(a, b) for a, b in zip(alone, together))


def test_the_model_interface_the_worker_uses(models):
    model = models()
    c = model.config
    assert c.family == "v41" and c.vocab_size == 512 and c.eos_token_id == 1 and c.name == "default"
    out = greedy(model, tokens(6), 5, REFERENCE)
    assert 1 <= len(out) <= 5 and all(0 <= t < 512 for t in out)
    assert {k.split(".")[1] for k in model.dspark if k.startswith("mtp.")} == {"0", "1", "2"}
    assert "aligner.w1.weight" in model.vision and "vision.blocks.0.attn.wqkv.weight" in model.vision


def test_load_model_needs_the_tokenizer(tiny_v41, tmp_path):
    import shutil

    folder = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_v41("default"), folder)
    (folder / "tokenizer.json").unlink()
    assert load_any_config(folder).family == "v41"
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(folder)


# ---- the command line -----------------------------------------------------------------------------


def dsuf(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "dsuf", *args], capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_cli_makes_runs_and_generates_with_a_v41_checkpoint_and_its_tokenizer(tmp_path):
    """Full vocabulary, so a prompt rendered by deepseek-recipe's V4.1 encoding (thinking on and
    off) with the written tokenizer runs through `dsuf logits` and `dsuf generate`."""
    import deepseek_recipe as dr

    ckpt = tmp_path / "v41"
    proc = dsuf("make-tiny", "--family", "v41", "--out", str(ckpt), "--seed", "3")
    assert "['swa', 'full', 'reuse', 'full', 'reindex', 'reuse']" in proc.stdout
    assert (ckpt / "tokenizer.json").is_file() and (ckpt / "inference" / "config.json").is_file()
    encoding = dr.DeepseekV41Encoding().with_tokenizer(dr.Tokenizer.from_file(str(ckpt / "tokenizer.json")))
    prompts = {}
    for thinking in (True, False):
        conversation = dr.Conversation([dr.SystemMessage("Be brief."), dr.UserMessage("Hi")], thinking_mode=thinking)
        prompts[thinking] = encoding.encode(conversation)
    assert prompts[True][1] == 128798 and prompts[True][-1] == 128821 and prompts[False][-1] == 128822  # <｜System｜>, <think>, </think>
    ids = ",".join(map(str, prompts[False]))
    dsuf("logits", "--ckpt", str(ckpt), "--tokens", ids, "--mode", "chunked", "--chunk", "5", "--out", str(tmp_path / "l.npy"))
    logits = np.load(tmp_path / "l.npy")
    assert logits.shape == (len(prompts[False]), 129280) and np.isfinite(logits).all()
    generated = [int(t) for t in dsuf("generate", "--ckpt", str(ckpt), "--tokens", ids, "--max-new", "4").stdout.strip().split(",")]
    assert 1 <= len(generated) <= 4 and generated[0] == int(logits[-1].argmax())
