"""Speculative greedy decoding with the MTP layer (dsuf.model.speculative) on the reference path:
the same tokens as greedy decoding, whether drafts are accepted or rejected, and the drafts'
tally."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dsuf.cli import greedy
from dsuf.model import load_model
from dsuf.model.layers import Numerics
from dsuf.model.speculative import speculative_greedy

EXACT = Numerics("exact", torch.float32)
PROMPT = torch.tensor([5, 17, 300, 42, 9, 120, 77, 3, 250, 64, 31, 8])


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir("default"))


def assert_greedy(model, tokens: list[int], want: list[int]) -> None:
    """The tokens are greedy's; a difference is allowed only where greedy's top two logits tie to
    the last bits (feeding two rows at once or one at a time may round differently)."""
    if tokens == want:
        return
    at = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
    logits = model.forward(torch.cat((PROMPT, torch.tensor(want[:at], dtype=torch.int64))), model.new_state(EXACT), EXACT)[-1]
    top = logits.topk(2).values
    assert float(top[0] - top[1]) < 1e-5 * float(top[0].abs()), f"token {at}: {tokens[at]} against greedy's {want[at]}"


def test_mtp_drafts_give_greedy_decoding(model):
    want = greedy(model, PROMPT, 24, EXACT)
    got = speculative_greedy(model, PROMPT, 24, EXACT)
    assert_greedy(model, got.tokens, want)
    assert len(got.tokens) == len(want) and 0 < got.drafted < len(want)
    print(f"\n  MTP drafts accepted: {got.accepted} of {got.drafted} (random weights)")


@pytest.mark.parametrize("oracle", ["always right", "always wrong"])
def test_accepted_and_rejected_drafts_both_keep_greedy_tokens(model, monkeypatch, oracle):
    """Drafts from an oracle that knows greedy's answer (every draft accepted: two tokens a step)
    or gets it wrong on purpose (every draft rejected: the state is taken back each step)."""
    want = greedy(model, PROMPT, 20, EXACT)
    real = model.mtp_forward

    def drafts(streams, next_tokens, start, state, num, depth=0):
        logits = real(streams, next_tokens, start, state, num, depth)  # the MTP state advances as it would
        right = want[start + next_tokens.shape[0] + 1 - PROMPT.shape[0]] if start + next_tokens.shape[0] + 1 - PROMPT.shape[0] < len(want) else 0
        logits = torch.zeros_like(logits)
        logits[-1, right if oracle == "always right" else (right + 1) % logits.shape[1]] = 1.0
        return logits

    monkeypatch.setattr(model, "mtp_forward", drafts)
    got = speculative_greedy(model, PROMPT, 20, EXACT)
    assert_greedy(model, got.tokens, want)
    if oracle == "always right":
        assert got.accepted == got.drafted and got.drafted <= (len(want) + 1) // 2
    else:
        assert got.accepted == 0 and got.drafted == len(want) - 1


def test_generate_speculative_prints_greedy_tokens_and_the_acceptance(tiny_dir):
    ckpt = str(tiny_dir("default"))
    args = ["--ckpt", ckpt, "--tokens", ",".join(map(str, PROMPT.tolist())), "--max-new", "8", "--numerics", "exact"]
    plain = subprocess.run([sys.executable, "-m", "dsuf", "generate", *args], capture_output=True, text=True, check=True)
    spec = subprocess.run([sys.executable, "-m", "dsuf", "generate", *args, "--speculative"], capture_output=True, text=True, check=True)
    assert spec.stdout == plain.stdout
    assert "MTP drafts accepted:" in spec.stderr


def test_a_model_without_an_mtp_layer_is_refused(tmp_path):
    from dsuf.model.tiny import make_tiny

    make_tiny(tmp_path / "no-mtp", family="v4", seed=1, overrides={"vocab_size": 512, "num_nextn_predict_layers": 0})
    proc = subprocess.run([sys.executable, "-m", "dsuf", "generate", "--ckpt", str(tmp_path / "no-mtp"), "--tokens", "1,2", "--speculative"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "MTP layer" in proc.stderr and "Traceback" not in proc.stderr
