"""A worker process: holds the model and the per-sequence states, runs the steps it is told to run.

Started by the front end as `python -m dsuf.worker.main ...` with two rings (by shared-memory
name) and their doorbell fds. It loads the weights, says `Ready`, then serves `Step` messages
until `Shutdown` or until its parent disappears. One sequence failing never stops the others.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch

from dsuf.ipc.messages import Fatal, FromWorker, Ready, SeqOutput, SeqWork, Shutdown, SnapshotMade, Step, StepDone, ToWorker
from dsuf.ipc.ring import Channel, Doorbell, Ring
from dsuf.kvcache.arena import Arena
from dsuf.kvcache.snapshot import Named, SnapshotError, restore_state, snapshot_state
from dsuf.model.layers import Numerics
from dsuf.model.speculative import Drafter, Verified, check_speculation
from dsuf.model.state import SequenceState
from dsuf.worker.sampling import Draw, Sampler

log = logging.getLogger("dsuf.worker")


@dataclass
class Ahead:
    """What the worker fed a sequence ahead, queued behind the step that sampled it: the token
    (-1 until read) and what came of it, None where that feed failed: the logits after it, or
    with speculative decoding the verify rows of it and its draft (fed from position `start`)."""

    token: int
    logits: torch.Tensor | None = None
    verified: Verified | None = None
    start: int = 0
    draft: torch.Tensor | None = None


class Worker:
    """`leader`: this worker reports tokens and takes snapshots. The other ranks of a
    tensor-parallel model run the same steps (their forward passes meet in collectives) and report
    no tokens.

    `lookahead` (the GPU path): once a step's tokens are sampled, the worker feeds each of them
    to its sequence right away, before it reports them, so the GPU computes the next step while
    the report travels to the front end and the next step comes back. The front end always feeds
    a sampled token next (a decode step, or the first token of a closing feed), so that step
    finds the token already fed and its logits ready; a sequence that ends instead is released,
    and its extra token is dropped with it. Every rank samples (the same logits and seeds give the
    same tokens), so every rank looks ahead alike.

    With `speculative` decoding the look-ahead feeds the last token chosen and its MTP draft as
    the next verify step. A step may still feed something else: a request that finishes on the
    first of two tokens (EOS, or its length) feeds its closing tokens instead; then the look-ahead's
    rows are taken back first."""

    def __init__(self, model, num: Numerics, revision: str, arena: Arena | None = None, leader: bool = True, lookahead: bool = False,
                 speculative: bool = False) -> None:
        if speculative:
            check_speculation(model)
        self.model = model
        self.leader = leader
        self.lookahead = lookahead
        self.speculative = speculative
        self.drafters: dict[int, Drafter] = {}  # speculative: each sequence's MTP inputs
        self.drafts: dict[int, torch.Tensor] = {}  # speculative: the draft of the token after each sequence's pending one
        self.num = num
        self.revision = revision
        self.arena = arena
        self.states: dict[int, SequenceState] = {}
        self.samplers: dict[int, Sampler] = {}
        self.snapshots: dict[str, bytes] = {}  # made, waiting for their SnapshotWrite
        self.ahead: dict[int, Ahead] = {}

    def run_step(self, step: Step) -> StepDone:
        """Run every sequence of the step in one batched forward, then sample each."""
        began = time.perf_counter()
        for seq in step.release:
            self._drop(seq)
        written = self._write_snapshots(step)
        outputs: list[SeqOutput] = []
        runnable = []
        for work in step.work:
            try:  # check each sequence's input first, so one bad request cannot poison the batch
                if work.params is not None:
                    self.states[work.seq] = self._restore(work) if work.restore else self.model.new_state(self.num)
                    self.samplers[work.seq] = Sampler(work.params, self.model.config.vocab_size)
                    if self.speculative:
                        self.drafters[work.seq] = Drafter(self.model, self.num)
                if work.seq not in self.states:
                    raise KeyError(f"sequence {work.seq} has no state")
                vocab = self.model.config.vocab_size
                snapshot_only = work.snapshot is not None and not work.sample
                if not (work.tokens or snapshot_only) or not all(0 <= t < vocab for t in work.tokens):
                    raise ValueError(f"tokens must be a non-empty list of ids in [0, {vocab}) (empty only for a snapshot)")
                if not self.speculative and work.seq in self.ahead and work.tokens[:1] != [self.ahead[work.seq].token]:  # the front end feeds the sampled token next
                    raise RuntimeError(f"sequence {work.seq}: its look-ahead failed, or the step does not feed the sampled token first")
                runnable.append(work)
            except SnapshotError as exc:  # a bad cached prefix costs a recompute, never the request
                log.warning("sequence %d: cached prefix refused (%s); recomputing", work.seq, exc)
                self._drop(work.seq)
                outputs.append(SeqOutput(work.seq, error=f"cached prefix refused: {exc}", cache_miss=True))
            except Exception as exc:
                outputs.append(self._fail(work.seq, exc))
        if self.speculative:
            spoken, made = self._speculate(runnable)
            return StepDone(step.step, outputs + spoken, time.perf_counter() - began, made, written)
        try:
            logits = self._forward(runnable)
        except Exception as exc:  # states of this batch are no longer trustworthy: end these sequences
            outputs += [self._fail(w.seq, exc) for w in runnable]
            return StepDone(step.step, outputs, time.perf_counter() - began, [], written)
        draws: list[tuple[int, Draw]] = []
        for work, row in zip(runnable, logits):
            try:
                if work.sample and (self.leader or self.lookahead):
                    draws.append((work.seq, self.samplers[work.seq].draw(row[-1])))
                else:
                    outputs.append(SeqOutput(work.seq))
            except Exception as exc:
                outputs.append(self._fail(work.seq, exc))
        made = self._snapshots(runnable)  # of the states after the works' tokens, before any look-ahead
        if self.lookahead and draws:  # queued behind this step on the device, before its tokens are read
            self._look_ahead(draws)
        for seq, draw in draws:
            try:
                choice = draw.choice()
            except Exception as exc:
                outputs.append(self._fail(seq, exc))
                continue
            outputs.append(SeqOutput(seq, choice=choice if self.leader else None))
            if seq in self.ahead and self.ahead[seq].logits is not None:
                self.ahead[seq].token = choice.token
        return StepDone(step.step, outputs, time.perf_counter() - began, made, written)

    def _speculate(self, runnable: list[SeqWork]) -> tuple[list[SeqOutput], list[SnapshotMade]]:
        """Run the step with MTP drafts (dsuf.model.speculative): every work's tokens, and each
        decoding sequence's draft after them, in one verify_batch (or found fed ahead); a sequence
        whose sampled token is its draft samples one more from the logits after it, the others
        take the draft's row back (once the MTP layer's next draft is queued). With the
        look-ahead the next verify step is queued before the tokens are read. Every rank of a
        tensor-parallel model runs this alike (the same logits and seeds give the same tokens);
        only the leader reports. Returns the outputs and the snapshots (made before any look-ahead)."""
        verified, outputs = self._verify(runnable)
        picked: list[tuple[int, list[Draw]]] = []  # each sampling sequence's tokens drawn, in order
        for w in runnable:
            if w.seq not in verified:
                continue
            seq, (v, tokens, start, draft) = w.seq, verified[w.seq]
            try:
                draws: list[Draw] = []
                drafted = v is not None and v.undo is not None  # (a model may feed no draft where there is no room)
                rows = v.streams[: v.streams.shape[0] - drafted] if v else None
                rejected = False
                if w.sample:
                    draws.append(self.samplers[seq].draw(v.logits[0]))
                    if drafted and draws[0].choice().token == int(draft):
                        draws.append(self.samplers[seq].draw(v.logits[1]))
                        rows, tokens = v.streams, tokens + [int(draft)]
                    else:
                        rejected = drafted
                if rows is not None:
                    nxt = self.drafters[seq].fed(rows, start, tokens, self.states[seq], [draws[-1].token] if draws else [])
                    if nxt is not None:
                        self.drafts[seq] = nxt
                if rejected:  # after the next draft is queued (the MTP layer never saw the row): its launches overlap the draft
                    self.states[seq] = self.model.take_back(self.states[seq], v.undo)
                if draws:
                    picked.append((seq, draws))
                else:
                    outputs.append(SeqOutput(seq))
            except Exception as exc:
                outputs.append(self._fail(seq, exc))
        made = self._snapshots(runnable)
        if self.lookahead and picked:  # queued behind this step on the device, before its tokens are read
            self._look_ahead_drafts([(seq, draws[-1]) for seq, draws in picked])
        for seq, draws in picked:
            try:
                chosen = [d.choice() for d in draws]
            except Exception as exc:
                outputs.append(self._fail(seq, exc))
                continue
            report = chosen if self.leader else []
            outputs.append(SeqOutput(seq, choice=report[0] if report else None, more=report[1:]))
            if seq in self.ahead and self.ahead[seq].verified is not None:
                self.ahead[seq].token = chosen[-1].token
        return outputs, made

    def _verify(self, runnable: list[SeqWork]) -> tuple[dict[int, tuple[Verified | None, list[int], int, torch.Tensor | None]], list[SeqOutput]]:
        """Each work's verify rows (its tokens and its draft), fed ahead or fed now, as (Verified,
        the tokens, the position of the first, the draft); None for a work with no tokens."""
        verified: dict[int, tuple[Verified | None, list[int], int, torch.Tensor | None]] = {}
        outputs: list[SeqOutput] = []
        fresh: list[SeqWork] = []
        for w in runnable:
            ahead = self.ahead.pop(w.seq, None)
            try:
                if ahead is not None:
                    v = ahead.verified
                    if v is None:
                        raise RuntimeError(f"sequence {w.seq}: its look-ahead failed")
                    if w.sample and w.tokens == [ahead.token]:
                        verified[w.seq] = (v, [ahead.token], ahead.start, ahead.draft)
                        continue
                    if v.retract is None:
                        raise RuntimeError(f"sequence {w.seq}: the step does not feed the token fed ahead, which cannot be taken back here")
                    self.states[w.seq] = self.model.take_back(self.states[w.seq], v.retract)
                fresh.append(w)
            except Exception as exc:
                outputs.append(self._fail(w.seq, exc))
        starts = {w.seq: self.states[w.seq].pos for w in fresh}
        fed = [w for w in fresh if w.tokens]
        drafts = {w.seq: self.drafts.pop(w.seq) for w in fed if w.sample and w.seq in self.drafts}
        try:
            rows = self.model.verify_batch([(torch.tensor(w.tokens), self.states[w.seq], drafts.get(w.seq)) for w in fed], self.num) if fed else []
        except Exception as exc:  # states of this batch are no longer trustworthy: end these sequences
            return verified, outputs + [self._fail(w.seq, exc) for w in fresh]
        for w, v in zip(fed, rows):
            verified[w.seq] = (v, list(w.tokens), starts[w.seq], drafts.get(w.seq))
        for w in fresh:
            verified.setdefault(w.seq, (None, [], starts[w.seq], None))
        return verified, outputs

    def _snapshots(self, runnable: list[SeqWork]) -> list[SnapshotMade]:
        """The snapshots the works ask for (the leader's: it reports them), of the sequences still running."""
        made = []
        for work in runnable:
            if work.snapshot is not None and self.leader and work.seq in self.states:
                try:
                    made.append(self._snapshot(work.seq, work.snapshot))
                except Exception:  # a snapshot is an optimisation: losing one never fails the request
                    log.exception("sequence %d: snapshot not taken", work.seq)
        return made

    def _forward(self, runnable: list[SeqWork]) -> list[torch.Tensor]:
        """Each work's logits after its tokens, [n, vocab]: one batched forward of what is not fed
        yet (a sequence looked ahead has its first token fed, and maybe nothing left to feed)."""
        logits: list[torch.Tensor | None] = [None] * len(runnable)
        batch, rows = [], []
        for i, w in enumerate(runnable):
            tokens = w.tokens
            if w.seq in self.ahead:
                logits[i] = self.ahead.pop(w.seq).logits
                tokens = tokens[1:]
            if tokens:
                batch.append((torch.tensor(tokens, dtype=torch.int64), self.states[w.seq]))
                rows.append(i)
        for i, row in zip(rows, self.model.forward_batch(batch, self.num) if batch else []):
            logits[i] = row
        return logits  # type: ignore[return-value]

    def _look_ahead(self, draws: list[tuple[int, Draw]]) -> None:
        """Feed each sequence its drawn token now, as the device holds it (the GPU runs it while
        the step is reported); not one whose context is full (the front end ends it). The token
        each was fed is filled in once it is read."""
        limit = getattr(self.model, "max_context", None)
        draws = [(seq, draw) for seq, draw in draws if limit is None or self.states[seq].pos < limit]
        if not draws:
            return
        try:
            logits = self.model.forward_batch([(draw.token, self.states[seq]) for seq, draw in draws], self.num)
        except Exception:  # their states are no longer trustworthy: the next step fails them
            log.exception("looking ahead failed")
            logits = [None] * len(draws)
        for (seq, _), row in zip(draws, logits):
            self.ahead[seq] = Ahead(-1, logits=row)  # -1 until the token is read; stays -1 if the look-ahead failed

    def _look_ahead_drafts(self, last: list[tuple[int, Draw]]) -> None:
        """Speculative: feed each sequence its last token drawn and its draft as the next verify
        rows, both as the device holds them; not one whose context is full."""
        limit = getattr(self.model, "max_context", None)
        last = [(seq, draw) for seq, draw in last if limit is None or self.states[seq].pos < limit]
        if not last:
            return
        starts = [self.states[seq].pos for seq, _ in last]
        drafts = [self.drafts.pop(seq, None) for seq, _ in last]
        try:
            verified = self.model.verify_batch([(draw.token, self.states[seq], d) for (seq, draw), d in zip(last, drafts)], self.num, ahead=True)
        except Exception:  # their states are no longer trustworthy: the next step fails them
            log.exception("looking ahead failed")
            verified = [None] * len(last)
        for (seq, _), v, start, draft in zip(last, verified, starts, drafts):
            self.ahead[seq] = Ahead(-1, verified=v, start=start, draft=draft)

    # ---- snapshots (conversation caches) ---------------------------------------------------------

    def _restore(self, work: SeqWork) -> SequenceState:
        r = work.restore
        if self.arena is None:
            raise SnapshotError("this worker has no snapshot arena")
        blob = self.arena.region(r.offset, r.size)
        c = self.model.config
        return self.model.import_state(restore_state(c, blob, model_id=c.name, revision=self.revision, tokens=Named(r.key, r.tokens)))

    def _snapshot(self, seq: int, key: str) -> SnapshotMade:
        state = self.model.export_state(self.states[seq])
        blob = snapshot_state(state, self.model.config.name, self.revision, Named(key, state.pos))
        self.snapshots[key] = blob
        return SnapshotMade(seq, key, state.pos, len(blob))

    def _write_snapshots(self, step: Step) -> list[str]:
        written = []
        for w in step.writes:
            blob = self.snapshots.pop(w.key, None)
            if blob is None or w.offset < 0 or self.arena is None:
                continue
            self.arena.region(w.offset, len(blob))[:] = blob
            written.append(w.key)
        return written

    def _drop(self, seq: int) -> None:
        self.ahead.pop(seq, None)
        self.drafters.pop(seq, None)
        self.drafts.pop(seq, None)
        state = self.states.pop(seq, None)
        if state is not None:
            self.model.free(state)
        self.samplers.pop(seq, None)

    def _fail(self, seq: int, exc: Exception) -> SeqOutput:
        log.exception("sequence %d failed", seq, exc_info=exc)
        self._drop(seq)
        return SeqOutput(seq, error=f"{type(exc).__name__}: {exc}")


def load_worker_model(args: argparse.Namespace):
    """The reference model on the CPU, or with --gpu the GPU path (from the checkpoint, or from
    random weights of --random-weights CONFIG's shapes, made on the GPU); with --tp-world N, this
    worker's rank of a tensor-parallel model (every rank's worker loads at the same time)."""
    if args.gpu is None:
        from dsuf.model import load_model

        return load_model(args.ckpt)
    from pathlib import Path

    from dsuf.gpu import tp
    from dsuf.gpu.model import GpuModel, step_rows
    from dsuf.model.config import load_any_config

    device = torch.device("cuda", args.gpu)
    torch.cuda.set_device(device)
    rank, world = args.tp_rank, args.tp_world
    if args.random_weights:
        from dsuf.gpu.weights import random_source, random_weights_config

        config = random_weights_config(Path(args.random_weights))
        tensors = random_source(config, device, args.seed, rank, world)
    else:
        from dsuf.model.checkpoint import load_tensors

        config = load_any_config(args.ckpt)
        tensors = load_tensors(args.ckpt, config, rank, world, rule=tp.shard_rule)
    group = tp.start(rank, world, args.tp_init, device, slot_bytes=tp.slot_bytes(config, world, step_rows(args.max_batch))) if world > 1 else None
    return GpuModel(config, tensors, device, max_batch=args.max_batch, max_context=args.max_context, tp=group)


def serve(args: argparse.Namespace) -> int:
    inbox = Channel(Ring.attach(args.inbox), Doorbell.from_fd(args.inbox_fd), ToWorker)
    outbox = Channel(Ring.attach(args.outbox), Doorbell.from_fd(args.outbox_fd), FromWorker)
    parent = os.getppid()
    try:
        torch.set_num_threads(args.threads)
        began = time.perf_counter()
        model = load_worker_model(args)
        num = Numerics.parse(args.numerics)
        worker = Worker(model, num, args.revision, Arena.attach(args.arena) if args.arena else None, leader=args.tp_rank == 0,
                        lookahead=args.gpu is not None, speculative=args.speculative)
        c = model.config
        outbox.send(Ready(model=c.name, vocab_size=c.vocab_size, eos_token_id=c.eos_token_id, load_seconds=time.perf_counter() - began))
    except Exception as exc:
        outbox.send(Fatal(f"loading {args.ckpt or args.random_weights} failed: {type(exc).__name__}: {exc}"))
        raise
    while True:
        msg = inbox.recv(timeout=1.0)
        if msg is None:
            if os.getppid() != parent:  # the front end is gone: nobody to serve
                return 0
            continue
        if isinstance(msg, Shutdown):
            return 0
        outbox.send(worker.run_step(msg))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dsuf-worker")
    parser.add_argument("--ckpt", help="checkpoint folder")
    parser.add_argument("--gpu", type=int, help="run the GPU path on this CUDA device")
    parser.add_argument("--random-weights", metavar="CONFIG", help="with --gpu: random weights of this config.json's shapes instead of a checkpoint")
    parser.add_argument("--seed", type=int, default=0, help="seed of --random-weights")
    parser.add_argument("--max-batch", type=int, default=64, help="GPU path: sequences held at once")
    parser.add_argument("--max-context", type=int, default=65536, help="GPU path: tokens a sequence may hold")
    parser.add_argument("--tp-rank", type=int, default=0, help="GPU path: this worker's tensor-parallel rank")
    parser.add_argument("--tp-world", type=int, default=1, help="GPU path: tensor-parallel ranks (one worker each)")
    parser.add_argument("--tp-init", default="", help="GPU path: the ranks' rendezvous, e.g. tcp://127.0.0.1:PORT")
    parser.add_argument("--numerics", default="reference")
    parser.add_argument("--inbox", required=True)
    parser.add_argument("--inbox-fd", type=int, required=True)
    parser.add_argument("--outbox", required=True)
    parser.add_argument("--outbox-fd", type=int, required=True)
    parser.add_argument("--arena", default=None, help="shared-memory name of the front end's snapshot arena")
    parser.add_argument("--revision", default="", help="the checkpoint's revision, written into snapshots")
    parser.add_argument("--threads", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    parser.add_argument("--speculative", action="store_true", help="MTP drafts, verified with the next token")
    args = parser.parse_args(argv)
    if not args.ckpt and not args.random_weights:
        parser.error("--ckpt or --random-weights is required")
    if args.random_weights and args.gpu is None:
        parser.error("--random-weights needs --gpu")
    if args.tp_world > 1 and (args.gpu is None or not args.tp_init or not 0 <= args.tp_rank < args.tp_world):
        parser.error("--tp-world needs --gpu, --tp-init and a --tp-rank below it")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    sys.exit(serve(args))


if __name__ == "__main__":
    main()
