"""Speculative greedy decoding with V4's NextN (MTP) layer, on the reference path: the algorithm
and the state handling the fast paths follow, and their oracle.

A step feeds the last chosen token t together with the MTP layer's draft d of the token after
it. The main model's logits after t give the next token; if that is d, the draft is accepted
and the logits after d give one more token, so the step yields two tokens for one forward of
two rows. If not, the step yields the one token, and the state is taken back to before d: a
rejected row must leave no trace (its window entry would be rewritten anyway, but a row that
completes a compressor group rewrites the compressor state). The MTP layer then drafts from
the main model's final streams at the rows kept and the tokens chosen after them.

Every token is the main model's argmax after the same prefix, so the output is greedy
decoding's (up to the last-bit differences between feeding rows together or one at a time).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .layers import Numerics


@dataclass
class Speculated:
    tokens: list[int]
    drafted: int  # steps that verified a draft
    accepted: int  # drafts that were the main model's own choice

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@torch.inference_mode()
def speculative_greedy(model, prompt: torch.Tensor, max_new: int, num: Numerics) -> Speculated:
    """Up to max_new greedy tokens after `prompt` (stopping after EOS), one MTP draft a step."""
    if not getattr(model, "mtp", None):
        raise ValueError("speculative decoding needs the model's MTP layer (V4's num_nextn_predict_layers)")
    eos = model.config.eos_token_id
    state = model.new_state(num)
    logits, streams = model.forward(prompt, state, num, return_streams=True)
    out = [int(logits[-1].argmax())]
    # The MTP layer reads each position's final streams with the token chosen after it.
    draft_logits = model.mtp_forward(streams, torch.cat((prompt[1:], torch.tensor(out))), 0, state, num)
    drafted = accepted = 0
    while len(out) < max_new and out[-1] != eos:
        token, draft, pos = out[-1], int(draft_logits[-1].argmax()), state.pos
        before = copy.deepcopy(state)
        logits, streams = model.forward(torch.tensor([token, draft]), state, num, return_streams=True)
        drafted += 1
        chosen = [int(logits[0].argmax())]
        if chosen[0] == draft:
            accepted += 1
            chosen.append(int(logits[1].argmax()))
        else:  # back to before the draft's row
            state = before
            logits, streams = model.forward(torch.tensor([token]), state, num, return_streams=True)
        draft_logits = model.mtp_forward(streams, torch.tensor(chosen), pos, state, num)
        for t in chosen:
            if len(out) < max_new and out[-1] != eos:
                out.append(t)
    return Speculated(out, drafted, accepted)
