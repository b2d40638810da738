"""The front end's engine: spawns and supervises the worker, and drives the step loop.

One step is in flight at a time: the loop asks the scheduler for a plan, sends it down the ring,
and the worker's `StepDone` (delivered by the event loop's reader on the doorbell fd, never by
polling) completes it. A worker that exits fails every in-flight request with a 503 and the
engine reports not ready; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsuf.engine.scheduler import QueueFull, Request, Scheduler
from dsuf.ipc.messages import Fatal, FromWorker, Ready, Shutdown, StepDone, ToWorker
from dsuf.ipc.ring import Channel, Doorbell, Ring

if TYPE_CHECKING:
    from dsuf.kvcache.cache import ConversationCache

log = logging.getLogger("dsuf.engine")


@dataclass(frozen=True)
class EngineConfig:
    ckpt: str | None  # None: --random-weights on the GPU
    numerics: str = "reference"
    max_batch: int = 64
    max_waiting: int = 256
    prefill_budget: int = 256  # prompt tokens per step, shared by all prefilling requests
    worker_threads: int = 0  # 0: the worker's default
    arena: str | None = None  # shared-memory name of the snapshot arena (conversation caches)
    revision: str = ""  # the checkpoint's revision, named in every snapshot
    gpu: int | None = None  # the worker's CUDA device (the GPU path); None: the CPU reference path
    random_weights: str | None = None  # GPU path: a config.json whose shapes get random weights
    max_context: int = 0  # GPU path: tokens a sequence may hold (its caches are preallocated)


class WorkerGone(Exception):
    pass


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ready = asyncio.Event()
        self.info: Ready | None = None
        self.scheduler: Scheduler | None = None
        self.failure: str | None = None
        self.on_step: Callable[[StepDone, float], None] | None = None  # (result, round-trip seconds)
        self.cache: ConversationCache | None = None  # sees each step's snapshots before the scheduler
        self._wakeup = asyncio.Event()
        self._step_done: asyncio.Future | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._rings = (Ring.create(), Ring.create())
        self._bells = (Doorbell.create(), Doorbell.create())
        self.to_worker = Channel(self._rings[0], self._bells[0], ToWorker)
        self.from_worker = Channel(self._rings[1], self._bells[1], FromWorker)
        self.from_worker.attach_to_loop(loop, self._on_messages)
        cfg = self.config
        cmd = [
            sys.executable, "-m", "dsuf.worker.main", "--numerics", cfg.numerics,
            "--inbox", self._rings[0].name, "--inbox-fd", str(self._bells[0].fd),
            "--outbox", self._rings[1].name, "--outbox-fd", str(self._bells[1].fd),
        ]
        cmd += ["--ckpt", cfg.ckpt] if cfg.ckpt else ["--random-weights", str(cfg.random_weights)]
        if cfg.gpu is not None:
            cmd += ["--gpu", str(cfg.gpu), "--max-batch", str(cfg.max_batch), "--max-context", str(cfg.max_context)]
        if self.config.worker_threads:
            cmd += ["--threads", str(self.config.worker_threads)]
        if self.config.arena:
            cmd += ["--arena", self.config.arena, "--revision", self.config.revision]
        self._proc = await asyncio.create_subprocess_exec(*cmd, pass_fds=(self._bells[0].fd, self._bells[1].fd))
        log.info("worker started (pid %d), loading weights from %s", self._proc.pid, self.config.ckpt or f"random weights of {self.config.random_weights}")
        self._tasks = [asyncio.create_task(self._supervise()), asyncio.create_task(self._loop())]

    async def stop(self) -> None:
        self._stopping = True
        if self._proc is not None and self._proc.returncode is None:
            try:
                self.to_worker.send(Shutdown())
                await asyncio.wait_for(self._proc.wait(), 10)
            except (asyncio.TimeoutError, Exception):
                self._proc.kill()
                await self._proc.wait()
        for task in self._tasks:
            task.cancel()
        self.from_worker.detach_from_loop(asyncio.get_running_loop())
        for ring in self._rings:
            ring.close()
            ring.unlink()
        for bell in self._bells:
            bell.close()

    # ---- requests ------------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        if self.failure is not None or self.scheduler is None:
            raise WorkerGone(self.failure or "the model is still loading")
        self.scheduler.add(req)  # may raise QueueFull
        self._wakeup.set()

    def finish(self, req: Request) -> None:
        if self.scheduler is not None:
            self.scheduler.finish(req)
            self._wakeup.set()

    @property
    def running(self) -> int:
        return len(self.scheduler.running) if self.scheduler else 0

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting) if self.scheduler else 0

    # ---- internals -----------------------------------------------------------------------------

    def _on_messages(self, messages: list) -> None:
        for msg in messages:
            if isinstance(msg, StepDone):
                if self._step_done is not None and not self._step_done.done():
                    self._step_done.set_result(msg)
            elif isinstance(msg, Ready):
                self.info = msg
                c = self.config
                self.scheduler = Scheduler(c.max_batch, c.max_waiting, c.prefill_budget, msg.eos_token_id)
                log.info("weights loaded in %.2f s: model %s, vocab %d", msg.load_seconds, msg.model, msg.vocab_size)
                self.ready.set()
            elif isinstance(msg, Fatal):
                log.error("worker: %s", msg.message)
                self.failure = msg.message

    async def _loop(self) -> None:
        await self.ready.wait()
        loop = asyncio.get_running_loop()
        while self.failure is None:
            step = self.scheduler.plan()
            if step is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self.cache is not None:
                self.cache.expect(step)
            self._step_done = loop.create_future()
            sent = time.perf_counter()
            self.to_worker.send(step)
            done: StepDone = await self._step_done
            if self.cache is not None:
                self.cache.on_step(done, self.scheduler)
            self.scheduler.on_done(done)
            if self.on_step is not None:
                self.on_step(done, time.perf_counter() - sent)

    async def _supervise(self) -> None:
        code = await self._proc.wait()
        if self._stopping and code == 0:
            log.info("worker %d stopped", self._proc.pid)
            return
        cause = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        self.failure = self.failure or f"the worker process died ({cause})"
        log.error("worker %d ended: %s", self._proc.pid, cause)
        self.ready.clear()
        if self.scheduler is not None:
            self.scheduler.fail_all(503, "the model worker died; retry later")
        if self._step_done is not None and not self._step_done.done():
            self._step_done.cancel()


__all__ = ["Engine", "EngineConfig", "QueueFull", "WorkerGone"]
