"""The engine between the front end and a real worker process: a failure on the front end's side of
a step (a bug in its bookkeeping) must not hang the server. The step's requests fail, and the
workers, whose sequences the front end no longer knows, are restarted; then serving goes on."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_server import cache_home, embedded_ckpt  # noqa: E402, F401

from dsuf.engine.engine import Engine, EngineConfig  # noqa: E402
from dsuf.engine.scheduler import ErrorEvent, FinishEvent, Request, Scheduler, TokenEvent  # noqa: E402
from dsuf.worker.sampling import SamplingParams  # noqa: E402


async def answer(req: Request) -> list:
    events = []
    while not events or not isinstance(events[-1], (FinishEvent, ErrorEvent)):
        events.append(await asyncio.wait_for(req.events.get(), 60))
    return events


def test_an_error_in_the_front_ends_step_bookkeeping_fails_the_step_and_restarts_the_workers(embedded_ckpt, monkeypatch):
    async def main() -> None:
        engine = Engine(EngineConfig(str(embedded_ckpt), worker_threads=1))
        await engine.start()
        try:
            await asyncio.wait_for(engine.ready.wait(), 120)
            broken, on_done = engine.scheduler, Scheduler.on_done

            def failing_once(self: Scheduler, done) -> None:
                if self is broken:
                    raise RuntimeError("bookkeeping bug")
                on_done(self, done)

            monkeypatch.setattr(Scheduler, "on_done", failing_once)
            req = Request([0, 5, 6, 7], SamplingParams(temperature=0.0), 4)
            engine.submit(req)
            (failed,) = await answer(req)
            assert isinstance(failed, ErrorEvent) and failed.status == 503
            assert "a front-end error: RuntimeError: bookkeeping bug" in failed.message

            await asyncio.wait_for(engine.ready.wait(), 120)  # new workers, a new scheduler
            assert engine.restarts == 1 and engine.scheduler is not broken
            again = Request([0, 5, 6, 7], SamplingParams(temperature=0.0), 4)
            engine.submit(again)
            events = await answer(again)
            assert [type(e) for e in events] == [TokenEvent] * 4 + [FinishEvent] and events[-1].reason == "length"
        finally:
            await engine.stop()

    asyncio.run(main())
