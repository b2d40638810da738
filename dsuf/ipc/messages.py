"""Typed messages between the front end and the workers, encoded with msgspec over the rings.

Front end → worker: `Step` (which sequences run, with which new tokens) and `Shutdown`.
Worker → front end: `Ready` once the weights are loaded, `StepDone` per step, `Fatal` before dying.
"""

from __future__ import annotations

import msgspec

from dsuf.worker.sampling import SamplingParams, TokenChoice


class SeqWork(msgspec.Struct):
    """New tokens for one sequence in this step: a prompt chunk or the last sampled token."""

    seq: int
    tokens: list[int]
    sample: bool  # sample the next token after these (last prompt chunk, or decode)
    params: SamplingParams | None = None  # sent once, with the sequence's first work


class Step(msgspec.Struct, tag="step"):
    step: int
    work: list[SeqWork]
    release: list[int] = []  # sequences whose state the worker drops


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class SeqOutput(msgspec.Struct):
    seq: int
    choice: TokenChoice | None = None  # None when the work did not ask to sample
    error: str | None = None  # this sequence failed (and was dropped); the others carry on


class Ready(msgspec.Struct, tag="ready"):
    model: str
    vocab_size: int
    eos_token_id: int
    load_seconds: float


class StepDone(msgspec.Struct, tag="done"):
    step: int
    outputs: list[SeqOutput]
    seconds: float  # model time of the step, measured in the worker


class Fatal(msgspec.Struct, tag="fatal"):
    message: str


ToWorker = Step | Shutdown
FromWorker = Ready | StepDone | Fatal
