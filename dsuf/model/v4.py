"""DeepSeek-V4-Flash, reference path: the forward pass as DeepSeek's paper and code define it.

A forward call takes any number of new tokens of one sequence plus that sequence's explicit
`SequenceState`, and returns the logits of every new position. Prefill in one piece, prefill in
chunks of any size and token-by-token decode are the same computation:

- window attention: query i sees positions max(0, i−W+1) … i (the ring holds the W newest);
- compressed entry j (the group of tokens ratio·j … ratio·j+ratio−1) exists once its group is
  complete and is visible to query i iff j < (i+1) // ratio;
- HCA layers (ratio ≠ 4) attend to every visible entry; CSA layers (ratio 4, overlapping
  compressor) to the lightning indexer's top-k of the visible entries.
"""

from __future__ import annotations

import copy

import torch

from . import layers, quant
from .config import ModelConfig
from .layers import (
    ACC,
    INDEX_FP4_BLOCK,
    IndexScorer,
    Numerics,
    ReferenceModel,
    Rope,
    Segment,
    SparseAttention,
    Weights,
    acc_matmul,
    f64,
    hc_collapse,
    hc_expand,
    hyper_connection,
    moe_of,
    rms_norm,
    select_topk,
)
from .speculative import Verified
from .state import SequenceState

KV_FP8_BLOCK = 64  # window / compressed KV entries: FP8 on the nope dims, one scale per 64


class Compressor(layers.Compressor):
    """V4's compressor: the pooled latent RoPE'd at its group's first position, then fake-quantised
    (main KV: FP8 on the nope dims; indexer keys (`rotate`): Hadamard, then FP4)."""

    def __init__(self, w: Weights, prefix: str, ratio: int, width: int, rope: Rope, rotate: bool) -> None:
        super().__init__(w, prefix, ratio, width)
        self.rope, self.rotate = rope, rotate

    def __call__(self, x: torch.Tensor, start: int, st, num: Numerics) -> torch.Tensor:  # type: ignore[override]
        """Feed tokens start … start+T−1; return the entries completed by them [n, width]."""
        entries, entry_pos = super().__call__(x, start, st, num)
        entries = self.rope.apply(entries, self.rope.cos_sin(entry_pos))
        if num.quantize:
            if self.rotate:
                entries = quant.fp4_fake_quant_ue8m0(quant.hadamard_transform(entries), INDEX_FP4_BLOCK)
            else:
                entries = _fp8_kv(entries, self.rope.dim)
        return entries


def _fp8_kv(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """KV-cache QAT: FP8 on the nope dims (blocks of 64); the rope dims stay as they are."""
    nope = quant.act_quant_fp8(kv[..., :-rope_dim], KV_FP8_BLOCK)
    return torch.cat((nope, kv[..., -rope_dim:]), dim=-1)


class Indexer(IndexScorer):
    """Lightning indexer of a CSA layer: the top-k of the visible entries by score. Its keys come
    from its own overlapping ratio-4 compressor at index_head_dim; queries and keys are rotated by
    a Hadamard matrix before their FP4 quantisation."""

    def __init__(self, w: Weights, prefix: str, rope: Rope) -> None:
        super().__init__(w, prefix, rope, hadamard=True)
        self.compressor = Compressor(w, f"{prefix}.compressor", 4, w.config.index_head_dim, rope, rotate=True)

    def select(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, cos_sin, keys: torch.Tensor, num: Numerics
    ) -> torch.Tensor:
        """Boolean [T, n_entries]: the compressed entries each query attends to."""
        n = keys.shape[0]
        visible = torch.arange(n)[None, :] < ((positions + 1) // 4)[:, None]
        if n == 0:
            return visible
        scores = self.scores(x, qr, cos_sin, keys, num).masked_fill(~visible, float("-inf"))
        picks = select_topk(scores, min(self.topk, n))
        chosen = torch.zeros_like(visible)
        chosen.scatter_(1, picks, True)
        return chosen & visible


class Attention(SparseAttention):
    """V4 attention: per-head normalised queries; window KV FP8 on the nope dims; HCA layers
    (ratio ≠ 4) attend to every visible compressed entry, CSA layers (ratio 4) to the indexer's picks."""

    q_head_norm = True

    def __init__(self, w: Weights, prefix: str, ratio: int) -> None:
        super().__init__(w, prefix, ratio)
        c = w.config
        self.compressor = Compressor(w, f"{prefix}.compressor", ratio, c.head_dim, self.rope, rotate=False) if ratio else None
        self.indexer = Indexer(w, f"{prefix}.indexer", self.rope) if ratio == 4 else None

    def quantize_kv(self, kv: torch.Tensor, num: Numerics) -> torch.Tensor:
        return _fp8_kv(kv, self.c.rope_head_dim) if num.quantize else kv

    def compressed(self, seg: Segment, x, qr, cos_sin, num: Numerics, shared) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.compressor is None:
            return None
        st, positions = seg.layer_state, seg.positions
        st.compressed = torch.cat((st.compressed, self.compressor(x, seg.start, st.compressor, num)))
        if self.indexer is not None:
            new_keys = self.indexer.compressor(x, seg.start, st.indexer, num)
            st.index_keys = torch.cat((st.index_keys, new_keys))
            chosen = self.indexer.select(x, qr, positions, cos_sin, st.index_keys, num)
        else:
            chosen = torch.arange(st.compressed.shape[0])[None, :] < ((positions + 1) // self.ratio)[:, None]
        return st.compressed, chosen


class Block:
    """Attention and MoE sublayers, each between an mHC collapse and expand."""

    def __init__(self, w: Weights, prefix: str, ratio: int, hash_layer: bool) -> None:
        c = w.config
        self.c = c
        self.hc_attn, self.hc_ffn = hyper_connection(w, f"{prefix}.hc_attn"), hyper_connection(w, f"{prefix}.hc_ffn")
        self.attn_norm = w.float(f"{prefix}.attn_norm.weight")
        self.ffn_norm = w.float(f"{prefix}.ffn_norm.weight")
        self.attn = Attention(w, f"{prefix}.attn", ratio)
        f = f"{prefix}.ffn"
        self.ffn = moe_of(
            w, f,
            bias=None if hash_layer else w.float(f"{f}.gate.bias"),
            tid2eid=w.raw(f"{f}.gate.tid2eid") if hash_layer else None,
        )

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, segments: list[Segment], num: Numerics) -> torch.Tensor:
        c = self.c
        pre, post, comb = self.hc_attn.coefficients(x, c.norm_eps, c.hc_eps, c.hc_sinkhorn_iters)
        y = rms_norm(hc_collapse(x, pre), self.attn_norm, c.norm_eps)
        x = hc_expand(self.attn(y, segments, num), x, post, comb)
        pre, post, comb = self.hc_ffn.coefficients(x, c.norm_eps, c.hc_eps, c.hc_sinkhorn_iters)
        y = rms_norm(hc_collapse(x, pre), self.ffn_norm, c.norm_eps)
        return hc_expand(self.ffn(y, ids, num), x, post, comb)


class HyperHead:
    """The final collapse of the streams: pre = sigmoid(mix·scale + base) + eps, no Sinkhorn."""

    def __init__(self, w: Weights, prefix: str) -> None:
        self.site = hyper_connection(w, prefix)

    def __call__(self, x: torch.Tensor, norm_eps: float, hc_eps: float) -> torch.Tensor:
        pre = f64(torch.sigmoid, self.site.mixes(x, norm_eps) * self.site.scale + self.site.base) + hc_eps
        return hc_collapse(x, pre)


class MTPLayer:
    """NextN layer (speculative decoding): combines the next token's embedding with the main
    model's final streams, runs a window-only block, and predicts one token further."""

    def __init__(self, w: Weights, prefix: str) -> None:
        self.e_proj = w.linear(f"{prefix}.e_proj")
        self.h_proj = w.linear(f"{prefix}.h_proj")
        self.enorm = w.float(f"{prefix}.enorm.weight")
        self.hnorm = w.float(f"{prefix}.hnorm.weight")
        self.norm = w.float(f"{prefix}.norm.weight")
        self.hc_head = HyperHead(w, f"{prefix}.hc_head")
        self.block = Block(w, prefix, ratio=0, hash_layer=False)


class V4Model(ReferenceModel):
    """DeepSeek-V4-Flash (and V4-Flash-0731) on the reference path."""

    def __init__(self, c: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
        w = Weights(tensors, c)
        self.config = c
        self.embed = w.raw("embed.weight")
        self.head = w.float("head.weight").to(ACC)
        self.norm = w.float("norm.weight")
        self.hc_head = HyperHead(w, "hc_head")
        self.layers = [Block(w, f"layers.{i}", c.compress_ratios[i], c.is_hash_layer(i)) for i in range(c.n_layers)]
        self.mtp = [MTPLayer(w, f"mtp.{i}") for i in range(c.n_mtp_layers)] if c.dspark is None else []
        # V4-Flash-0731's DSpark stages: loaded and checked now, run by speculative decoding later.
        self.dspark = {k: v for k, v in tensors.items() if k.startswith("mtp.")} if c.dspark else {}

    def new_state(self, num: Numerics) -> SequenceState:
        return SequenceState.new(self.config, num.dtype)

    def _logits(self, x: torch.Tensor, hc_head: HyperHead, norm: torch.Tensor) -> torch.Tensor:
        c = self.config
        h = rms_norm(hc_head(x, c.norm_eps, c.hc_eps), norm, c.norm_eps)
        return acc_matmul(h, self.head)

    def _forward(self, batch: list[tuple[torch.Tensor, SequenceState]], num: Numerics, last_only: bool):
        c = self.config
        segments_of = self._rows(batch, num)
        ids = torch.cat([tokens for tokens, _ in batch])
        x = self.embed[ids].to(num.dtype)
        x = x.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        for i, block in enumerate(self.layers):
            segments = [Segment(rows, state.pos, state.layers[i]) for rows, state in segments_of]
            x = block(x, ids, segments, num)
        for rows, state in segments_of:
            state.pos += rows.stop - rows.start
        if last_only:
            picked = torch.tensor([rows.stop - 1 for rows, _ in segments_of])
            logits = self._logits(x[picked], self.hc_head, self.norm)
            return list(logits.split(1)), x
        logits = self._logits(x, self.hc_head, self.norm)
        return [logits[rows] for rows, _ in segments_of], x

    @torch.inference_mode()
    def verify_batch(self, batch: list[tuple[torch.Tensor, SequenceState, int | torch.Tensor | None]], num: Numerics,
                     ahead: bool = False) -> list[Verified]:
        """Each sequence's tokens, then its draft where it has one (speculative.py): the drafts in
        a second forward, after a copy of their states (the undo); `ahead`: a copy from before the
        tokens too (the retract)."""
        retract = [copy.deepcopy(state) if ahead else None for _, state, _ in batch]
        logits, streams = self.forward_batch_streams([(tokens, state) for tokens, state, _ in batch], num)
        out = [Verified(lg, st, retract=r) for lg, st, r in zip(logits, streams, retract)]
        drafted = [i for i, (_, _, draft) in enumerate(batch) if draft is not None]
        undo = {i: copy.deepcopy(batch[i][1]) for i in drafted}
        logits, streams = self.forward_batch_streams([(torch.as_tensor(batch[i][2]).view(1), batch[i][1]) for i in drafted], num)
        for i, lg, st in zip(drafted, logits, streams):
            out[i] = Verified(torch.cat((out[i].logits, lg)), torch.cat((out[i].streams, st)), undo[i], retract[i])
        return out

    def take_back(self, state: SequenceState, undo: object) -> SequenceState:
        """The state to go on with once a verified draft is rejected (or a look-ahead retracted):
        the copy from before it, with the MTP layer's state as it is now (verify_batch never
        moves it; a draft made since did)."""
        undo.mtp = state.mtp  # type: ignore[attr-defined]
        return undo  # type: ignore[return-value]

    @torch.inference_mode()
    def mtp_forward(
        self, streams: torch.Tensor, next_tokens: torch.Tensor, start: int, state: SequenceState, num: Numerics, depth: int = 0
    ) -> torch.Tensor:
        """Draft logits [T, vocab] for the token after `next_tokens`, from the main model's final
        streams at positions start … start+T−1 (the MTP layer keeps its own window state)."""
        c, mtp = self.config, self.mtp[depth]
        e = rms_norm(self.embed[next_tokens].to(num.dtype), mtp.enorm, c.norm_eps)
        h = rms_norm(streams, mtp.hnorm, c.norm_eps)
        x = mtp.e_proj(e, num).unsqueeze(1) + mtp.h_proj(h, num)
        x = mtp.block(x, next_tokens, [Segment(slice(0, x.shape[0]), start, state.mtp[depth])], num)
        return self._logits(x, mtp.hc_head, mtp.norm)
