"""Typed messages between the front end and the workers, encoded with msgspec over the rings.

Front end → worker: `Step` (which sequences run, with which new tokens) and `Shutdown`.
Worker → front end: `Ready` once the weights are loaded, `StepDone` per step, `Fatal` before dying.

Snapshots (conversation caches) never travel through the rings: they live in the host arena, a
shared-memory segment the front end allocates in. A work item may ask for a snapshot after its
tokens; the worker serialises it and reports its size (`SnapshotMade`), the front end reserves a
region and names it in the next step (`SnapshotWrite`), the worker copies the bytes there and
reports the key in `StepDone.written`. A work item may also start from a snapshot (`Restore`).
"""

from __future__ import annotations

import msgspec

from dsuf.worker.sampling import SamplingParams, TokenChoice


class Restore(msgspec.Struct):
    """Start the sequence from the snapshot at arena[offset : offset + size], verified against
    its chain key and token count, instead of from an empty state."""

    offset: int
    size: int
    key: str
    tokens: int


class SeqWork(msgspec.Struct):
    """New tokens for one sequence in this step: a prompt chunk or the last sampled token (none:
    only a snapshot, where a closing feed's tokens were all fed already)."""

    seq: int
    tokens: list[int]
    sample: bool  # sample the next token after these (last prompt chunk, or decode)
    params: SamplingParams | None = None  # sent once, with the sequence's first work
    restore: Restore | None = None  # with the first work: resume from a cached prefix
    snapshot: str | None = None  # snapshot the state after these tokens, under this chain key


class SnapshotWrite(msgspec.Struct):
    """Where the snapshot `key` goes in the arena; offset -1: no room, discard it."""

    key: str
    offset: int


class Step(msgspec.Struct, tag="step"):
    step: int
    work: list[SeqWork]
    release: list[int] = []  # sequences whose state the worker drops
    writes: list[SnapshotWrite] = []


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class SeqOutput(msgspec.Struct):
    seq: int
    choice: TokenChoice | None = None  # None when the work did not ask to sample
    # Tokens chosen after `choice` in the same step (speculative decoding: accepted drafts). Of
    # choice + more, the worker has fed all but the last; the last is fed by the next work.
    more: list[TokenChoice] = []
    error: str | None = None  # this sequence failed (and was dropped); the others carry on
    cache_miss: bool = False  # the failure was its Restore: recompute the prompt from scratch


class SnapshotMade(msgspec.Struct):
    seq: int
    key: str
    tokens: int
    size: int


class Ready(msgspec.Struct, tag="ready"):
    model: str
    vocab_size: int
    eos_token_id: int
    load_seconds: float


class StepDone(msgspec.Struct, tag="done"):
    step: int
    outputs: list[SeqOutput]
    seconds: float  # model time of the step, measured in the worker
    snapshots: list[SnapshotMade] = []  # serialised, waiting for a SnapshotWrite
    written: list[str] = []  # keys copied into the arena as asked


class Fatal(msgspec.Struct, tag="fatal"):
    message: str


ToWorker = Step | Shutdown
FromWorker = Ready | StepDone | Fatal
