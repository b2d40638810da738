"""Speculative decoding with V4's NextN (MTP) layer (the worker's `_speculate` runs it over the
reference model, the oracle, and over the GPU model alike).

A step feeds the last chosen token t and then the MTP layer's draft d of the token after it. The
main model's logits after t give the next token; if it is d, the draft is accepted and the logits
after d give one more token: two tokens for one step. If not, the step gives the one token and
the state is taken back to before d: a rejected row must leave no trace (its window entry would
be rewritten anyway, but a row that completes a compressor group rewrites the compressor state).
Every token is chosen from the main model's logits after the same prefix, in the same order, so
the tokens (greedy or sampled with a seed) are those of decoding without drafts.

A model that serves speculatively has `verify_batch` (each sequence's tokens, then its draft, fed
in one call: the reference feeds the drafts in a second forward after a copy of their states, the
GPU path feeds them as one more row of the same step) and `take_back` (forget a rejected draft's
row), besides `mtp_forward` for the drafts. With `ahead=True`, verify_batch takes tokens and
drafts that are still on the device (sampled and drafted, not read yet: the worker's look-ahead
queues the next verify step before it reports this one) and also says how to forget both rows
(`Verified.retract`), for when the front end feeds something else after all.

`Drafter` keeps one sequence's MTP inputs: the MTP layer reads each main row's final streams
with the token chosen after it, so a row whose next token is not known yet (a prompt chunk's
last) waits for it. The MTP block attends within a window only and its cache entries depend on
its input rows alone, so only a feed's last `window` rows reach any later draft: it drafts from
those (a long prompt's streams need not be kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers import Numerics
from .state import SequenceState


def check_speculation(model) -> None:
    """A one-line ValueError for a model without an MTP layer to draft with."""
    if not getattr(model, "mtp", None):
        raise ValueError("speculative decoding needs the model's MTP layer (V4's num_nextn_predict_layers)")


@dataclass
class Verified:
    """One sequence's rows of a verify_batch: logits float32 [1, vocab] after its last token, and
    [2, vocab] with a draft (then also after the draft); the final streams [R, hc, D] of its last R
    rows (the draft's included; all of them, or at least the model's window and one more);
    `undo`: what take_back needs to forget the draft's row (None without a draft); `retract`
    (verify_batch(ahead=True) only): what it needs to forget the token's row and the draft's
    (None where the model cannot)."""

    logits: torch.Tensor
    streams: torch.Tensor
    undo: object = None
    retract: object = None


class Drafter:
    """The MTP drafts of one sequence."""

    def __init__(self, model, num: Numerics) -> None:
        check_speculation(model)
        self.model, self.num = model, num
        self.waiting: tuple[torch.Tensor, int] | None = None  # a fed row's streams [1, hc, D] and position, its next token unknown

    def fed(self, streams: torch.Tensor, start: int, tokens: list[int], state: SequenceState, chosen: list[torch.Tensor]) -> torch.Tensor | None:
        """Main rows fed at positions start … (their tokens, and the final streams [R, hc, D] of
        the last R of them), and the tokens chosen after them (each row's next token past the
        rows' own: one a row from the last, fewer if not known yet; int64 [1] each, on the
        device: they need not be read). Returns the draft of the token after the last chosen one
        (int64 [1] on the device, not read), or None when no token is chosen yet."""
        keep = min(streams.shape[0], self.model.config.window_size)  # all a later draft attends to
        skip = len(tokens) - keep
        streams, start, tokens = streams[streams.shape[0] - keep :], start + skip, tokens[skip:]
        rows, nexts = [streams], tokens[1:] + chosen
        if self.waiting is not None and self.waiting[1] == start - 1:
            rows.insert(0, self.waiting[0])
            nexts = tokens[:1] + nexts
            start -= 1
        rows = torch.cat(rows)
        self.waiting = None
        if len(nexts) < rows.shape[0]:  # the last row's next token is not known yet
            self.waiting = (rows[-1:], start + rows.shape[0] - 1)
            rows = rows[:-1]
        if not rows.shape[0]:
            return None
        logits = self.model.mtp_forward(rows, token_ids(nexts[: rows.shape[0]]), start, state, self.num)
        return logits[-1].argmax().view(1) if len(nexts) == rows.shape[0] and chosen else None


def token_ids(tokens: list[int | torch.Tensor]) -> torch.Tensor:
    """Token ids int64 [n] from host ints followed by int64 [1] tensors (tokens chosen on the
    device), on the tensors' device: chosen tokens are never read back to the host."""
    chosen = [t for t in tokens if isinstance(t, torch.Tensor)]
    ints = tokens[: len(tokens) - len(chosen)]
    if not chosen:
        return torch.tensor(ints, dtype=torch.int64)
    parts = [torch.tensor(ints, dtype=torch.int64).to(chosen[0].device)] if ints else []
    return torch.cat(parts + [t.view(1).to(torch.int64) for t in chosen])
