"""Continuous batching: which sequences run in the next step, with which tokens.

Pure bookkeeping, no I/O, so it is tested on its own. Every step decodes a token for each
running sequence that has one pending (two, where the worker's speculative draft was accepted:
then it has fed the first already), and spends a token budget on prompt chunks: first for
prompts already being prefilled, then for waiting requests admitted into the running set (up to
`max_batch`). Long prompts therefore advance a chunk per step instead of stalling the decodes.

Conversation caches: a request may start from a cached prefix (`cached` tokens, restored by the
worker from the arena with its first work) and names the prompt positions where the worker
snapshots its state (`snapshots`; chunks end exactly there). When a completion ends by EOS or by
length and `hasher` is set, the request stays one more step "closing": the worker feeds the tokens
the next turn's prompt will repeat (the unfed last token, then EOS) and snapshots the state after
them, so the next turn finds the whole previous turn cached.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from dsuf.ipc.messages import Restore, SeqWork, SnapshotWrite, Step, StepDone
from dsuf.kvcache.snapshot import PrefixHasher
from dsuf.worker.sampling import SamplingParams, TokenChoice


class QueueFull(Exception):
    """The waiting queue is at its bound; the client should retry later (HTTP 429)."""


@dataclass(frozen=True)
class TokenEvent:
    choice: TokenChoice


@dataclass(frozen=True)
class FinishEvent:
    reason: Literal["stop", "length"]


@dataclass(frozen=True)
class ErrorEvent:
    status: int
    message: str


Event = TokenEvent | FinishEvent | ErrorEvent
_ids = itertools.count(1)


@dataclass(eq=False)
class Request:
    """One generation: the prompt, how to sample, and where its events go."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    id: int = field(default_factory=lambda: next(_ids))
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    prefilled: int = 0  # prompt tokens the worker has consumed
    generated: int = 0  # tokens sampled so far
    pending: int | None = None  # the last sampled token, to be fed in the next step
    in_flight: bool = False
    done: bool = False
    started: bool = False  # the worker has this sequence (its first work was sent)
    # Conversation cache; without one these stay empty and nothing above changes.
    cached: int = 0  # prompt tokens restored from a snapshot (usage: prompt_cache_hit_tokens)
    restore: Restore | None = None  # sent with the first work
    pin: ExitStack | None = None  # holds the snapshot's store lease until the worker has read it
    snapshots: dict[int, str] = field(default_factory=dict)  # prompt length -> chain key to snapshot at
    hasher: PrefixHasher | None = None  # fed the prompt: names prompt + completion for the closing snapshot
    conversation: str | None = None  # the client's conversation id (prompt_cache_key / X-Conversation-Id)
    output: list[int] = field(default_factory=list)  # sampled tokens (to name the closing snapshot)
    closing: list[int] | None = None  # finished: the tokens the closing snapshot adds
    closing_fed: int = 0  # how many of them the worker has fed already (speculative decoding)

    def __post_init__(self) -> None:
        # A seed chosen here, not in each worker: the ranks of a tensor-parallel model all sample
        # (to look ahead) and must draw the same tokens.
        if self.params.seed is None:
            self.params = msgspec.structs.replace(self.params, seed=secrets.randbits(63))

    def use_cached(self, cached: int, restore: Restore, pin: ExitStack) -> None:
        """Start from a snapshot of the first `cached` prompt tokens."""
        self.cached = self.prefilled = cached
        self.restore, self.pin = restore, pin

    def forget_cached(self) -> None:
        """The snapshot was refused: prefill the whole prompt after all."""
        self.cached = self.prefilled = 0
        self.restore, self.started = None, False
        self.unpin()

    def unpin(self) -> None:
        if self.pin is not None:
            self.pin.close()
            self.pin = None

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)


class Scheduler:
    def __init__(self, max_batch: int, max_waiting: int, prefill_budget: int, eos_token_id: int) -> None:
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.prefill_budget = prefill_budget
        self.eos = eos_token_id
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.release: list[int] = []
        self.writes: list[SnapshotWrite] = []  # filled by the engine, sent with the next step
        self._steps = itertools.count(1)

    def add(self, req: Request) -> None:
        """Queue a request: it waits for the next step's free batch slots, and beyond those up to
        max_waiting requests wait for slots to free (a burst into an idle server fills the batch
        before anything counts as waiting)."""
        free = max(0, self.max_batch - len(self.running))
        if len(self.waiting) >= free + self.max_waiting:
            raise QueueFull(f"{len(self.waiting) - free} requests are already waiting")
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Stop a request now (client gone, stop string seen): its slot is free for the next step.
        A closing request (already finished) keeps its slot until its snapshot step is done."""
        if req.done:
            return
        req.done = True
        req.unpin()
        if req in self.waiting:
            self.waiting.remove(req)
        elif self.running.pop(req.id, None) is not None:
            self.release.append(req.id)

    def fail_all(self, status: int, message: str) -> None:
        for req in [*self.waiting, *self.running.values()]:
            req.done = True
            req.unpin()
            req.events.put_nowait(ErrorEvent(status, message))
        self.waiting.clear()
        self.running.clear()
        self.release.clear()
        self.writes.clear()

    def plan(self) -> Step | None:
        work: list[SeqWork] = []
        for req in self.running.values():
            if req.pending is not None:
                work.append(SeqWork(req.id, [req.pending], sample=True))
                req.pending, req.in_flight = None, True
            elif req.closing and not req.in_flight:
                req.hasher.update(req.output + req.closing)
                work.append(SeqWork(req.id, req.closing[req.closing_fed :], sample=False, snapshot=req.hasher.key()))
                req.in_flight = True
        budget = self.prefill_budget
        for req in list(self.running.values()):
            if budget and req.prefilling and not req.in_flight:
                budget -= self._prefill_chunk(req, budget, work)
        while budget and self.waiting and len(self.running) < self.max_batch:
            req = self.waiting.popleft()
            self.running[req.id] = req
            budget -= self._prefill_chunk(req, budget, work)
        if not work and not self.release and not self.writes:
            return None
        release, self.release = self.release, []
        writes, self.writes = self.writes, []
        return Step(next(self._steps), work, release, writes)

    def _prefill_chunk(self, req: Request, budget: int, work: list[SeqWork]) -> int:
        end = min(len(req.prompt), req.prefilled + budget)
        stop = min((n for n in req.snapshots if req.prefilled < n <= end), default=end)
        chunk = req.prompt[req.prefilled : stop]
        first = not req.started
        req.prefilled, req.started = stop, True
        work.append(
            SeqWork(
                req.id, chunk, sample=not req.prefilling,
                params=req.params if first else None, restore=req.restore if first else None,
                snapshot=req.snapshots.get(stop),
            )
        )
        req.in_flight = True
        return len(chunk)

    def on_done(self, done: StepDone) -> None:
        """Deliver the step's tokens and decide which requests are finished."""
        for out in done.outputs:
            req = self.running.get(out.seq)
            if req is None:  # finished while the step ran; its release is already queued
                continue
            req.in_flight = False
            req.unpin()  # the worker has read its snapshot (or failed to)
            if out.cache_miss:
                req.forget_cached()
                continue
            if out.error is not None:
                self.running.pop(req.id)
                req.done = True
                if req.closing is None:
                    req.events.put_nowait(ErrorEvent(500, f"generation failed: {out.error}"))
                continue
            if req.closing is not None:  # its closing snapshot is made: the slot is free
                self.running.pop(req.id)
                self.release.append(req.id)
                continue
            if out.choice is not None:
                self._deliver(req, [out.choice, *out.more])

    def _deliver(self, req: Request, chosen: list[TokenChoice]) -> None:
        """A step's tokens for one request, in order; the worker has fed all but the last."""
        for i, choice in enumerate(chosen):
            token, fed = choice.token, int(i < len(chosen) - 1)
            req.generated += 1
            if token == self.eos:
                self._complete(req, "stop", [token], fed)
                return
            req.events.put_nowait(TokenEvent(choice))
            if req.generated >= req.max_tokens:
                self._complete(req, "length", [token, self.eos], fed)
                return
            req.output.append(token)
        req.pending = chosen[-1].token

    def _complete(self, req: Request, reason: Literal["stop", "length"], tail: list[int], fed: int = 0) -> None:
        """Finish `req`; tail: the tokens its closing snapshot adds, of which the first `fed` are fed."""
        req.events.put_nowait(FinishEvent(reason))
        if req.hasher is None:
            self.finish(req)
            return
        req.done, req.closing, req.closing_fed = True, tail, fed  # the client is answered; the state lives one step on
