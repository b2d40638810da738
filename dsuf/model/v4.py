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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import quant
from .config import ModelConfig
from .layers import ACC, Expert, f64, HyperConnection, Linear, MoE, Numerics, Rope, acc_matmul, hc_collapse, hc_expand, rms_norm, sink_attention
from .state import CompressorState, LayerState, SequenceState

KV_FP8_BLOCK = 64  # window / compressed KV entries: FP8 on the nope dims, one scale per 64
INDEX_FP4_BLOCK = 32  # indexer queries and keys: FP4 with ue8m0 scales per 32


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row (the indexer's selection); equal scores go to the
    lower index, so the choice never depends on the batch a row is computed in."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]


@dataclass
class Segment:
    """The rows of one sequence inside a batched call, and that sequence's state for one layer."""

    rows: slice
    start: int  # position of the first row
    layer_state: LayerState

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.rows.stop - self.rows.start)


class Weights:
    """Float32 views of a checkpoint's tensors: FP8/FP4 weights dequantised with their scales."""

    def __init__(self, tensors: dict[str, torch.Tensor], c: ModelConfig) -> None:
        self.tensors = tensors
        self.config = c

    def raw(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def float(self, name: str) -> torch.Tensor:
        return self.tensors[name].float()

    def linear(self, name: str) -> Linear:
        """A linear layer; FP8/FP4 storage means its input is act-quantised in reference mode."""
        w = self.tensors[f"{name}.weight"]
        scale = self.tensors.get(f"{name}.scale")
        q = self.config.quant
        if scale is None:
            return Linear(w)
        if w.dtype == torch.int8:
            return Linear(quant.dequant_fp4_weight(w, scale, q.fp4_block), act_block=q.weight_block)
        return Linear(quant.dequant_fp8_weight(w, scale, q.weight_block), act_block=q.weight_block)


class Compressor:
    """Gated pooling of `ratio` tokens into one KV entry (float32 throughout, like the reference).

    Ratio 4 overlaps windows: entry j pools 8 slots, the previous group's tokens on channels
    [0, width) and its own group's tokens on channels [width, 2·width)."""

    def __init__(self, w: Weights, prefix: str, ratio: int, width: int, rope: Rope, rotate: bool) -> None:
        c = w.config
        self.ratio, self.width, self.overlap = ratio, width, ratio == 4
        self.rope, self.rotate, self.eps = rope, rotate, c.norm_eps
        self.ape = w.float(f"{prefix}.ape")
        self.wkv = Linear(w.float(f"{prefix}.wkv.weight"))
        self.wgate = Linear(w.float(f"{prefix}.wgate.weight"))
        self.norm = w.float(f"{prefix}.norm.weight")

    def __call__(self, x: torch.Tensor, start: int, st: CompressorState, num: Numerics) -> torch.Tensor:
        """Feed tokens start … start+T−1; return the entries completed by them [n, width]."""
        ratio, width = self.ratio, self.width
        positions = torch.arange(start, start + x.shape[0])
        kv = self.wkv(x, num, torch.float32)
        score = self.wgate(x, num, torch.float32) + self.ape[positions % ratio]
        cur = ratio if self.overlap else 0  # first row of the current group in the state
        pending = start % ratio
        kv = torch.cat((st.kv[cur : cur + pending], kv))
        score = torch.cat((st.score[cur : cur + pending], score))
        n = kv.shape[0] // ratio
        done = n * ratio
        first_group = (start - pending) // ratio
        groups_kv = kv[:done].view(n, ratio, kv.shape[1])
        groups_score = score[:done].view(n, ratio, kv.shape[1])
        if n and self.overlap:
            prev_kv = torch.cat((st.kv[None, :ratio], groups_kv[:-1]))[..., :width]
            prev_score = torch.cat((st.score[None, :ratio], groups_score[:-1]))[..., :width]
            if first_group == 0:  # the sequence's first group has no predecessor
                prev_score[0] = float("-inf")
            pool_kv = torch.cat((prev_kv, groups_kv[..., width:]), dim=1)
            pool_score = torch.cat((prev_score, groups_score[..., width:]), dim=1)
        else:
            pool_kv, pool_score = groups_kv, groups_score
        # Update the partial-group state: leftovers become the current group, the last
        # complete group becomes the overlap slots.
        left = kv.shape[0] - done
        st.kv[cur : cur + left] = kv[done:]
        st.score[cur : cur + left] = score[done:]
        st.kv[cur + left :] = 0  # keep unused slots canonical so equal states serialise equally
        st.score[cur + left :] = float("-inf")
        if n and self.overlap:
            st.kv[:ratio] = groups_kv[-1]
            st.score[:ratio] = groups_score[-1]
        if not n:
            return torch.zeros(0, width, dtype=num.dtype)

        entries = (pool_kv.to(ACC) * pool_score.to(ACC).softmax(dim=1)).sum(dim=1).float()
        entries = rms_norm(entries.to(num.dtype), self.norm, self.eps)
        entry_pos = (first_group + torch.arange(n)) * ratio
        entries = self.rope.apply(entries, self.rope.cos_sin(entry_pos))
        if num.quantize:
            if self.rotate:  # indexer keys: Hadamard, then FP4
                entries = quant.fp4_fake_quant_ue8m0(quant.hadamard_transform(entries), INDEX_FP4_BLOCK)
            else:
                entries = _fp8_kv(entries, self.rope.dim)
        return entries


def _fp8_kv(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """KV-cache QAT: FP8 on the nope dims (blocks of 64); the rope dims stay as they are."""
    nope = quant.act_quant_fp8(kv[..., :-rope_dim], KV_FP8_BLOCK)
    return torch.cat((nope, kv[..., -rope_dim:]), dim=-1)


class Indexer:
    """Lightning indexer of a CSA layer: score(i, j) = Σ_h w_h · ReLU(q_h · K_j), top-k of the
    visible entries. Its keys come from its own overlapping ratio-4 compressor at index_head_dim."""

    def __init__(self, w: Weights, prefix: str, rope: Rope) -> None:
        c = w.config
        self.n_heads, self.head_dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.rope = rope
        self.wq_b = w.linear(f"{prefix}.wq_b")
        self.weights_proj = Linear(w.float(f"{prefix}.weights_proj.weight"))
        self.compressor = Compressor(w, f"{prefix}.compressor", 4, c.index_head_dim, rope, rotate=True)

    def select(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, cos_sin, keys: torch.Tensor, num: Numerics
    ) -> torch.Tensor:
        """Boolean [T, n_entries]: the compressed entries each query attends to."""
        T, n = x.shape[0], keys.shape[0]
        visible = torch.arange(n)[None, :] < ((positions + 1) // 4)[:, None]
        if n == 0:
            return visible
        q = self.wq_b(qr, num).view(T, self.n_heads, self.head_dim)
        q = self.rope.apply(q, cos_sin)
        if num.quantize:
            q = quant.fp4_fake_quant_ue8m0(quant.hadamard_transform(q), INDEX_FP4_BLOCK)
        weights = self.weights_proj(x, num).float() * (self.head_dim**-0.5 * self.n_heads**-0.5)
        dots = torch.einsum("thd,nd->thn", q.to(ACC), keys.to(ACC)).float().to(num.dtype).float()
        scores = (F.relu(dots) * weights.unsqueeze(-1)).to(ACC).sum(dim=1).float().to(num.dtype).float()
        scores = scores.masked_fill(~visible, float("-inf"))
        picks = select_topk(scores, min(self.topk, n))
        chosen = torch.zeros_like(visible)
        chosen.scatter_(1, picks, True)
        return chosen & visible


class Attention:
    """Shared-KV MQA (one 512-wide head that is both K and V) over the window and the compressed
    entries, with attention sinks, inverse RoPE on the output and the grouped output projection."""

    def __init__(self, w: Weights, prefix: str, ratio: int) -> None:
        c = w.config
        self.c, self.ratio = c, ratio
        self.n_heads, self.head_dim, self.window = c.n_heads, c.head_dim, c.window_size
        if ratio:
            yarn = (c.rope_factor, c.original_seq_len, c.beta_fast, c.beta_slow) if c.original_seq_len else None
            self.rope = Rope(c.rope_head_dim, c.compress_rope_theta, yarn)
        else:  # window-only layers: base theta, no YaRN
            self.rope = Rope(c.rope_head_dim, c.rope_theta)
        self.sink = w.float(f"{prefix}.attn_sink")
        self.wq_a = w.linear(f"{prefix}.wq_a")
        self.q_norm = w.float(f"{prefix}.q_norm.weight")
        self.wq_b = w.linear(f"{prefix}.wq_b")
        self.wkv = w.linear(f"{prefix}.wkv")
        self.kv_norm = w.float(f"{prefix}.kv_norm.weight")
        # wo_a: the reference dequantises it and runs a bf16 einsum without activation quantisation.
        self.wo_a = Linear(w.linear(f"{prefix}.wo_a").weight)
        self.wo_b = w.linear(f"{prefix}.wo_b")
        self.compressor = Compressor(w, f"{prefix}.compressor", ratio, c.head_dim, self.rope, rotate=False) if ratio else None
        self.indexer = Indexer(w, f"{prefix}.indexer", self.rope) if ratio == 4 else None

    def __call__(self, x: torch.Tensor, segments: list[Segment], num: Numerics) -> torch.Tensor:
        """x holds the new rows of every sequence in the batch; the projections run on all rows at
        once, the attention proper on each sequence's rows against its own state."""
        c = self.c
        positions = torch.cat([seg.positions for seg in segments])
        cos_sin = self.rope.cos_sin(positions)

        qr = rms_norm(self.wq_a(x, num), self.q_norm, c.norm_eps)
        q = self.wq_b(qr, num).view(x.shape[0], self.n_heads, self.head_dim)
        q = rms_norm(q, None, c.norm_eps)  # unweighted, per head
        q = self.rope.apply(q, cos_sin)

        kv = rms_norm(self.wkv(x, num), self.kv_norm, c.norm_eps)
        kv = self.rope.apply(kv, cos_sin)
        if num.quantize:
            kv = _fp8_kv(kv, c.rope_head_dim)

        o = torch.cat([
            self._attend(seg, x[seg.rows], qr[seg.rows], q[seg.rows], kv[seg.rows], (cos_sin[0][seg.rows], cos_sin[1][seg.rows]), num)
            for seg in segments
        ])
        o = self.rope.apply(o, cos_sin, inverse=True)
        groups = o.reshape(x.shape[0], c.o_groups, -1)
        wo_a = self.wo_a.weight.view(c.o_groups, c.o_lora_rank, -1)
        o = torch.einsum("tgd,grd->tgr", groups.to(ACC), wo_a).float().to(num.dtype)
        return self.wo_b(o.flatten(1), num)

    def _attend(self, seg: Segment, x, qr, q, kv, cos_sin, num: Numerics) -> torch.Tensor:
        """One sequence: window keys from its ring plus this chunk, its compressed entries, sinks."""
        st, start, positions, W = seg.layer_state, seg.start, seg.positions, self.window
        earlier = torch.arange(max(0, start - (W - 1)), start)  # up to W−1 earlier positions
        keys = torch.cat((st.window[earlier % W], kv))
        key_pos = torch.cat((earlier, positions))
        mask = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] > positions[:, None] - W)
        keep = positions[-W:]
        st.window[keep % W] = kv[-W:]

        if self.compressor is not None:
            st.compressed = torch.cat((st.compressed, self.compressor(x, start, st.compressor, num)))
            if self.indexer is not None:
                new_keys = self.indexer.compressor(x, start, st.indexer, num)
                st.index_keys = torch.cat((st.index_keys, new_keys))
                chosen = self.indexer.select(x, qr, positions, cos_sin, st.index_keys, num)
            else:
                chosen = torch.arange(st.compressed.shape[0])[None, :] < ((positions + 1) // self.ratio)[:, None]
            keys = torch.cat((keys, st.compressed))
            mask = torch.cat((mask, chosen), dim=1)
        return sink_attention(q, keys, mask, self.sink, self.head_dim**-0.5, num)


class Block:
    """Attention and MoE sublayers, each between an mHC collapse and expand."""

    def __init__(self, w: Weights, prefix: str, ratio: int, hash_layer: bool) -> None:
        c = w.config
        self.c = c
        self.hc_attn = HyperConnection(*(w.float(f"{prefix}.hc_attn_{k}") for k in ("fn", "base", "scale")))
        self.hc_ffn = HyperConnection(*(w.float(f"{prefix}.hc_ffn_{k}") for k in ("fn", "base", "scale")))
        self.attn_norm = w.float(f"{prefix}.attn_norm.weight")
        self.ffn_norm = w.float(f"{prefix}.ffn_norm.weight")
        self.attn = Attention(w, f"{prefix}.attn", ratio)
        f = f"{prefix}.ffn"
        limit = c.swiglu_limit

        def expert(p: str) -> Expert:
            return Expert(w.linear(f"{p}.w1"), w.linear(f"{p}.w2"), w.linear(f"{p}.w3"), limit)

        self.ffn = MoE(
            gate=w.float(f"{f}.gate.weight").to(ACC),
            bias=None if hash_layer else w.float(f"{f}.gate.bias"),
            tid2eid=w.raw(f"{f}.gate.tid2eid") if hash_layer else None,
            experts=[expert(f"{f}.experts.{e}") for e in range(c.n_routed_experts)],
            shared=expert(f"{f}.shared_experts"),
            top_k=c.n_activated_experts,
            route_scale=c.route_scale,
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
        self.site = HyperConnection(*(w.float(f"{prefix}_{k}") for k in ("fn", "base", "scale")))

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


class V4Model:
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

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, state: SequenceState, num: Numerics, return_streams: bool = False, last_only: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Feed `tokens` [T] at positions state.pos …; return float32 logits [T, vocab] ([1, vocab]
        with `last_only`, all a sampler needs) and optionally the final residual streams
        [T, hc, D], the MTP layer's input."""
        (logits,), x = self._forward([(tokens, state)], num, last_only)
        return (logits, x) if return_streams else logits

    @torch.inference_mode()
    def forward_batch(
        self, batch: list[tuple[torch.Tensor, SequenceState]], num: Numerics, last_only: bool = True
    ) -> list[torch.Tensor]:
        """Several sequences in one call (each with its own new tokens and state). Every row-wise
        computation runs on all rows together; the reference path is batch-invariant, so each
        sequence gets exactly the logits `forward` would give it alone."""
        return self._forward(batch, num, last_only)[0]

    def _forward(self, batch: list[tuple[torch.Tensor, SequenceState]], num: Numerics, last_only: bool):
        c = self.config
        offsets, segments_of = 0, []
        for tokens, state in batch:
            if state.dtype != num.dtype:
                raise ValueError(f"state holds {state.dtype} activations, numerics asks for {num.dtype}")
            segments_of.append((slice(offsets, offsets + tokens.shape[0]), state))
            offsets += tokens.shape[0]
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
