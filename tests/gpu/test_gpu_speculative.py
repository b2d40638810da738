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
            nexts = tokens[lo + 1 : hi + 1]  # a decode step's token chosen on the device (not read), a chunk's from the host
            got.append(gpu.mtp_forward(streams[lo:hi].to(torch.bfloat16), nexts if rows_a_call == 1 else nexts.cpu(), lo, seq).clone())
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


def test_a_look_ahead_verifies_as_the_host_does_and_is_retracted_without_a_trace(models):
    """verify_batch(ahead=True) (the worker's look-ahead: the token and its draft still on the
    device) computes bit for bit what the same rows from the host do, and its retract forgets
    both rows: the sequence's state is again, bit for bit, what it was before, also where either
    row completes a CSA group. No retract where the token's row completes the HCA group."""
    c, gpu, _, device = models
    tokens = torch.randint(0, c.vocab_size, (PROMPT + DECODE + 1,))
    seq, same = gpu.new_state(), gpu.new_state()
    try:
        for s in (seq, same):
            gpu.forward_batch([(tokens[:PROMPT], s)])
        retracted = 0
        for i in range(PROMPT, PROMPT + DECODE):
            draft = (int(tokens[i]) + 1) % c.vocab_size
            before = state_tensors(gpu.export_state(seq))
            (v,) = gpu.verify_batch([(tokens[i : i + 1].to(device), seq, torch.tensor([draft], device=device))], ahead=True)
            (w,) = gpu.verify_batch([(tokens[i : i + 1], same, draft)])
            assert (v.undo is None) == (w.undo is None) == (i + 1 == 127) and (v.retract is None) == (i == 127)
            assert torch.equal(v.logits, w.logits) and torch.equal(v.streams, w.streams[-v.streams.shape[0] :]) and seq.pos == same.pos
            if i % 4 and v.retract is not None:  # taken back whole, then fed again as the host feeds it
                gpu.take_back(seq, v.retract)
                assert seq.pos == i and all(torch.equal(a, b) for a, b in zip(state_tensors(gpu.export_state(seq)), before))
                (v,) = gpu.verify_batch([(tokens[i : i + 1], seq, draft)])
                retracted += 1
            for s, u in ((seq, v.undo), (same, w.undo)):
                if u is not None:
                    gpu.take_back(s, u)
            assert all(torch.equal(a, b) for a, b in zip(state_tensors(gpu.export_state(seq)), state_tensors(gpu.export_state(same))))
        assert retracted == sum(i % 4 != 0 and i != 127 for i in range(PROMPT, PROMPT + DECODE))  # rows completing a group: neither, the token's, the draft's
    finally:
        for s in (seq, same):
            gpu.free(s)


def test_the_worker_looking_ahead_decodes_as_without_looking_ahead(models, monkeypatch):
    """The worker's speculative step with the look-ahead (the next verify step queued before the
    tokens are read) against without: the same tokens every step, and the same closing snapshot,
    where the look-ahead's rows are taken back. Drafts from an oracle that knows a previous run's
    tokens (accepted while the runs agree, as drafts are on real weights) and from the MTP layer
    (random weights: rejected)."""
    from dsuf.ipc.messages import SeqWork, Step
    from dsuf.worker.main import Worker
    from dsuf.worker.sampling import SamplingParams

    c, gpu, _, device = models
    prompt = torch.randint(0, c.vocab_size, (40,)).tolist()

    def run(lookahead: bool) -> tuple[list[list[int]], bytes]:
        worker = Worker(gpu, NUM, "rev", speculative=True, lookahead=lookahead)
        work = SeqWork(1, prompt, sample=True, params=SamplingParams(temperature=0.8, seed=7))
        steps = []
        try:
            for step in range(1, 26):
                (out,) = worker.run_step(Step(step, [work])).outputs
                assert out.error is None
                steps.append([ch.token for ch in (out.choice, *out.more)])
                work = SeqWork(1, steps[-1][-1:], sample=True)
            (done,) = worker.run_step(Step(99, [SeqWork(1, [], sample=False, snapshot="c1" * 16)])).outputs  # finished on its last token
            assert done.error is None
            return steps, worker.snapshots["c1" * 16]
        finally:
            worker.run_step(Step(100, [], release=[1]))

    first, _ = run(False)
    answer = prompt + [t for chosen in first for t in chosen]
    real = gpu.mtp_forward

    def oracle(streams, next_tokens, start, seq, num=None):
        logits = real(streams, next_tokens, start, seq, num).clone()  # the MTP layer's state advances as it would
        at = start + next_tokens.shape[0] + 1  # the drafted token's position
        logits[-1] = 0
        logits[-1, answer[at] if at < len(answer) else 0] = 1
        return logits

    for drafts in ("oracle", "mtp"):
        if drafts == "oracle":
            monkeypatch.setattr(gpu, "mtp_forward", oracle)
        plain, ahead = run(False), run(True)
        assert ahead == plain
        accepted = sum(len(chosen) - 1 for chosen in plain[0])
        print(f"\n  {drafts} drafts: {accepted} accepted in {len(plain[0])} steps, the same with the look-ahead")
        assert (accepted > 5) == (drafts == "oracle")
        monkeypatch.undo()


def test_no_draft_is_fed_where_the_context_has_no_room(models):
    c, gpu, _, _ = models
    seq = gpu.new_state()
    try:
        gpu.forward_batch([(torch.randint(0, c.vocab_size, (gpu.max_context - 1,)), seq)])
        (v,) = gpu.verify_batch([(torch.tensor([5]), seq, 7)])
        assert v.logits.shape[0] == 1 and v.undo is None and seq.pos == gpu.max_context
    finally:
        gpu.free(seq)
