"""Continuous batching: which sequences run in the next step, with which tokens.

Pure bookkeeping, no I/O, so it is tested on its own. Every step decodes one token for each
running sequence that has one pending, and spends a token budget on prompt chunks: first for
prompts already being prefilled, then for waiting requests admitted into the running set (up to
`max_batch`). Long prompts therefore advance a chunk per step instead of stalling the decodes.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from dsuf.ipc.messages import SeqWork, Step, StepDone
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
        self._steps = itertools.count(1)

    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Stop a request now (client gone, stop string seen): its slot is free for the next step."""
        if req.done:
            return
        req.done = True
        if req in self.waiting:
            self.waiting.remove(req)
        elif self.running.pop(req.id, None) is not None:
            self.release.append(req.id)

    def fail_all(self, status: int, message: str) -> None:
        for req in [*self.waiting, *self.running.values()]:
            req.done = True
            req.events.put_nowait(ErrorEvent(status, message))
        self.waiting.clear()
        self.running.clear()
        self.release.clear()

    def plan(self) -> Step | None:
        work: list[SeqWork] = []
        for req in self.running.values():
            if req.pending is not None:
                work.append(SeqWork(req.id, [req.pending], sample=True))
                req.pending, req.in_flight = None, True
        budget = self.prefill_budget
        for req in list(self.running.values()):
            if budget and req.prefilling and not req.in_flight:
                budget -= self._prefill_chunk(req, budget, work)
        while budget and self.waiting and len(self.running) < self.max_batch:
            req = self.waiting.popleft()
            self.running[req.id] = req
            budget -= self._prefill_chunk(req, budget, work)
        if not work and not self.release:
            return None
        release, self.release = self.release, []
        return Step(next(self._steps), work, release)

    def _prefill_chunk(self, req: Request, budget: int, work: list[SeqWork]) -> int:
        chunk = req.prompt[req.prefilled : req.prefilled + budget]
        first = req.prefilled == 0
        req.prefilled += len(chunk)
        work.append(SeqWork(req.id, chunk, sample=not req.prefilling, params=req.params if first else None))
        req.in_flight = True
        return len(chunk)

    def on_done(self, done: StepDone) -> None:
        """Deliver the step's tokens and decide which requests are finished."""
        for out in done.outputs:
            req = self.running.get(out.seq)
            if req is None:  # finished while the step ran; its release is already queued
                continue
            req.in_flight = False
            if out.error is not None:
                self.running.pop(req.id)
                req.done = True
                req.events.put_nowait(ErrorEvent(500, f"generation failed: {out.error}"))
                continue
            if out.choice is None:
                continue
            token = out.choice.token
            req.generated += 1
            if token == self.eos:
                self._complete(req, "stop")
                continue
            req.events.put_nowait(TokenEvent(out.choice))
            if req.generated >= req.max_tokens:
                self._complete(req, "length")
            else:
                req.pending = token

    def _complete(self, req: Request, reason: Literal["stop", "length"]) -> None:
        self.finish(req)
        req.events.put_nowait(FinishEvent(reason))
