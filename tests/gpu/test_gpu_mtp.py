"""The MTP layer on the GPU (GpuModel.draft) against the reference's mtp_forward: the same draft
logits from the same final streams and next tokens, row by row (its window filling up) and a
chunk of rows at once, within the model's own chaos (random FP8 weights: see test_model.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from dsuf.model.config import parse_config
from dsuf.model.layers import Numerics

NUM = Numerics()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


@pytest.fixture(scope="module")
def models():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    from dsuf.gpu.model import GpuModel
    from dsuf.gpu.weights import V4_FLASH_CONFIG, model_tensors
    from dsuf.model.v4 import V4Model

    device = torch.device("cuda")
    raw = dict(V4_FLASH_CONFIG, num_hidden_layers=2, compress_ratios=[0, 4, 0], n_routed_experts=16, num_hash_layers=1,
               num_nextn_predict_layers=1)
    c = parse_config(raw, "v4-flash-2-layers-mtp")
    t = model_tensors(c, device)
    assert "mtp.0.e_proj.weight" in t
    with torch.device(device):
        ref = V4Model(c, t)
    gpu = GpuModel(c, t, device, max_batch=2, max_context=1024)
    yield c, gpu, ref, device
    del gpu, ref, t
    torch.cuda.empty_cache()


@pytest.mark.parametrize("rows_a_call", [1, 37])
def test_the_mtp_layer_drafts_as_the_reference_does(models, rows_a_call):
    c, gpu, ref, device = models
    from dsuf.model.state import SequenceState

    tokens = torch.randint(0, c.vocab_size, (150,), device=device)  # past the MTP layer's 128-token window
    with torch.device(device):
        state = SequenceState.new(c, NUM.dtype)
        _, streams = ref.forward(tokens[:-1], state, NUM, return_streams=True)

    def reference(x: torch.Tensor) -> torch.Tensor:
        with torch.device(device):
            return ref.mtp_forward(x, tokens[1:], 0, copy.deepcopy(state), NUM)

    want = reference(streams)
    nudged = streams.clone()
    nudged.view(-1)[::100] = (nudged.view(-1)[::100].float() * (1 + 2**-7)).to(nudged.dtype)
    noise = rel(reference(nudged), want)
    seq = gpu.new_state()
    got = []
    for lo in range(0, streams.shape[0], rows_a_call):
        hi = min(streams.shape[0], lo + rows_a_call)
        pos = torch.arange(lo, hi, device=device)
        got.append(gpu.draft(streams[lo:hi].to(torch.bfloat16).contiguous(), tokens[lo + 1 : hi + 1], torch.full_like(pos, seq.slot), pos))
    gpu.free(seq)
    got = torch.cat(got)
    error = rel(got, want)
    print(f"\n  MTP drafts, {rows_a_call} rows a call: rel err {error:.1e} (the reference moves {noise:.1e} when 1% of its input moves one ulp)")
    assert error <= max(2 * noise, 1e-2)
    agree = (got.argmax(-1).cpu() == want.argmax(-1).cpu()).float().mean()
    print(f"  the same draft token at {100 * float(agree):.0f} % of the rows")


def test_a_draft_row_taken_back_leaves_no_trace(models):
    """A rejected draft at a position that completes a CSA compressor group (the case that
    rewrites more than the row's own entries) is taken back: the sequence then computes exactly
    what one that never saw the draft computes."""
    c, gpu, _, _ = models
    tokens = torch.randint(0, c.vocab_size, (44,))
    prefix, rest = tokens[:39], tokens[39:]  # the draft would sit at position 39: (39 + 1) % 4 == 0
    drafted, plain = gpu.new_state(), gpu.new_state()
    gpu.forward_batch([(prefix, drafted)])
    states = gpu.compressor_states(drafted.slot)
    gpu.forward_batch([(torch.tensor([(int(rest[0]) + 1) % c.vocab_size]), drafted)])  # the wrong draft
    gpu.take_back(drafted, 1, states)
    gpu.forward_batch([(prefix, plain)])
    for t in rest:
        a = gpu.forward_batch([(t.view(1), drafted)])[0]
        b = gpu.forward_batch([(t.view(1), plain)])[0]
        assert torch.equal(a, b)
    gpu.free(drafted)
    gpu.free(plain)
