"""The worker's look-ahead (the GPU path's: each sampled token is fed before the step is reported,
so the next step is computed while the report travels): what the clients receive and every
conversation snapshot are exactly what they are without it — through decode, the first token of a
prompt, an EOS and a length finish with their closing snapshots, a cancelled request, and a new
request joining mid-way. The scheduler drives a real worker over the tiny reference model."""

from __future__ import annotations

import pytest

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


def serve(model, lookahead: bool) -> tuple[list[list], dict[str, bytes], int]:
    """Run the requests to the end: each one's events (tokens with logprobs, the finish), the
    snapshots made, and how many steps fed a token the worker had fed ahead."""
    eos = model.config.eos_token_id
    worker = Worker(model, NUM, "rev", lookahead=lookahead)
    sched = Scheduler(max_batch=4, max_waiting=8, prefill_budget=24, eos_token_id=eos)
    reqs = requests(eos)
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
    return events, dict(worker.snapshots), found_ahead


def test_looking_ahead_changes_nothing_the_clients_or_the_caches_see(model) -> None:
    plain, plain_snapshots, _ = serve(model, lookahead=False)
    ahead, ahead_snapshots, found = serve(model, lookahead=True)
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
    assert 1 in worker.ahead and worker.ahead[1][0] == done.outputs[0].choice.token
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
