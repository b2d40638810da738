"""The NextN MTP layer's forward (used by speculative decoding) and V4-Flash-0731's DSpark heads."""

from __future__ import annotations

import pytest
import torch

from dsuf.cli import run_logits
from dsuf.model import load_model
from dsuf.model.checkpoint import DSPARK_STAGES
from dsuf.model.layers import Numerics

EXACT = Numerics("exact", torch.float32)


def tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(23))


def mtp_logits(model, seq: torch.Tensor, step: int, num: Numerics) -> torch.Tensor:
    """Draft logits for positions 0..T-2 (each predicts the token two ahead), fed `step` at a time."""
    state = model.new_state(num)
    out = []
    for i in range(0, seq.shape[0] - 1, step):
        j = min(i + step, seq.shape[0] - 1)
        _, streams = model.forward(seq[i:j], state, num, return_streams=True)
        out.append(model.mtp_forward(streams, seq[i + 1 : j + 1], i, state, num))
    return torch.cat(out)


@pytest.mark.parametrize("num", [EXACT, Numerics("reference", torch.bfloat16)], ids=["exact", "reference"])
def test_mtp_gives_the_same_drafts_in_prefill_chunks_and_decode(tiny_dir, num):
    model = load_model(tiny_dir("default"))
    seq = tokens(30)
    prefill = mtp_logits(model, seq, 30, num)
    assert prefill.shape == (29, 512)
    for step in (4, 1):
        got = mtp_logits(model, seq, step, num)
        assert float((got - prefill).norm() / prefill.norm()) < 1e-5


def test_mtp_drafts_depend_on_the_next_token_and_differ_from_the_main_head(tiny_dir):
    model = load_model(tiny_dir("default"))
    seq = tokens(12)
    state = model.new_state(EXACT)
    logits, streams = model.forward(seq, state, EXACT, return_streams=True)
    a = model.mtp_forward(streams, seq.roll(-1), 0, model.new_state(EXACT), EXACT)
    b = model.mtp_forward(streams, (seq.roll(-1) + 1) % 512, 0, model.new_state(EXACT), EXACT)
    assert not torch.allclose(a, b)
    assert not torch.allclose(a, logits)


def test_v4_0731_checkpoint_with_dspark_stages_loads_and_runs(tmp_path):
    from dsuf.model.tiny import make_tiny

    config = make_tiny(tmp_path / "v4-0731", family="v4-0731", seed=3, overrides={"vocab_size": 512})
    assert config.dspark is not None and config.dspark.target_layer_ids == (3, 4, 5)
    model = load_model(tmp_path / "v4-0731")
    assert model.mtp == []  # no NextN layer: the DSpark stages are checked and kept for speculative decoding
    assert {f"mtp.{s}.attn.wq_a.weight" for s in range(DSPARK_STAGES)} <= model.dspark.keys()
    assert "mtp.0.main_proj.weight" in model.dspark
    assert model.dspark[f"mtp.{DSPARK_STAGES - 1}.markov_head.head.weight"].shape == (512, 16)
    logits = run_logits(model, tokens(9), "prefill", 0, EXACT)
    assert logits.shape == (9, 512) and torch.isfinite(logits).all()
