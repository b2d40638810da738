"""The per-sequence decoding state is explicit, complete and serialisable.

A state taken after any token, written to bytes and read back, continues the sequence exactly as
the original would: that is the contract conversation caches rely on.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from dsuf.model import load_model
from dsuf.model.layers import Numerics
from dsuf.model.state import MAGIC, SequenceState, StateError

EXACT = Numerics("exact", torch.float32)
REFERENCE = Numerics("reference", torch.bfloat16)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir("default"))


def tokens(n: int, seed: int = 11) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num", [EXACT, REFERENCE], ids=["exact", "reference"])
@pytest.mark.parametrize("split", [1, 5, 8, 37])  # inside a group, at a ratio-4/8 boundary, mid-window
def test_a_restored_state_continues_exactly_like_the_original(model, num, split):
    seq = tokens(60)
    original = model.new_state(num)
    model.forward(seq[:split], original, num)
    restored = SequenceState.from_bytes(model.config, original.to_bytes())
    assert restored.pos == split
    for a, b in ((original, restored),):
        ta, tb = a.named_tensors(), b.named_tensors()
        assert ta.keys() == tb.keys()
        for name in ta:
            assert torch.equal(ta[name], tb[name]), name
    want = model.forward(seq[split:], original, num)
    got = model.forward(seq[split:], restored, num)
    assert torch.equal(got, want)


def test_state_holds_everything_the_layers_remember(model):
    c = model.config
    state = model.new_state(EXACT)
    model.forward(tokens(37), state, EXACT)
    named = state.named_tensors()
    for i in range(c.n_layers):
        assert named[f"layers.{i}.window"].shape == (c.window_size, c.head_dim)
        ratio = c.compress_ratios[i]
        if ratio:
            assert named[f"layers.{i}.compressed"].shape == (37 // ratio, c.head_dim)
            coff = 2 if ratio == 4 else 1
            assert named[f"layers.{i}.compressor.kv"].shape == (coff * ratio, coff * c.head_dim)
        if ratio == 4:
            assert named[f"layers.{i}.index_keys"].shape == (37 // 4, c.index_head_dim)
    assert named["mtp.0.window"].shape == (c.window_size, c.head_dim)


def test_states_reached_by_prefill_chunks_and_decode_are_the_same(model):
    seq = tokens(45)
    states = {}
    for mode, step in (("prefill", 45), ("chunked", 7), ("decode", 1)):
        state = model.new_state(EXACT)
        for i in range(0, 45, step):
            model.forward(seq[i : i + step], state, EXACT)
        states[mode] = state.named_tensors()
    for mode in ("chunked", "decode"):
        for name, t in states["prefill"].items():
            torch.testing.assert_close(states[mode][name], t, rtol=1e-5, atol=1e-5, msg=f"{mode} {name}")


def test_serialised_layout_is_the_documented_one(model):
    state = model.new_state(REFERENCE)
    model.forward(tokens(10), state, REFERENCE)
    data = state.to_bytes()
    assert data[:8] == MAGIC
    (n,) = struct.unpack_from("<I", data, 8)
    header = json.loads(data[12 : 12 + n])
    assert header["version"] == 1 and header["pos"] == 10
    names = [name for name, _, _ in header["tensors"]]
    assert names[0] == "layers.0.window" and "layers.2.index_keys" in names and names[-1] == "mtp.0.window"
    payload = sum(torch.Size(shape).numel() * (2 if dtype == "bfloat16" else 4) for _, dtype, shape in header["tensors"])
    assert len(data) == 12 + n + payload == 12 + n + state.nbytes()


def test_damaged_or_foreign_state_is_refused(model, tiny_dir):
    state = model.new_state(EXACT)
    model.forward(tokens(12), state, EXACT)
    data = state.to_bytes()
    with pytest.raises(StateError, match="magic"):
        SequenceState.from_bytes(model.config, b"NOTSTATE" + data[8:])
    with pytest.raises(StateError, match="truncated"):
        SequenceState.from_bytes(model.config, data[:-100])
    with pytest.raises(StateError, match="trailing"):
        SequenceState.from_bytes(model.config, data + b"\0")
    other = load_model(tiny_dir("variant")).config  # window 16 instead of 8
    with pytest.raises(StateError, match="window"):
        SequenceState.from_bytes(other, data)


def test_a_state_serves_only_the_numerics_it_was_made_for(model):
    state = model.new_state(REFERENCE)
    with pytest.raises(ValueError, match="bfloat16"):
        model.forward(tokens(3), state, EXACT)


def test_last_only_logits_are_the_last_row_of_the_full_logits(model):
    seq = tokens(13)
    full = model.forward(seq, model.new_state(REFERENCE), REFERENCE)
    last = model.forward(seq, model.new_state(REFERENCE), REFERENCE, last_only=True)
    assert last.shape == (1, full.shape[1]) and torch.equal(last[0], full[-1])


def test_a_batch_of_sequences_gets_the_logits_each_would_get_alone(model):
    """forward_batch runs the row-wise work of several sequences together; the reference path is
    batch-invariant, so prompts, chunks and decodes mixed in one call change nothing."""
    seqs = [tokens(n, seed=s) for n, s in ((9, 1), (1, 2), (17, 3))]
    for num in (EXACT, REFERENCE):
        alone = []
        for seq in seqs:
            state = model.new_state(num)
            model.forward(seq[:5], state, num)
            alone.append(model.forward(seq[5:] if seq.shape[0] > 5 else seq[-1:], state, num, last_only=True))
        states = [model.new_state(num) for _ in seqs]
        model.forward_batch([(seq[:5], st) for seq, st in zip(seqs, states)], num)
        together = model.forward_batch([(seq[5:] if seq.shape[0] > 5 else seq[-1:], st) for seq, st in zip(seqs, states)], num)
        for a, b in zip(alone, together):
            assert torch.equal(a, b)
