"""The worker's look-ahead (the GPU path's: each sampled token is fed before the step is reported,
so the next step is computed while the report travels) and its speculative decoding (MTP drafts,
verified with the next token, two tokens a step where accepted): what the clients receive and
every conversation snapshot are exactly what they are without them — through decode, the first
token of a prompt, an EOS and a length finish with their closing snapshots, a cancelled request,
and a new request joining mid-way. The scheduler drives a real worker over the tiny reference
model."""

from __future__ import annotations

import pytest
import torch

from dsuf.engine.scheduler import FinishEvent, Request, Scheduler, TokenEvent
from dsuf.kvcache.snapshot import PrefixHasher
from dsuf.model import load_model
from dsuf.model.layers import Numerics
from dsuf.worker.main import Worker
from dsuf.worker.sampling import SamplingParams

NUM = Numerics()


pytestmark = pytest.mark.usefixtures("event_loop_for_queues")  # requests put their events on asyncio queues


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir())


def requests(eos: int) -> list[Request]:
    """Greedy and seeded sampling; an EOS finish (forced) and a length finish, both with closing
    snapshots; one that is cancelled; one that arrives later (the last)."""
    out = [
        Request(list(range(3, 40)), SamplingParams(temperature=0.0), 9),
        Request(list(range(50, 55)), SamplingParams(temperature=0.8, top_p=0.9, seed=11), 12),
        Request(list(range(60, 81)), SamplingParams(temperature=1.0, seed=5, forced=[7, 8, eos]), 20),
        Request(list(range(90, 100)), SamplingParams(temperature=0.7, seed=3), 15),
        Request(list(range(100, 130)), SamplingParams(temperature=0.0), 6),
    ]
    for req in (out[0], out[2]):
        req.hasher = PrefixHasher("tiny")
        req.hasher.update(req.prompt)
    return out


def serve(model, seen: dict | None = None, **worker_options) -> tuple[list[list], dict[str, bytes], int, int]:
    """Run the requests to the end: each one's events (tokens with logprobs, the finish), the
    snapshots made, how many works fed a token the worker had fed ahead, and the steps. `seen`
    receives the worker and the requests."""
    eos = model.config.eos_token_id
    worker = Worker(model, NUM, "rev", **worker_options)
    sched = Scheduler(max_batch=4, max_waiting=8, prefill_budget=24, eos_token_id=eos)
    reqs = requests(eos)
    if seen is not None:
        seen.update(worker=worker, requests={req.id: req for req in reqs})
    for req in reqs[:-1]:
        sched.add(req)
    found_ahead, steps = 0, 0
    while (step := sched.plan()) is not None:
        found_ahead += sum(w.seq in worker.ahead for w in step.work)
        sched.on_done(worker.run_step(step))
        steps += 1
        if steps == 4:
            sched.add(reqs[-1])
        if reqs[3].generated == 5:
            sched.finish(reqs[3])  # the client went away
    events = []
    for req in reqs:
        got = []
        while not req.events.empty():
            e = req.events.get_nowait()
            got.append((e.choice.token, e.choice.logprob) if isinstance(e, TokenEvent) else e)
        events.append(got)
    return events, dict(worker.snapshots), found_ahead, steps


def test_looking_ahead_changes_nothing_the_clients_or_the_caches_see(model) -> None:
    plain, plain_snapshots, _, _ = serve(model)
    ahead, ahead_snapshots, found, _ = serve(model, lookahead=True)
    assert ahead == plain
    assert ahead_snapshots == plain_snapshots and len(plain_snapshots) == 2  # the two closing snapshots
    finishes = [e[-1] for e in plain]
    assert finishes[0] == FinishEvent("length") and finishes[2] == FinishEvent("stop") and finishes[4] == FinishEvent("length")
    assert len(plain[3]) == 5  # cancelled after five tokens
    assert found > 20  # most steps found their tokens fed ahead


def test_a_released_sequence_drops_its_token_fed_ahead(model) -> None:
    """A sequence that ends (released by the front end) takes its look-ahead with it."""
    from dsuf.ipc.messages import SeqWork, Step

    worker = Worker(model, NUM, "rev", lookahead=True)
    params = SamplingParams(temperature=0.0)
    done = worker.run_step(Step(1, [SeqWork(1, list(range(3, 12)), sample=True, params=params)]))
    assert 1 in worker.ahead and worker.ahead[1].token == done.outputs[0].choice.token
    worker.run_step(Step(2, [], release=[1]))
    assert not worker.ahead and not worker.states


def test_a_step_that_does_not_feed_the_token_sampled_fails_only_that_sequence(model) -> None:
    from dsuf.ipc.messages import SeqWork, Step

    worker = Worker(model, NUM, "rev", lookahead=True)
    params = SamplingParams(temperature=0.0)
    first = worker.run_step(Step(1, [SeqWork(1, [3, 4, 5], sample=True, params=params), SeqWork(2, [6, 7], sample=True, params=params)]))
    wrong = (first.outputs[0].choice.token + 1) % model.config.vocab_size
    right = first.outputs[1].choice.token
    out = worker.run_step(Step(2, [SeqWork(1, [wrong], sample=True), SeqWork(2, [right], sample=True)])).outputs
    by_seq = {o.seq: o for o in out}
    assert by_seq[1].error is not None and "look-ahead" in by_seq[1].error and 1 not in worker.states
    assert by_seq[2].error is None and by_seq[2].choice is not None


def backbone(model, blob: bytes) -> bytes:
    """A snapshot's state without the MTP layer's part (which only speculative decoding feeds)."""
    from dsuf.kvcache.snapshot import read_header
    from dsuf.model.state import SequenceState

    header = read_header(blob)
    state = SequenceState.from_bytes(model.config, bytes(blob[header.payload_offset :]))
    state.mtp = SequenceState.new(model.config, state.dtype).mtp
    return state.to_bytes()


@pytest.mark.parametrize("lookahead", [False, True], ids=["", "looking ahead"])
@pytest.mark.parametrize("drafts", ["mtp", "always right", "always wrong"])
def test_speculative_decoding_changes_nothing_the_clients_or_the_caches_see(model, monkeypatch, drafts, lookahead) -> None:
    """With the tiny model's own MTP layer (random weights: drafts mostly rejected) and with
    oracle drafts that know each request's answer (all accepted: two tokens a step, EOS and the
    length limit reached on a draft) or miss it on purpose (all rejected: the state goes back).
    Looking ahead, the next verify step (the last token and its draft) is fed before the tokens
    are read; where a request ends on the first of two tokens, its closing feed takes both
    rows back first."""
    eos = model.config.eos_token_id
    plain, plain_snapshots, _, plain_steps = serve(model)
    seen: dict = {}
    if drafts != "mtp":
        answers = [[e[0] for e in got if not isinstance(e, FinishEvent)] + [eos] for got in plain]
        real = model.mtp_forward

        def oracle(streams, next_tokens, start, state, num, depth=0):
            logits = real(streams, next_tokens, start, state, num, depth)  # the MTP state advances as it would
            seq = next(s for s, st in seen["worker"].states.items() if st is state)
            req = seen["requests"][seq]
            answer = answers[list(seen["requests"]).index(seq)]
            at = start + next_tokens.shape[0] + 1 - len(req.prompt)  # the drafted token's index in the answer
            right = answer[at] if 0 <= at < len(answer) else 0
            logits = torch.zeros_like(logits)
            logits[-1, right if drafts == "always right" else (right + 1) % logits.shape[1]] = 1.0
            return logits

        monkeypatch.setattr(model, "mtp_forward", oracle)
    taken_back = []  # rows each take_back forgets
    take_back = model.take_back
    monkeypatch.setattr(model, "take_back", lambda state, undo: taken_back.append(state.pos - undo.pos) or take_back(state, undo))
    spec, spec_snapshots, found_ahead, spec_steps = serve(model, seen, speculative=True, lookahead=lookahead)
    assert spec == plain
    assert spec_snapshots.keys() == plain_snapshots.keys() and len(plain_snapshots) == 2
    assert all(backbone(model, spec_snapshots[k]) == backbone(model, plain_snapshots[k]) for k in plain_snapshots)
    if drafts == "always right":
        assert spec_steps < plain_steps  # two tokens a step
        assert (2 in taken_back) == lookahead  # a look-ahead's two rows, after a finish on the first token of two
    if drafts == "always wrong":
        assert taken_back.count(1) > 20
    assert (found_ahead > 15) == lookahead
    print(f"\n  {drafts} drafts: {spec_steps} steps (without drafts {plain_steps}), {found_ahead} found fed ahead, rows taken back {taken_back}")
