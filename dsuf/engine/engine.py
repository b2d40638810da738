"""The front end's engine: spawns and supervises the workers, and drives the step loop.

One worker per GPU (one on the CPU path), each with its own pair of rings. One step is in flight
at a time: the loop asks the scheduler for a plan, sends it down every worker's ring, and the
workers' `StepDone`s (delivered by the event loop's reader on the doorbell fds, never by polling)
complete it; the first worker's (the tensor-parallel leader's) carries the tokens and snapshots.

A worker that exits fails every in-flight request with a 503 at once (nothing waits forever) and
the engine reports not ready. Once the workers have loaded, they are all started again after any
failure (tensor-parallel ranks cannot go on without each other), reloads that fail included, after
a back-off that grows with repeated crashes; serving resumes with the conversation caches intact:
they live in the front end's arena. If the first load fails, nothing is restarted (a bad
checkpoint or a cache that cannot fit would fail again): `load_failed` is set, and `dsuf serve`
exits with the cause.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsuf.engine.scheduler import QueueFull, Request, Scheduler
from dsuf.ipc.messages import Fatal, FromWorker, Ready, Shutdown, StepDone, ToWorker
from dsuf.ipc.ring import Channel, Doorbell, Ring

if TYPE_CHECKING:
    from dsuf.kvcache.cache import ConversationCache

log = logging.getLogger("dsuf.engine")

RESTART_WINDOW = 600.0  # seconds: crashes closer together than this double the next restart's delay
RESTART_DELAY_MAX = 60.0


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
    gpus: tuple[int, ...] = ()  # CUDA devices, one worker (tensor-parallel rank) each; none: the CPU reference path
    random_weights: str | None = None  # GPU path: a config.json whose shapes get random weights
    max_context: int = 0  # GPU path: tokens a sequence may hold (its caches are preallocated)
    speculative: bool = False  # MTP drafts verified with the next token
    step_timeout: float = 0.0  # seconds a step may run before its workers count as stuck (0: no limit)


class WorkerGone(Exception):
    pass


@dataclass
class WorkerProcess:
    """One worker: its rings (to it, from it), their doorbells, and the process."""

    rings: tuple[Ring, Ring]
    bells: tuple[Doorbell, Doorbell]
    to: Channel = field(init=False)
    back: Channel = field(init=False)
    proc: asyncio.subprocess.Process | None = None

    def __post_init__(self) -> None:
        self.to = Channel(self.rings[0], self.bells[0], ToWorker)
        self.back = Channel(self.rings[1], self.bells[1], FromWorker)

    @staticmethod
    def create() -> WorkerProcess:
        return WorkerProcess((Ring.create(), Ring.create()), (Doorbell.create(), Doorbell.create()))

    def ring_args(self) -> list[str]:
        return ["--inbox", self.rings[0].name, "--inbox-fd", str(self.bells[0].fd), "--outbox", self.rings[1].name, "--outbox-fd", str(self.bells[1].fd)]

    def close(self) -> None:
        for ring in self.rings:
            ring.close()
            ring.unlink()
        for bell in self.bells:
            bell.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ready = asyncio.Event()
        self.info: Ready | None = None
        self.scheduler: Scheduler | None = None
        self.failure: str | None = None  # why the engine can never serve (the workers could not load)
        self.load_failed = asyncio.Event()  # set with `failure`, once the first load's workers have ended
        self.down: str | None = None  # why it is not serving while its workers restart
        self.restarts = 0  # worker restarts after crashes, since start
        self.on_step: Callable[[StepDone, float], None] | None = None  # (result, round-trip seconds)
        self.cache: ConversationCache | None = None  # sees each step's snapshots before the scheduler
        self._wakeup = asyncio.Event()
        self._step_done: asyncio.Future | None = None
        self._done: dict[int, StepDone] = {}  # this step's StepDone by rank
        self._readies: dict[int, Ready] = {}
        self.workers: list[WorkerProcess] = []
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._crashes: deque[float] = deque()  # when recent crashes happened (monotonic seconds)
        self._lost = False  # a worker of the current ones has died (they are all being taken down)
        self._fatal = False  # `failure` is a worker's own report of why it could not load
        self._cause: str | None = None  # why the current workers ended, where it says more than their exit code

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._loop()))
        await self._spawn()

    async def _spawn(self) -> None:
        """Start one worker per rank, each on new rings (and the ranks on a new rendezvous)."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        ranks = len(cfg.gpus) or 1
        rendezvous = f"tcp://127.0.0.1:{free_port()}" if ranks > 1 else None
        self._readies.clear()
        self._lost, self._cause = False, None
        self._tasks = [task for task in self._tasks if not task.done()]  # (earlier workers' supervisors)
        self.workers = [WorkerProcess.create() for _ in range(ranks)]
        for rank, w in enumerate(self.workers):
            w.back.attach_to_loop(loop, lambda messages, rank=rank: self._on_messages(rank, messages))
            cmd = [sys.executable, "-m", "dsuf.worker.main", "--numerics", cfg.numerics, *w.ring_args()]
            cmd += ["--ckpt", cfg.ckpt] if cfg.ckpt else ["--random-weights", str(cfg.random_weights)]
            if cfg.gpus:
                cmd += ["--gpu", str(cfg.gpus[rank]), "--max-batch", str(cfg.max_batch), "--max-context", str(cfg.max_context)]
            if rendezvous:
                cmd += ["--tp-rank", str(rank), "--tp-world", str(ranks), "--tp-init", rendezvous]
            if cfg.worker_threads:
                cmd += ["--threads", str(cfg.worker_threads)]
            if cfg.speculative:
                cmd += ["--speculative"]
            if cfg.arena:
                cmd += ["--arena", cfg.arena, "--revision", cfg.revision]
            w.proc = await asyncio.create_subprocess_exec(*cmd, pass_fds=(w.bells[0].fd, w.bells[1].fd))
            where = f"GPU {cfg.gpus[rank]}, rank {rank} of {ranks}" if cfg.gpus else "CPU"
            log.info("worker started (pid %d, %s), loading weights from %s", w.proc.pid, where, cfg.ckpt or f"random weights of {cfg.random_weights}")
            self._tasks.append(asyncio.create_task(self._supervise(w)))

    async def stop(self) -> None:
        self._stopping = True
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None:
                w.to.send(Shutdown())
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None:
                try:
                    await asyncio.wait_for(w.proc.wait(), 10)
                except (asyncio.TimeoutError, Exception):
                    w.proc.kill()
                    await w.proc.wait()
        for task in self._tasks:
            task.cancel()
        for w in self.workers:
            w.back.detach_from_loop(asyncio.get_running_loop())
            w.close()

    # ---- requests ------------------------------------------------------------------------------

    @property
    def unavailable(self) -> str:
        """Why requests cannot be served now (meaningful while `ready` is not set)."""
        return self.failure or self.down or "the model is still loading"

    def submit(self, req: Request) -> None:
        if not self.ready.is_set() or self.scheduler is None:
            raise WorkerGone(self.unavailable)
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

    def _on_messages(self, rank: int, messages: list) -> None:
        for msg in messages:
            if isinstance(msg, StepDone):
                self._done[rank] = msg
                if len(self._done) == len(self.workers) and self._step_done is not None and not self._step_done.done():
                    self._step_done.set_result(self._done[0])
            elif isinstance(msg, Ready):
                self._readies[rank] = msg
                if len(self._readies) == len(self.workers):
                    self._on_ready(self._readies[0])
            elif isinstance(msg, Fatal):  # sent when loading fails: its cause says more than the exit code
                log.error("worker %d: %s", rank, msg.message)
                if self.info is not None:  # (reloading after a crash)
                    self._cause = self._cause or msg.message
                elif self.failure is None or not self._fatal:
                    self.failure, self._fatal = msg.message, True

    def _on_ready(self, msg: Ready) -> None:
        self.info = msg
        c = self.config
        self.scheduler = Scheduler(c.max_batch, c.max_waiting, c.prefill_budget, msg.eos_token_id)
        log.info("weights loaded in %.2f s: model %s, vocab %d", msg.load_seconds, msg.model, msg.vocab_size)
        if self.down is not None:
            log.info("serving again after restart %d", self.restarts)
            self.down = None
        self.ready.set()

    async def _loop(self) -> None:
        while True:
            await self.ready.wait()
            try:
                await self._run_step()
            except WorkerGone:  # its requests have failed; the next plan comes from the next workers
                continue
            except Exception as exc:  # front end and workers no longer agree on what each sequence holds
                log.exception("the step loop failed")
                self._step_done = None  # (if one was sent, nothing awaits its result any more)
                self._take_down(f"a front-end error: {type(exc).__name__}: {exc}")

    async def _run_step(self) -> None:
        """Plan a step, send it to every worker and hand its result on (or wait for work)."""
        step = self.scheduler.plan()
        if step is None:
            self._wakeup.clear()
            await self._wakeup.wait()
            return
        if self.cache is not None:
            self.cache.expect(step)
        self._step_done, self._done = asyncio.get_running_loop().create_future(), {}
        sent = time.perf_counter()
        for w in self.workers:
            w.to.send(step)
        done = await self._await_step(step.step)
        if self.cache is not None:
            self.cache.on_step(done, self.scheduler)
        self.scheduler.on_done(done)
        if self.on_step is not None:
            self.on_step(done, time.perf_counter() - sent)

    async def _await_step(self, n: int) -> StepDone:
        """The step's result; a step that outlasts step_timeout has hung workers (a GPU fault, a
        collective that never completes): they are killed, which fails its requests and restarts them."""
        limit = self.config.step_timeout or None
        try:
            return await asyncio.wait_for(asyncio.shield(self._step_done), limit)
        except TimeoutError:
            log.error("step %d has run for %g s: the workers are stuck; killing them", n, limit)
            self._take_down(f"stuck: step {n} ran past the {limit:g} s step timeout")
            return await self._step_done  # raises WorkerGone once the supervisor has seen them end

    def _take_down(self, cause: str) -> None:
        """Kill the current workers; their supervisors then fail the requests and restart them."""
        self._cause = self._cause or cause
        self.ready.clear()
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None:
                w.proc.kill()

    async def _supervise(self, w: WorkerProcess) -> None:
        code = await w.proc.wait()
        if self._stopping and code == 0:
            log.info("worker %d stopped", w.proc.pid)
            return
        cause = self._cause or (f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")
        log.error("worker %d ended: %s", w.proc.pid, cause)
        if w not in self.workers or self._lost or self._stopping:  # a rank taken down with another one
            return
        self._lost = True
        self._take_down(cause)  # tensor-parallel ranks cannot go on without it
        if self.scheduler is not None:
            self.scheduler.fail_all(503, f"the model workers stopped ({cause}); retry shortly")
        if self._step_done is not None and not self._step_done.done():
            self._step_done.set_exception(WorkerGone(cause))
        if self.cache is not None:
            self.cache.worker_lost()
        if self.info is None:  # the first load failed: loading again would fail again
            self.failure = self.failure or f"the worker process died while loading ({cause})"
            self.load_failed.set()
            return
        now = time.monotonic()
        self._crashes.append(now)
        while now - self._crashes[0] > RESTART_WINDOW:
            self._crashes.popleft()
        delay = min(RESTART_DELAY_MAX, 2.0 ** (len(self._crashes) - 1))
        self.down = f"the model workers stopped ({cause}); restarting"
        log.warning("restarting the workers in %.0f s", delay)
        self._tasks.append(asyncio.create_task(self._restart(delay)))

    async def _restart(self, delay: float) -> None:
        old = self.workers
        await asyncio.gather(*(w.proc.wait() for w in old if w.proc is not None))  # their GPU memory is free
        await asyncio.sleep(delay)
        loop = asyncio.get_running_loop()
        for w in old:
            w.back.detach_from_loop(loop)
            w.close()
        self.restarts += 1
        await self._spawn()


__all__ = ["Engine", "EngineConfig", "QueueFull", "WorkerGone"]
