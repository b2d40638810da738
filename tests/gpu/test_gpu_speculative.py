"""Speculative decoding on the GPU path. The MTP layer (GpuModel.draft) against the reference's
mtp_forward: the same draft logits from the same final streams and next tokens, row by row (its
window filling up) and a chunk of rows at once, within the model's own chaos (random FP8 weights:
see test_model.py). The verify step (a token and its draft in one step) and taking a rejected
draft back against decoding without drafts."""

from __future__ import annotations

import copy

import pytest
import torch
from gpu_checks import state_tensors

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
    raw = dict(V4_FLASH_CONFIG, num_hidden_layers=2, compress_ratios=[4, 128, 0], n_routed_experts=16, num_hash_layers=1,
               num_nextn_predict_layers=1)
    c = parse_config(raw, "v4-flash-2-layers-mtp")
    t = model_tensors(c, device)
    assert "mtp.0.e_proj.weight" in t
    with torch.device(device):
        ref = V4Model(c, t)
    gpu = GpuModel(c, t, device, max_batch=3, max_context=1024)
    yield c, gpu, ref, device
    del gpu, ref, t
    torch.cuda.empty_cache()


@pytest.mark.parametrize("rows_a_call", [1, 2, 37])
def test_the_mtp_layer_drafts_as_the_reference_does(models, rows_a_call):
    """Through mtp_forward, the worker's call: one and two rows replay CUDA graphs, 37 run eagerly."""
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
    try:
        for lo in range(0, streams.shape[0], rows_a_call):
            hi = min(streams.shape[0], lo + rows_a_call)
            got.append(gpu.mtp_forward(streams[lo:hi].to(torch.bfloat16), tokens[lo + 1 : hi + 1].cpu(), lo, seq).clone())
    finally:
        gpu.free(seq)
    got = torch.cat(got)
    error = rel(got, want)
    print(f"\n  MTP drafts, {rows_a_call} rows a call: rel err {error:.1e} (the reference moves {noise:.1e} when 1% of its input moves one ulp)")
    assert error <= max(2 * noise, 1e-2)
    agree = (got.argmax(-1).cpu() == want.argmax(-1).cpu()).float().mean()
    print(f"  the same draft token at {100 * float(agree):.0f} % of the rows")


PROMPT, DECODE = 120, 24  # the decode crosses CSA groups (every 4th position) and the HCA group ending at position 127


def test_an_accepted_draft_computes_what_the_same_rows_compute(models):
    """verify_batch feeds a token and its draft as two rows of one step: logits, final streams
    and the state are, bit for bit, those of feeding both tokens in one step the plain way. No
    draft where its row would complete the HCA group (position 127)."""
    c, gpu, _, _ = models
    tokens = torch.randint(0, c.vocab_size, (PROMPT + DECODE,))
    seq, same = gpu.new_state(), gpu.new_state()
    try:
        for s in (seq, same):
            gpu.forward_batch([(tokens[:PROMPT], s)])
        i, skipped = PROMPT, []
        while i < PROMPT + DECODE - 1:
            (v,) = gpu.verify_batch([(tokens[i : i + 1], seq, int(tokens[i + 1]))])
            rows = 1 if v.undo is None else 2
            if v.undo is None:  # no draft where it would complete the HCA group
                skipped.append(i + 1)
            ((want, streams),) = gpu._feed([(tokens[i : i + rows], same)], last=[rows], tail=rows)
            assert torch.equal(v.logits, want) and torch.equal(v.streams, streams)
            i += rows
        assert skipped == [127] and seq.pos == same.pos
        assert all(torch.equal(a, b) for a, b in zip(state_tensors(gpu.export_state(seq)), state_tensors(gpu.export_state(same))))
    finally:
        for s in (seq, same):
            gpu.free(s)


def test_a_rejected_draft_is_taken_back_without_a_trace(models):
    """A wrong draft every step, taken back each time, also where its row completes a CSA group
    (none where it would complete the HCA group): the sequence's cached tensors end up those of
    decoding without drafts, within the two-row step's batch variance (a compressor state row
    not put back moves them by ~1)."""
    c, gpu, _, _ = models
    tokens = torch.randint(0, c.vocab_size, (PROMPT + DECODE,))
    seq, plain = gpu.new_state(), gpu.new_state()
    try:
        errors = []
        for s in (seq, plain):
            gpu.forward_batch([(tokens[:PROMPT], s)])
        for i in range(PROMPT, PROMPT + DECODE):
            (v,) = gpu.verify_batch([(tokens[i : i + 1], seq, (int(tokens[i]) + 1) % c.vocab_size)])  # any draft: taken back whatever it is
            assert (v.undo is None) == (i + 1 == 127)  # no draft where it would complete the HCA group
            if v.undo is not None:
                gpu.take_back(seq, v.undo)
            (want,) = gpu.forward_batch([(tokens[i : i + 1], plain)])
            errors.append(rel(v.logits[0], want))
        assert seq.pos == plain.pos == PROMPT + DECODE
        cached = [rel(a.float(), b.float()) for a, b in zip(state_tensors(gpu.export_state(seq)), state_tensors(gpu.export_state(plain))) if b.numel()]
        print(f"\n  rejected drafts: cached tensors up to {max(cached):.1e} from decoding without them, logits up to {max(errors):.1e}")
        assert max(cached) < 2e-2
    finally:
        for s in (seq, plain):
            gpu.free(s)


def test_no_draft_is_fed_where_the_context_has_no_room(models):
    c, gpu, _, _ = models
    seq = gpu.new_state()
    try:
        gpu.forward_batch([(torch.randint(0, c.vocab_size, (gpu.max_context - 1,)), seq)])
        (v,) = gpu.verify_batch([(torch.tensor([5]), seq, 7)])
        assert v.logits.shape[0] == 1 and v.undo is None and seq.pos == gpu.max_context
    finally:
        gpu.free(seq)
