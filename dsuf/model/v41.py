"""DeepSeek-V4.1-Flash, reference path: the forward pass as DeepSeek's V4.1 `inference/model.py`
defines it (model.md §3.3), with the same state contract as V4: prefill in one piece, prefill in
chunks of any size and token-by-token decode are the same computation.

What differs from V4:

- CSA2 attention. Every layer attends over its own sliding window; the compressed KV is shared.
  Only the KV sources ("full" layers) compress: ratio 2 by gated pooling, ratio 1 by a
  projection. A source derives its index keys from the pre-RoPE latent, then RoPEs and caches
  the latent; every later layer of the same ratio reads the nearest source's cache. Index layers
  ("full" and "reindex") pick the top-k entries per query; "reuse" layers take the latest picks.
- The two-level indexer: the candidate source's scores, max-pooled over blocks of entries (the
  block holding the query's newest entry pinned), keep the top blocks; the later "reindex" layers
  pick only inside them.
- Caches: window KV FP8 on all dims (block 32), compressed KV FP4 with E4M3 scales per 16, index
  keys FP4 per 32; no per-head query norm, no Hadamard.
- Single-pass mHC: a site's pre-mix collapses the *next* sublayer's input (the first one collapses
  stream 0); the final collapse uses the last FFN site's pre-mix; no hc_head.
- Engram before layers `engram_layer_ids`; the gate's `bias_vl` and the Engram's dead tokens for
  image spans (positions whose id is `image_token_id`); 1e-20 in the routing normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .engram import Engram, EngramTable, NgramHasher, compressed_vocabulary
from .layers import (
    ACC,
    Compressor,
    IndexScorer,
    Linear,
    Numerics,
    ReferenceModel,
    Segment,
    SparseAttention,
    Weights,
    acc_matmul,
    hc_collapse,
    hc_expand,
    hyper_connection,
    load_rows,
    moe_of,
    rms_norm,
    select_topk,
    store_rows,
)
from .state import V41_COMPRESSED_KV, V41_INDEX_KEYS, V41_WINDOW_KV, SequenceState

ROUTE_EPS = 1e-20  # in the routing normaliser, as in training (not norm_eps)


@dataclass
class Shared:
    """What the layers of one sequence hand down the stack within one forward (the reference's
    SharedAttentionRuntime): the newest source's compressed entries and index keys (values), the
    latest index layer's picks and the candidate source's blocks, both [T, n_entries]."""

    kv: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    picks: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


@dataclass
class Tokens:
    """A forward's token-level inputs, all rows: ids [T], image-span mask [T], Engram hash ids
    [T, engram layers, n_hash_columns]."""

    ids: torch.Tensor
    image: torch.Tensor
    hash_ids: torch.Tensor


def candidate_blocks(scores: torch.Tensor, counts: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    """Level one of the two-level indexer. scores [T, n] (−inf where invisible), counts [T] the
    entries each query sees. A block of `block_size` entries scores its best entry; the block
    holding the query's newest entry is pinned in (it may be partly filled, yet holds the most
    recent tokens); the top `topk_blocks` blocks are kept, unreachable ones (−inf) dropped.
    Returns the kept entries as a mask [T, n]."""
    n = scores.shape[1]
    blocks = F.pad(scores, (0, -n % block_size), value=float("-inf")).unflatten(-1, (-1, block_size)).amax(dim=-1)
    newest = (counts - 1) // block_size
    blocks = blocks.masked_fill(torch.arange(blocks.shape[1])[None, :] == newest[:, None], float("inf"))
    keep = torch.zeros(blocks.shape, dtype=torch.bool)
    keep.scatter_(1, select_topk(blocks, min(topk_blocks, blocks.shape[1])), True)
    return (keep & (blocks > float("-inf"))).repeat_interleave(block_size, dim=1)[:, :n]


class CSA2Attention(SparseAttention):
    """One V4.1 layer's attention in its CSA2 role ('swa', 'full', 'reindex' or 'reuse')."""

    q_head_norm = False
    window_format = V41_WINDOW_KV

    def __init__(self, w: Weights, prefix: str, layer: int) -> None:
        c = w.config
        assert c.csa2 is not None
        super().__init__(w, prefix, c.compress_ratios[layer])
        self.role = c.layer_kind(layer)
        self.compressor: Compressor | None = None
        self.indexer: IndexScorer | None = None
        if self.role == "full":
            self.compressor = Compressor(w, f"{prefix}.compressor", self.ratio, c.head_dim)
            self.wk = Linear(w.float(f"{prefix}.indexer.wk.weight"))
            self.k_norm = w.float(f"{prefix}.indexer.k_norm.weight")
        if self.role in ("full", "reindex"):
            self.indexer = IndexScorer(w, f"{prefix}.indexer", self.rope, hadamard=False)
        self.candidate_source = layer == c.csa2.candidate_source_layer

    def compressed(self, seg: Segment, x, qr, cos_sin, num: Numerics, shared: Shared) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.ratio:
            return None
        if self.compressor is not None:
            self._publish(seg, x, num, shared)
        if self.indexer is not None:
            shared.picks = self._pick(seg, x, qr, cos_sin, num, shared)
        return shared.kv, shared.picks

    def _publish(self, seg: Segment, x: torch.Tensor, num: Numerics, shared: Shared) -> None:
        """Compress this chunk, append the new entries and their index keys to the caches, and
        publish both for the layers above."""
        c, st = self.c, seg.layer_state
        latent, entry_pos = self.compressor(x, seg.start, st.compressor, num)
        cos_sin = self.rope.cos_sin(entry_pos)  # entry j stands for position ratio·j
        # The index keys come from the latent *before* RoPE; only then is the latent rotated.
        keys = self.rope.apply(rms_norm(self.wk(latent, num), self.k_norm, c.norm_eps), cos_sin)
        st.index_keys = torch.cat((st.index_keys, store_rows(keys, V41_INDEX_KEYS, num)))
        st.compressed = torch.cat((st.compressed, store_rows(self.rope.apply(latent, cos_sin), V41_COMPRESSED_KV, num)))
        shared.kv = load_rows(st.compressed, V41_COMPRESSED_KV, num)
        shared.index_keys = load_rows(st.index_keys, V41_INDEX_KEYS, num)

    def _pick(self, seg: Segment, x, qr, cos_sin, num: Numerics, shared: Shared) -> torch.Tensor:
        """The entries each query attends to [T, n]: the top-k of the visible ones by index score,
        inside the candidate blocks for reindex layers."""
        c = self.c
        n = shared.kv.shape[0]
        counts = (seg.positions + 1) // self.ratio  # entry j is visible to query i iff j < (i+1) // ratio
        visible = torch.arange(n)[None, :] < counts[:, None]
        if n == 0:
            return visible
        scores = self.indexer.scores(x, qr, cos_sin, shared.index_keys, num).masked_fill(~visible, float("-inf"))
        if self.candidate_source:
            shared.candidates = candidate_blocks(scores, counts, c.csa2.candidate_topk_blocks, c.csa2.candidate_block_size)
        elif self.role == "reindex":
            scores = scores.masked_fill(~shared.candidates, float("-inf"))
        chosen = torch.zeros_like(visible)
        chosen.scatter_(1, select_topk(scores, min(self.indexer.topk, n)), True)
        return chosen & (scores > float("-inf"))


class V41Block:
    """Engram (on its layers), then attention and MoE, each between a collapse and an expand of
    the streams. Single-pass mHC: each site's coefficients come from the streams it sees, but its
    pre-mix collapses the *next* sublayer's input."""

    def __init__(self, w: Weights, prefix: str, layer: int, engram_index: int | None) -> None:
        c = w.config
        self.c = c
        self.hc_attn, self.hc_ffn = hyper_connection(w, f"{prefix}.hc_attn"), hyper_connection(w, f"{prefix}.hc_ffn")
        self.attn_norm = w.float(f"{prefix}.attn_norm.weight")
        self.ffn_norm = w.float(f"{prefix}.ffn_norm.weight")
        self.attn = CSA2Attention(w, f"{prefix}.attn", layer)
        f = f"{prefix}.ffn"
        self.ffn = moe_of(  # gate_temp is 1.0
            w, f,
            bias=w.float(f"{f}.gate.bias"),
            tid2eid=None,
            bias_vl=w.float(f"{f}.gate.bias_vl") if c.vision is not None else None,
            route_eps=ROUTE_EPS,
        )
        self.engram_index = engram_index  # which of the hash-id columns groups this layer reads
        self.engram = None
        if engram_index is not None:
            g = f"{prefix}.engram"
            table = EngramTable(w.raw(f"{g}.embed.weight"), w.raw(f"{g}.embed.scale"))
            self.engram = Engram(table, w.linear(f"{g}.wkv"), w.float(f"{g}.q_weight"), w.float(f"{g}.k_weight"), c.norm_eps)

    def __call__(
        self, x: torch.Tensor, pre_mix: torch.Tensor, tokens: Tokens, segments: list[Segment], shared: list[Shared], num: Numerics
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, n, D] and the previous FFN site's pre-mix [T, n]; returns the new streams and this
        block's FFN pre-mix (for the next block's attention, or the final collapse)."""
        c = self.c
        if self.engram is not None:
            x = self.engram(x, tokens.hash_ids[:, self.engram_index], ~tokens.image, num)
        a_pre, a_post, a_comb = self.hc_attn.coefficients(x, c.norm_eps, c.hc_eps, c.hc_sinkhorn_iters)
        y = rms_norm(hc_collapse(x, pre_mix), self.attn_norm, c.norm_eps)
        x = hc_expand(self.attn(y, segments, num, shared), x, a_post, a_comb)
        f_pre, f_post, f_comb = self.hc_ffn.coefficients(x, c.norm_eps, c.hc_eps, c.hc_sinkhorn_iters)
        y = rms_norm(hc_collapse(x, a_pre), self.ffn_norm, c.norm_eps)
        x = hc_expand(self.ffn(y, tokens.ids, num, tokens.image), x, f_post, f_comb)
        return x, f_pre


class V41Model(ReferenceModel):
    """DeepSeek-V4.1-Flash (text) on the reference path. `tokenizer_json` supplies the Engram's
    compressed vocabulary. The DSpark stages and the vision tower are loaded and shape-checked;
    their forward passes are not built yet."""

    def __init__(self, c: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer_json: str | Path) -> None:
        assert c.family == "v41" and c.engram is not None
        w = Weights(tensors, c)
        self.config = c
        token_map, size = compressed_vocabulary(tokenizer_json)
        if token_map.shape[0] < c.vocab_size:
            raise ValueError(f"tokenizer {tokenizer_json} has {token_map.shape[0]} tokens, fewer than vocab_size={c.vocab_size}")
        self.hasher = NgramHasher(c.engram, token_map, size)
        self.embed = w.raw("embed.weight")
        self.head = w.float("head.weight").to(ACC)
        self.norm = w.float("norm.weight")
        engram_layers = c.engram.layer_ids
        self.layers = [
            V41Block(w, f"layers.{i}", i, engram_layers.index(i) if i in engram_layers else None) for i in range(c.n_layers)
        ]
        self.dspark = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
        self.vision = {k: v for k, v in tensors.items() if k.startswith(("vision.", "aligner.", "image_"))}

    def packs_caches(self, num: Numerics) -> bool:
        return num.quantize

    def new_state(self, num: Numerics) -> SequenceState:
        return SequenceState.new(self.config, num.dtype, packed=self.packs_caches(num))

    def _forward(self, batch: list[tuple[torch.Tensor, SequenceState]], num: Numerics, last_only: bool):
        c = self.config
        segments_of = self._rows(batch, num)
        ids = torch.cat([tokens for tokens, _ in batch])
        # Image-span positions (their embeddings will come from the vision tower) route with
        # bias_vl and take no part in any n-gram.
        image = ids == c.image_token_id
        hash_ids = []
        for rows, state in segments_of:
            h, state.engram = self.hasher(ids[rows], state.engram, image[rows])
            hash_ids.append(h)
        tokens = Tokens(ids, image, torch.cat(hash_ids))
        x = self.embed[ids].to(num.dtype).unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        pre_mix = torch.zeros(x.shape[:2])
        pre_mix[:, 0] = 1.0  # the first collapse takes stream 0
        shared = [Shared() for _ in segments_of]
        for i, block in enumerate(self.layers):
            segments = [Segment(rows, state.pos, state.layers[i]) for rows, state in segments_of]
            x, pre_mix = block(x, pre_mix, tokens, segments, shared, num)
        for rows, state in segments_of:
            state.pos += rows.stop - rows.start
        if last_only:
            picked = torch.tensor([rows.stop - 1 for rows, _ in segments_of])
            return list(self._logits(x[picked], pre_mix[picked]).split(1)), x
        logits = self._logits(x, pre_mix)
        return [logits[rows] for rows, _ in segments_of], x

    def _logits(self, x: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
        """The final collapse with the last FFN site's pre-mix (no hc_head), norm, fp32 head."""
        c = self.config
        return acc_matmul(rms_norm(hc_collapse(x, pre_mix), self.norm, c.norm_eps), self.head)
