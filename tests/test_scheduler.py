"""Continuous batching bookkeeping: admission, chunked prefill, decode, finishing, cancellation."""

from __future__ import annotations

import pytest

from dsuf.engine.scheduler import ErrorEvent, FinishEvent, QueueFull, Request, Scheduler, TokenEvent
from dsuf.ipc.messages import SeqOutput, StepDone
from dsuf.worker.sampling import SamplingParams, TokenChoice

EOS = 1


pytestmark = pytest.mark.usefixtures("event_loop_for_queues")  # requests put their events on asyncio queues


def request(prompt_len: int = 5, max_tokens: int = 10) -> Request:
    return Request(list(range(10, 10 + prompt_len)), SamplingParams(temperature=0.0), max_tokens)


def answer(step, tokens: dict[int, int]) -> StepDone:
    """The worker's reply: the given token for each sequence that asked to sample."""
    outs = [SeqOutput(w.seq, TokenChoice(tokens.get(w.seq, 7), -0.5) if w.sample else None) for w in step.work]
    return StepDone(step.step, outs, 0.0)


def events(req: Request) -> list:
    out = []
    while not req.events.empty():
        out.append(req.events.get_nowait())
    return out


def test_waiting_queue_is_bounded_beyond_the_free_batch_slots():
    """max_waiting counts the requests that cannot run at the next step: a burst into an idle
    server of batch 2 and max_waiting 2 takes four, and once two run, two more may wait."""
    s = Scheduler(max_batch=2, max_waiting=2, prefill_budget=100, eos_token_id=EOS)
    for _ in range(4):
        s.add(request())
    with pytest.raises(QueueFull, match="2 requests are already waiting"):
        s.add(request())
    s.plan()  # two run now
    assert len(s.running) == 2 and len(s.waiting) == 2
    with pytest.raises(QueueFull):
        s.add(request())


def test_admission_stops_at_max_batch_and_resumes_when_a_slot_frees():
    s = Scheduler(max_batch=2, max_waiting=10, prefill_budget=100, eos_token_id=EOS)
    reqs = [request() for _ in range(3)]
    for r in reqs:
        s.add(r)
    step = s.plan()
    assert [w.seq for w in step.work] == [reqs[0].id, reqs[1].id]
    assert all(w.params is not None and w.sample for w in step.work)  # first work carries the params
    s.on_done(answer(step, {}))
    s.finish(reqs[0])
    step = s.plan()
    assert step.release == [reqs[0].id]
    assert {w.seq for w in step.work} == {reqs[1].id, reqs[2].id}


def test_long_prompts_prefill_in_chunks_without_stalling_decodes():
    s = Scheduler(max_batch=4, max_waiting=10, prefill_budget=256, eos_token_id=EOS)
    short, long = request(4), request(600)
    s.add(short)
    s.on_done(answer(s.plan(), {}))  # short prompt prefilled, first token pending
    s.add(long)
    chunks = []
    for _ in range(3):
        step = s.plan()
        by_seq = {w.seq: w for w in step.work}
        assert by_seq[short.id].tokens == [7] and by_seq[short.id].sample  # the decode goes on every step
        chunks.append(len(by_seq[long.id].tokens))
        assert by_seq[long.id].sample == (sum(chunks) == 600)
        s.on_done(answer(step, {}))
    assert chunks == [256, 256, 88]  # the prefill budget is for prompt tokens; decodes come on top


def test_tokens_flow_to_the_request_until_eos_or_max_tokens():
    s = Scheduler(max_batch=4, max_waiting=10, prefill_budget=100, eos_token_id=EOS)
    a, b = request(max_tokens=3), request(max_tokens=10)
    s.add(a)
    s.add(b)
    for tokens in ({a.id: 5, b.id: 6}, {a.id: 5, b.id: EOS}, {a.id: 5}):
        s.on_done(answer(s.plan(), tokens))
    assert [type(e) for e in events(a)] == [TokenEvent, TokenEvent, TokenEvent, FinishEvent]
    got_b = events(b)
    assert [type(e) for e in got_b] == [TokenEvent, FinishEvent] and got_b[-1].reason == "stop"  # EOS is not a token
    step = s.plan()
    assert step is not None and not step.work and step.release == [a.id]  # b was released a step earlier
    assert s.plan() is None


def test_a_failed_sequence_gets_an_error_and_the_others_continue():
    s = Scheduler(max_batch=4, max_waiting=10, prefill_budget=100, eos_token_id=EOS)
    a, b = request(), request()
    s.add(a)
    s.add(b)
    step = s.plan()
    s.on_done(StepDone(step.step, [SeqOutput(a.id, error="boom"), SeqOutput(b.id, TokenChoice(9, -1.0))], 0.0))
    assert isinstance(events(a)[0], ErrorEvent)
    assert [w.seq for w in s.plan().work] == [b.id]


def test_fail_all_ends_every_request_with_503():
    s = Scheduler(max_batch=1, max_waiting=10, prefill_budget=100, eos_token_id=EOS)
    a, b = request(), request()
    s.add(a)
    s.add(b)
    s.plan()
    s.fail_all(503, "worker died")
    for r in (a, b):
        (e,) = events(r)
        assert isinstance(e, ErrorEvent) and e.status == 503
    assert not s.running and not s.waiting


# ---- conversation caches ------------------------------------------------------------------------


def cached_request(prompt_len: int = 10, max_tokens: int = 10) -> Request:
    """A request as the conversation cache leaves it: snapshot points named, the prompt hashed."""
    from dsuf.kvcache.snapshot import PrefixHasher

    req = request(prompt_len, max_tokens)
    req.hasher = PrefixHasher("m")
    keys = req.hasher.keys_at(req.prompt, [prompt_len - 1, prompt_len])
    req.snapshots = {n: keys[n] for n in keys}
    return req


def test_prefill_chunks_end_at_the_snapshot_points_and_name_them():
    s = Scheduler(max_batch=4, max_waiting=4, prefill_budget=100, eos_token_id=EOS)
    req = cached_request(10)
    s.add(req)
    step = s.plan()
    (work,) = step.work
    assert len(work.tokens) == 9 and work.snapshot == req.snapshots[9] and not work.sample
    s.on_done(answer(step, {}))
    (work,) = s.plan().work
    assert work.tokens == req.prompt[9:] and work.snapshot == req.snapshots[10] and work.sample
    assert work.params is None  # only the first work carries the sampling parameters


def test_a_cached_prefix_is_restored_with_the_first_work_and_only_the_rest_is_prefilled():
    from contextlib import ExitStack

    from dsuf.ipc.messages import Restore

    s = Scheduler(max_batch=4, max_waiting=4, prefill_budget=100, eos_token_id=EOS)
    req = request(12)
    pin = ExitStack()
    released = []
    pin.callback(lambda: released.append(True))
    req.use_cached(7, Restore(offset=0, size=100, key="k", tokens=7), pin)
    s.add(req)
    step = s.plan()
    (work,) = step.work
    assert work.tokens == req.prompt[7:] and work.restore.tokens == 7 and work.params is not None
    assert not released  # the snapshot stays pinned until the worker has read it
    s.on_done(answer(step, {}))
    assert released == [True]


def test_a_refused_snapshot_means_prefilling_the_whole_prompt():
    from contextlib import ExitStack

    from dsuf.ipc.messages import Restore

    s = Scheduler(max_batch=4, max_waiting=4, prefill_budget=100, eos_token_id=EOS)
    req = request(12)
    req.use_cached(7, Restore(offset=0, size=100, key="k", tokens=7), ExitStack())
    s.add(req)
    step = s.plan()
    s.on_done(StepDone(step.step, [SeqOutput(req.id, error="cached prefix refused", cache_miss=True)], 0.0))
    assert events(req) == [] and req.cached == 0
    (work,) = s.plan().work
    assert work.tokens == req.prompt and work.restore is None and work.params is not None


def test_a_finished_answer_feeds_its_eos_for_the_closing_snapshot_then_frees_the_slot():
    from dsuf.kvcache.snapshot import chain_key

    s = Scheduler(max_batch=4, max_waiting=4, prefill_budget=100, eos_token_id=EOS)
    req = cached_request(4, max_tokens=10)
    s.add(req)
    for tokens in ({}, {req.id: 21}, {req.id: 22}, {req.id: EOS}):  # 2 prompt chunks sampling 21, then 22, EOS
        step = s.plan()
        s.on_done(answer(step, tokens))
    assert [type(e) for e in events(req)][-1] is FinishEvent  # the client has its answer now
    s.finish(req)  # ... and goes away: the state must live one more step
    step = s.plan()
    (work,) = step.work
    assert work.tokens == [EOS] and not work.sample
    assert work.snapshot == chain_key("m", req.prompt + [21, 22, EOS])  # what the next turn's prompt repeats
    s.on_done(answer(step, {}))
    assert req.id not in s.running and s.plan().release == [req.id]


def test_an_answer_cut_by_length_feeds_its_last_token_and_eos():
    s = Scheduler(max_batch=4, max_waiting=4, prefill_budget=100, eos_token_id=EOS)
    req = cached_request(4, max_tokens=1)
    s.add(req)
    for _ in range(2):
        s.on_done(answer(s.plan(), {req.id: 30}))
    (work,) = s.plan().work
    assert work.tokens == [30, EOS] and work.snapshot is not None


def two(step, seq: int, first: int, second: int) -> StepDone:
    """The worker's reply when a draft was accepted: two tokens, the first already fed."""
    outs = [SeqOutput(w.seq, TokenChoice(first, -0.5), more=[TokenChoice(second, -0.6)]) if w.seq == seq else
            SeqOutput(w.seq, TokenChoice(7, -0.5) if w.sample else None) for w in step.work]
    return StepDone(step.step, outs, 0.0)


def test_a_step_of_two_tokens_delivers_both_and_feeds_only_the_second():
    """Speculative decoding: of a step's tokens the worker has fed all but the last."""
    s = Scheduler(max_batch=4, max_waiting=4, prefill_budget=100, eos_token_id=EOS)
    req = request(max_tokens=10)
    s.add(req)
    s.on_done(two(s.plan(), req.id, 21, 22))  # the prompt, then two tokens
    assert [e.choice.token for e in events(req)] == [21, 22] and req.generated == 2
    (work,) = s.plan().work
    assert work.tokens == [22] and work.sample


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_an_answer_ending_on_a_fed_token_does_not_feed_it_again_for_the_closing_snapshot(finish):
    """EOS (or the length limit) reached on the first of two tokens: that token is in the worker's
    state already, so the closing feed adds only what is missing (nothing, or EOS); the token
    after it is dropped."""
    from dsuf.kvcache.snapshot import chain_key

    s = Scheduler(max_batch=4, max_waiting=4, prefill_budget=100, eos_token_id=EOS)
    req = cached_request(4, max_tokens=2 if finish == "length" else 10)
    s.add(req)
    s.on_done(answer(s.plan(), {}))  # the first prompt chunk
    s.on_done(answer(s.plan(), {req.id: 21}))
    s.on_done(two(s.plan(), req.id, EOS if finish == "stop" else 22, 23))
    got = events(req)
    assert got[-1] == FinishEvent(finish) and [e.choice.token for e in got[:-1]] == ([21] if finish == "stop" else [21, 22])
    (work,) = s.plan().work
    assert work.tokens == ([] if finish == "stop" else [EOS]) and not work.sample
    assert work.snapshot == chain_key("m", req.prompt + [21] + ([EOS] if finish == "stop" else [22, EOS]))
