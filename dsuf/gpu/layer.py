"""One V4-Flash decode layer on the GPU, for a batch of sequences each at its own position.

Everything that depends on the step's positions is read from device tensors (`StepIndex`), so a
whole decode step can be captured once as a CUDA graph and replayed for any mix of positions.

Caches (`LayerCache`) hold `slots` sequences side by side. Sequence slot s owns pool entries
[s·S, s·S + S), S = R + n_max: its ring of R = W + PREFILL_CHUNK entries (position p at entry
p % R) then its compressed entries (entry j covers positions ratio·j … ratio·j + ratio − 1); index
keys: rows [s·n_max, s·n_max + n_max); compressor states: row s. Nothing needs clearing between
sequences: a step reads only what its positions make valid (the last W positions up to pos,
entries and keys below (pos + 1) // ratio).

A step may hold up to PREFILL_CHUNK rows of one sequence at consecutive positions (a prompt's
chunk): every row's KV is written before any row attends, and the ring is longer than the window
by a chunk, so a later row of the chunk never overwrites a position an earlier row still sees.

A longer prompt chunk (GpuModel's prefill, up to `scratch` rows) writes its KV to the scratch
entries after the slots instead, [slots·S, slots·S + scratch), attends from there (and from the
ring for positions before the chunk), and copies its last W positions into the ring afterwards
(`StepIndex.ring_copy`); its compressors run the chunk's groups in parallel (compress_chunk).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsuf.model.config import ModelConfig
from dsuf.model.layers import Rope

from .attention import new_pool, pack_kv, sparse_attention
from .compressor import PARALLEL_MIN_ROWS, compress_chunk, compress_decode
from .dense import DENSE_MIN_ROWS
from .gemv import bf16_gemv, bf16_gemv_takes, fp8_grouped_gemv
from .indexer import INDEX_ENTRY_BYTES, index_query_fp4, index_scores, topk_indices
from .linear import Fp8Linear, act_quant
from .mhc import BlockInput, HcSite, hc_expand
from .moe import Fp4Experts, Fp8Expert, Moe
from .norm import Fp8Rows, rms_norm, rms_norm_fp8
from .peers import Peers
from .router import Router
from .runtime import get_kernel
from .tp import TensorParallel

STEP_KINDS = 3  # kernels_cu/step_index.cu: kinds of layer one step_indices launch serves
ROPE_PAIRS = 32  # and the RoPE's frequencies


def layer_kind(ratio: int) -> str:
    return "CSA" if ratio == 4 else "HCA" if ratio else "SWA"


def layer_rope(c: ModelConfig, ratio: int, device: torch.device) -> Rope:
    """The layer's rotary table, as v4.Attention builds it (compressed layers: YaRN on the
    compressed base), on the device."""
    if ratio:
        rope = Rope(c.rope_head_dim, c.compress_rope_theta, (c.rope_factor, c.original_seq_len, c.beta_fast, c.beta_slow))
    else:
        rope = Rope(c.rope_head_dim, c.rope_theta)
    rope.freqs = rope.freqs.to(device)
    return rope


def compressor_state(slots: int, ratio: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty compressor state per slot (CompressorState's layout): kv 0, score -inf."""
    coff = 2 if ratio == 4 else 1
    shape = (slots, coff * ratio, coff * width)
    return torch.zeros(shape, device=device), torch.full(shape, float("-inf"), device=device)


# Rows of one sequence a step may hold: a prompt chunk reads the MoE weights once. Prompts shorter than
# this are one step graph; at 2048 rather than 512, prompts of 600-2000 tokens ran 6-95 % faster than on
# the eager chunk path, whose host launches bind them (BENCHMARKS.md, session 43).
PREFILL_CHUNK = 2048


def ring_size(c: ModelConfig) -> int:
    return c.window_size + PREFILL_CHUNK


@dataclass
class LayerCache:
    """One layer's decode state for `slots` sequences (see the module docstring)."""

    ratio: int
    slots: int
    n_max: int  # compressed entries a sequence can have: max_context // ratio
    pool: torch.Tensor  # uint8 [slots * stride + scratch, 584]
    stride: int  # pool entries a slot: the ring, then the compressed entries
    scratch: int  # entries after the slots for a prefill chunk's KV
    comp_kv: torch.Tensor | None = None  # float32 [slots, coff·ratio, coff·512]
    comp_score: torch.Tensor | None = None
    keys: torch.Tensor | None = None  # uint8 [slots * n_max, 68] (CSA)
    idx_kv: torch.Tensor | None = None  # float32 [slots, 8, 256] (CSA's indexer compressor)
    idx_score: torch.Tensor | None = None

    @staticmethod
    def new(c: ModelConfig, ratio: int, slots: int, max_context: int, device: torch.device, scratch: int = 0) -> LayerCache:
        n_max = max_context // ratio if ratio else 0
        stride = ring_size(c) + n_max
        cache = LayerCache(ratio, slots, n_max, new_pool(slots * stride + scratch, device), stride, scratch)
        if ratio:
            cache.comp_kv, cache.comp_score = compressor_state(slots, ratio, c.head_dim, device)
        if ratio == 4:
            cache.keys = torch.zeros((slots * n_max, INDEX_ENTRY_BYTES), dtype=torch.uint8, device=device)
            cache.idx_kv, cache.idx_score = compressor_state(slots, 4, c.index_head_dim, device)
        return cache

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.pool, self.comp_kv, self.comp_score, self.keys, self.idx_kv, self.idx_score) if t is not None)

    def chunk_at(self, first: int, rows: int) -> tuple[int, int]:
        """step_index's `chunk` for a prefill chunk of `rows` rows from position `first`."""
        if rows > self.scratch:
            raise ValueError(f"a prefill chunk of {rows} rows exceeds the {self.scratch} scratch entries")
        return self.slots * self.stride, first

    def window(self, c: ModelConfig, slot: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last W positions before `pos` of the sequence in `slot`: their rows in the
        reference's window ring (position % W) and their pool entries (int32, on the pool's device)."""
        q = torch.arange(max(0, pos - c.window_size), pos)
        return q % c.window_size, (slot * self.stride + q % ring_size(c)).to(self.pool.device, torch.int32)

    def reset(self, slot: int) -> None:
        """Empty the compressor states of a slot for a new sequence."""
        for kv, score in ((self.comp_kv, self.comp_score), (self.idx_kv, self.idx_score)):
            if kv is not None:
                kv[slot].zero_()
                score[slot].fill_(float("-inf"))


@dataclass
class StepIndex:
    """Where one step's rows read and write in the caches of one kind of layer (by ratio),
    computed on the device from the rows' slots and positions."""

    positions: torch.Tensor  # int32 [B]
    cos: torch.Tensor  # float32 [B, 32]: RoPE of each row's position
    sin: torch.Tensor
    window_slot: torch.Tensor  # int32 [B]: the pool entry this step's KV goes to
    attn_idx: torch.Tensor  # int32 [B, W + K]: window entries, then compressed (-1: none)
    comp_slot: torch.Tensor | None = None  # int32 [B]: the entry a completed group goes to
    comp_base: torch.Tensor | None = None  # int32 [B]: pool entry of the row's compressed entry 0
    key_row: torch.Tensor | None = None  # int64 [B]: the index key a completed group goes to
    key_start: torch.Tensor | None = None  # int32 [B]
    n_keys: torch.Tensor | None = None  # int32 [B]: index keys visible to the row
    max_keys: int | None = None  # a bound on n_keys (None: the cache's n_max)
    chunk_start: int | None = None  # a prefill chunk's first position (its rows are one sequence's)
    ring_copy: tuple[torch.Tensor, torch.Tensor] | None = None  # a prefill chunk's last W entries: (from, to)
    attn_used: torch.Tensor | None = None  # int32 [B]: the row's slots of attn_idx from this on are -1


_IOTAS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def iota(n: int, device: torch.device, start: int = 0) -> torch.Tensor:
    """start .. start + n - 1, int32 on the device, made once outside graph capture: made in a
    captured step it would be a kernel of every replay (a step's indices are ~60 small kernels)."""
    key = (n, start, device)
    t = _IOTAS.get(key)
    if t is None:
        t = torch.arange(start, start + n, dtype=torch.int32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _IOTAS[key] = t
    return t


def step_index(c: ModelConfig, ratio: int, n_max: int, rope: Rope, slots: torch.Tensor, pos: torch.Tensor,
               chunk: tuple[int, int] | None = None, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> StepIndex:
    """slots, pos: int64 or int32 [B] on the device (pos = the position of the token each row
    feeds). chunk = (first scratch entry, first position): the rows are a prefill chunk of one
    sequence at consecutive positions, whose KV goes to the scratch entries (see the module
    docstring). cos_sin: rope.cos_sin(pos) if the caller has it (layers of one kind share it).
    Computed in int32 (every entry fits) with as few launches as the rules allow: in a decode step
    each is a kernel of the step's graph."""
    w, ring = c.window_size, ring_size(c)
    slots, pos = slots.int(), pos.int()
    base = slots * (ring + n_max)
    seen = pos[:, None] + iota(w, pos.device, 1 - w)[None, :]  # the window's positions
    window = (base[:, None] + seen % ring).masked_fill_(seen < 0, -1)  # (where(.., -1) makes its -1 in a launch)
    write = base + pos % ring
    ring_copy = None
    if chunk is not None:
        scratch, first = chunk
        window = torch.where(seen >= first, scratch + seen - first, window)
        write = scratch + pos - first
        tail = pos[-w:]
        ring_copy = (scratch + tail - first, base[-w:] + tail % ring)
    cos, sin = cos_sin if cos_sin is not None else rope.cos_sin(pos)
    chunk_start = chunk[1] if chunk else None
    if not ratio:
        return StepIndex(pos, cos, sin, write, window, ring_copy=ring_copy, chunk_start=chunk_start)
    group = pos // ratio
    visible = (pos + 1) // ratio  # entries visible once this token is in
    comp_base = base + ring
    idx = StepIndex(pos, cos, sin, write, window, comp_base + group, comp_base, ring_copy=ring_copy, chunk_start=chunk_start)
    # A chunk's rows see at most the entries its last row sees (known here, unlike in a graph).
    most = n_max if chunk is None else max(1, (chunk[1] + pos.shape[0]) // ratio)
    # The compressed slots a row fills: its visible entries (CSA: the top-k picks among them).
    idx.attn_used = w + visible.clamp_max(c.index_topk if ratio == 4 else most)
    if ratio == 4:
        picks = torch.full((pos.shape[0], c.index_topk), -1, dtype=torch.int32, device=pos.device)  # top-k fills them
        idx.attn_idx = torch.cat((window, picks), dim=1)
        idx.key_start = slots * n_max
        idx.key_row = (idx.key_start + group).long()
        idx.n_keys = visible
        idx.max_keys = most
    else:
        e = iota(most, pos.device)
        idx.attn_idx = torch.cat((window, (comp_base[:, None] + e[None, :]).masked_fill_(e[None, :] >= visible[:, None], -1)), dim=1)
    return idx


class _StepKind(ctypes.Structure):
    """Mirror of `struct StepKind` in kernels_cu/step_index.cu."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("attn_idx", "window_slot", "comp_slot", "comp_base", "attn_used", "key_start", "n_keys", "key_row")] + [
        (name, ctypes.c_int) for name in ("ratio", "n_max", "cols")
    ]


class _StepIndexParams(ctypes.Structure):
    """Mirror of `struct StepIndexParams` in kernels_cu/step_index.cu."""

    _fields_ = [("slots", ctypes.c_void_p), ("pos", ctypes.c_void_p), ("positions", ctypes.c_void_p), ("freqs", ctypes.c_void_p * 2),
                ("cos", ctypes.c_void_p * 2), ("sin", ctypes.c_void_p * 2), ("kind", _StepKind * STEP_KINDS)] + [
        (name, ctypes.c_int) for name in ("window", "ring", "topk", "kinds")
    ]


def step_indices(c: ModelConfig, kinds: list[tuple[int, int, Rope]], slots: torch.Tensor, pos: torch.Tensor) -> dict[int, StepIndex]:
    """step_index of a decode step for each kind of layer (ratio, n_max, its RoPE), in one launch
    (kernels_cu/step_index.cu): the same tensors, bit for bit, where the torch ops are ~60 kernels
    of the step's graph. slots, pos: int64 [B] on the GPU; layers of ratio 0 share one RoPE table,
    compressed layers the other (layer_rope)."""
    if not 1 <= len(kinds) <= STEP_KINDS or slots.dtype != torch.int64 or pos.dtype != torch.int64:
        raise ValueError(f"step_indices: 1 to {STEP_KINDS} kinds of layer and int64 slots and positions")
    if any(rope.dim != 2 * ROPE_PAIRS or rope.freqs.dtype != torch.float32 for _, _, rope in kinds):
        raise ValueError(f"step_indices: RoPE tables of {ROPE_PAIRS} float32 frequencies")
    rows, device, w = pos.shape[0], pos.device, c.window_size
    p = _StepIndexParams(slots=slots.contiguous().data_ptr(), pos=pos.contiguous().data_ptr(), window=w, ring=ring_size(c), topk=c.index_topk, kinds=len(kinds))
    positions = torch.empty(rows, dtype=torch.int32, device=device)
    p.positions = positions.data_ptr()
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for ratio, _, rope in kinds:
        r = int(ratio != 0)
        if r not in tables:
            tables[r] = (torch.empty((rows, rope.dim // 2), dtype=torch.float32, device=device), torch.empty((rows, rope.dim // 2), dtype=torch.float32, device=device))
            p.freqs[r], p.cos[r], p.sin[r] = rope.freqs.data_ptr(), tables[r][0].data_ptr(), tables[r][1].data_ptr()

    def ints(n: int = rows) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, device=device)

    out = {}
    for k, (ratio, n_max, _) in enumerate(kinds):
        cols = w + (c.index_topk if ratio == 4 else n_max if ratio else 0)
        ix = StepIndex(positions, *tables[int(ratio != 0)], ints(), torch.empty((rows, cols), dtype=torch.int32, device=device))
        kind = p.kind[k]
        kind.attn_idx, kind.window_slot, kind.ratio, kind.n_max, kind.cols = ix.attn_idx.data_ptr(), ix.window_slot.data_ptr(), ratio, n_max, cols
        if ratio:
            ix.comp_slot, ix.comp_base, ix.attn_used = ints(), ints(), ints()
            kind.comp_slot, kind.comp_base, kind.attn_used = ix.comp_slot.data_ptr(), ix.comp_base.data_ptr(), ix.attn_used.data_ptr()
        if ratio == 4:
            ix.key_start, ix.n_keys, ix.key_row, ix.max_keys = ints(), ints(), torch.empty(rows, dtype=torch.int64, device=device), n_max
            kind.key_start, kind.n_keys, kind.key_row = ix.key_start.data_ptr(), ix.n_keys.data_ptr(), ix.key_row.data_ptr()
        out[ratio] = ix
    widest = max(ix.attn_idx.shape[1] for ix in out.values())
    get_kernel("step_index", "step_indices", device)((math.ceil(widest / 256), rows, len(kinds)), 256, [p])
    return out


@dataclass
class Stage:
    name: str
    by: str  # "kernels", "torch", or a mix
    run: Callable[[dict], None]


# A stage may leave work running on another stream, recorded in the buffer dict as an event under
# a key ending in READY; the stage that uses its results waits for it (wait_for).
READY = " ready"


def wait_for(b: dict, key: str) -> None:
    """The current stream waits for the event b[key], if a stage left one (and forgets it)."""
    event = b.pop(key, None)
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


def join_all(b: dict) -> None:
    """The current stream waits for all work stages left on other streams (a stage captured alone)."""
    for key in [k for k in b if k.endswith(READY)]:
        wait_for(b, key)


def has_mm_out_dtype(device: torch.device) -> bool:
    """Whether this torch multiplies bf16 matrices into float32 (torch.mm(..., out_dtype=))."""
    try:
        torch.mm(torch.ones(2, 8, dtype=torch.bfloat16, device=device), torch.ones(8, 2, dtype=torch.bfloat16, device=device), out_dtype=torch.float32)
        return True
    except (TypeError, RuntimeError):
        return False


class DecodeLayer:
    """One decode layer on the GPU path: the kernels of dsuf.gpu where they exist, torch for the
    compressors' projections (cuBLAS is as fast as our GEMV there). With `tp`, `t` holds this
    rank's shard (tp.shard) and the attention and MoE outputs are all-reduced."""

    def __init__(self, c: ModelConfig, layer: int, t: dict[str, torch.Tensor], device: torch.device, tp: TensorParallel | None = None,
                 prefix: str | None = None) -> None:
        """prefix: the block's checkpoint prefix where it is not a backbone layer's (the MTP
        layer's "mtp.0": a window-only block, ids `layer` = n_layers in the buffer keys)."""
        p = prefix or f"layers.{layer}"
        a, f = f"{p}.attn", f"{p}.ffn"
        self.c, self.layer, self.ratio, self.tp = c, layer, 0 if prefix else c.compress_ratios[layer], tp
        self.heads = c.n_heads // (tp.world if tp else 1)  # this rank's query heads
        self.hash = c.is_hash_layer(layer)
        self.hc_attn, self.hc_ffn = (
            HcSite(t[f"{p}.hc_{s}_fn"], t[f"{p}.hc_{s}_base"], t[f"{p}.hc_{s}_scale"], c.norm_eps, c.hc_eps, c.hc_sinkhorn_iters) for s in ("attn", "ffn")
        )
        self.attn_norm, self.ffn_norm = t[f"{p}.attn_norm.weight"].float(), t[f"{p}.ffn_norm.weight"].float()

        def fp8(name: str) -> Fp8Linear:
            return Fp8Linear(t[f"{name}.weight"], t[f"{name}.scale"])

        self.wq_a, self.wq_b, self.wkv, self.wo_b = fp8(f"{a}.wq_a"), fp8(f"{a}.wq_b"), fp8(f"{a}.wkv"), fp8(f"{a}.wo_b")
        self.q_norm, self.kv_norm = t[f"{a}.q_norm.weight"].float(), t[f"{a}.kv_norm.weight"].float()
        self.sink = t[f"{a}.attn_sink"].float()
        # wo_a: the reference dequantises it to bf16 for a grouped bf16 matmul; the kernel reads
        # the FP8 weight and dequantises exactly in registers.
        self.wo_a = (t[f"{a}.wo_a.weight"], t[f"{a}.wo_a.scale"])
        self.rope = layer_rope(c, self.ratio, device)
        # Every bf16 projection of the attention input in one matrix: the compressor's wkv, wgate,
        # the indexer compressor's wkv, wgate and the indexer's weights_proj.
        names = []
        if self.ratio:
            names += [f"{a}.compressor.wkv", f"{a}.compressor.wgate"]
            self.ape, self.comp_norm = t[f"{a}.compressor.ape"].float(), t[f"{a}.compressor.norm.weight"].float()
        if self.ratio == 4:
            names += [f"{a}.indexer.compressor.wkv", f"{a}.indexer.compressor.wgate", f"{a}.indexer.weights_proj"]
            self.idx_ape, self.idx_norm = t[f"{a}.indexer.compressor.ape"].float(), t[f"{a}.indexer.compressor.norm.weight"].float()
            self.idx_wq_b = fp8(f"{a}.indexer.wq_b")
        self.proj_split = [t[f"{n}.weight"].shape[0] for n in names]
        self.mm_out_dtype = has_mm_out_dtype(device)
        if names:
            proj = torch.cat([t[f"{n}.weight"] for n in names])
            self.proj = proj if self.mm_out_dtype else proj.float()
            self.proj_gemv = bf16_gemv_takes(self.proj)
        self.router = Router(t[f"{f}.gate.weight"], t.get(f"{f}.gate.bias"), t.get(f"{f}.gate.tid2eid"), c.n_activated_experts, c.route_scale)
        w1, s1, w3, s3, w2, s2 = (stacked_experts(t, f, w, k) for w in ("w1", "w3", "w2") for k in ("weight", "scale"))
        shared = [t[f"{f}.shared_experts.{w}.{k}"] for w in ("w1", "w3", "w2") for k in ("weight", "scale")]
        self.sides: dict[str, torch.cuda.Stream] = {}  # streams for work alongside the main chain, by purpose
        self.moe = Moe(Fp4Experts.from_checkpoint(w1, s1, w3, s3, w2, s2), Fp8Expert(*shared), c.swiglu_limit)

    def _alongside(self, purpose: str, run: Callable[[], None], reads: list[torch.Tensor]) -> torch.cuda.Stream:
        """Queue `run` on the side stream for `purpose`, after what the current stream has queued;
        `reads`: the current stream's tensors it reads. Returns the stream, to be waited on."""
        main = torch.cuda.current_stream()
        if purpose not in self.sides:
            self.sides[purpose] = torch.cuda.Stream(main.device)
        side = self.sides[purpose]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            run()
        for t in reads:
            t.record_stream(side)
        return side

    def torch_parts(self) -> list[str]:
        parts = []
        if self.ratio:
            parts.append(f"compressor projections ({'torch.mm bf16 -> fp32' if self.mm_out_dtype else 'fp32 matmul'}{', bf16_gemv for one token' if self.proj_gemv else ''})")
        return parts

    def _project(self, y: torch.Tensor) -> list[torch.Tensor]:
        """The bf16 projections of y in float32, split per weight."""
        if y.shape[0] == 1 and self.proj_gemv:  # (a TP=2 rank's step: 64k -1.9 %, 4k -0.3 %; at 8 tokens cuBLAS is faster)
            out = bf16_gemv(y, self.proj)
        else:
            out = torch.mm(y, self.proj.t(), out_dtype=torch.float32) if self.mm_out_dtype else y.float() @ self.proj.t()
        return list(out.split(self.proj_split, dim=1))

    def _sender(self, tokens: int) -> Peers | None:
        """The peers to whom the kernel making this rank's part of a sublayer's output pushes it
        (collective.sender), or None (also from DENSE_MIN_ROWS tokens: see _sum_expand)."""
        return self.tp.collective.sender(tokens * self.c.dim * 2) if self.tp and tokens < DENSE_MIN_ROWS else None

    def _block_input(self, site: HcSite, b: dict, x: torch.Tensor, norm: torch.Tensor) -> tuple[BlockInput, torch.Tensor, Fp8Rows]:
        """A site's block input from the streams x, and the block's input y and its FP8 rows for
        every row of the step: where the step's rows are split over the ranks (b["split"]), this
        rank's rows gathered with the others' (and quantised once whole)."""
        if not b.get("split"):
            own = site.block_input(x, norm, self.c.norm_eps)
            return own, own.y, own.yq
        own = site.block_input(x, norm, self.c.norm_eps, fp8=False)
        y = self.tp.collective.all_gather_rows(own.y)
        return own, y, act_quant(y)

    def _own(self, b: dict, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor of the step's rows where the rows are split (b["split"]), else t."""
        return self.tp.own_rows(t) if b.get("split") else t

    def _route(self, b: dict, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts (weights, idx) of the block inputs y: where the rows are split over the
        ranks (y this rank's), each routes its own and the routes are gathered."""
        if not b.get("split"):
            return self.router(y, b["ids"])
        weights, idx = self.router(y, self._own(b, b["ids"]))
        both = self.tp.collective.all_gather_rows(torch.cat((weights, idx.view(torch.float32)), dim=1))  # one gather
        k = weights.shape[1]
        return both[:, :k].contiguous(), both[:, k:].contiguous().view(torch.int32)

    def _sum_expand(self, partial: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                    pushed: bool = False, split: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A sublayer's output (the ranks' partial outputs summed, in one kernel with the update)
        and the mHC update of the streams x with it. pushed: partial's kernel pushed it (_sender).
        split: the streams are this rank's share of the rows (b["split"]): the sum of those rows."""
        if split:
            own = self.tp.collective.reduce_scatter(partial)
            return own, hc_expand(own, x, post, comb)
        if self.tp and partial.shape[0] < DENSE_MIN_ROWS:
            return self.tp.collective.all_reduce_expand(partial, x, post, comb, pushed)
        # Many rows (a short prompt's step): the collective's few CTAs would take ~20x hc_expand's
        # time over the update's stream traffic (BENCHMARKS milestone 34), so only the sum is theirs.
        total = self.tp.collective.all_reduce(partial) if self.tp else partial
        return total, hc_expand(total, x, post, comb)

    def stages(self, cache: LayerCache, ix: StepIndex) -> list[Stage]:
        """The decode step of this layer as stages over a buffer dict: reads f"x{layer}" (bf16
        [B, 4, D]), "ids" (int64 [B]), "slots" and "pos" (int64 [B]) and, where rows of one
        sequence share the step, "runs" (int32, compress_decode's); writes f"x{layer + 1}". With
        "split" true (a prompt chunk split by rows over the ranks, GpuModel._layers), the streams
        are this rank's share of the rows and everything between the mHC sites sees every row.
        In-place ops touch only tensors made in the same stage (and the caches), so any stage can
        be replayed alone; what a stage leaves running on another stream (the mHC sites'
        Sinkhorn) is marked in the buffer and awaited by a later stage, at the latest by the one
        that uses it (wait_for)."""
        c, L, ratio = self.c, self.layer, self.ratio
        heads, hd = self.heads, c.head_dim
        kind = layer_kind(ratio)

        def mhc_attn(b: dict) -> None:
            site, b[f"{L}.y"], b[f"{L}.yq"] = self._block_input(self.hc_attn, b, b[f"x{L}"], self.attn_norm)
            b[f"{L}.post"], b[f"{L}.comb"] = site.post, site.comb
            if site.ready is not None:
                b[f"{L}.comb{READY}"] = site.ready

        def compress(b: dict) -> list[torch.cuda.Stream]:
            """The projections, then the KV compressor; the index compressor (CSA) on a stream of
            its own (the two are independent). Returns the streams left to wait for."""
            def run(kv: torch.Tensor, score: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], ape: torch.Tensor, norm: torch.Tensor,
                    pool: torch.Tensor, dst: torch.Tensor) -> None:
                if ix.chunk_start is None:
                    compress_decode(kv, score, ix.positions, *state, ape, norm, self.rope.freqs, c.norm_eps, pool, dst,
                                    state_rows=b["slots"], runs=b.get("runs"), groups_in_parallel=kv.shape[0] >= PARALLEL_MIN_ROWS)
                else:
                    compress_chunk(kv, score, ix.chunk_start, *state, b["slots"][:1], ape, norm, self.rope.freqs, c.norm_eps, pool, dst)

            parts = self._project(b[f"{L}.y"])
            later = []
            if ratio == 4:
                later.append(self._alongside("index compressor", lambda: run(parts[2], parts[3], (cache.idx_kv, cache.idx_score), self.idx_ape,
                                                                             self.idx_norm, cache.keys, ix.key_row), parts[2:4]))
                b[f"{L}.weights"] = parts[4]  # weights_proj(y) in float32; index_scores rounds it to bf16 and scales it
            run(parts[0], parts[1], (cache.comp_kv, cache.comp_score), self.ape, self.comp_norm, cache.pool, ix.comp_slot)
            return later

        # The indexer's queries, scores and top-k are per row: where the rows are split over the
        # ranks, each picks for its own rows (_own) and the picks are gathered.
        def index_query(b: dict) -> None:
            qr = [self._own(b, t) for t in b[f"{L}.qr_q"]]
            qi = self.idx_wq_b.forward_quantized(*qr).view(qr[0].shape[0], c.index_n_heads, c.index_head_dim)
            b[f"{L}.qi"] = index_query_fp4(qi, self._own(b, ix.cos), self._own(b, ix.sin))

        def index_select(b: dict) -> None:
            def own(t: torch.Tensor) -> torch.Tensor:
                return self._own(b, t)

            scores = index_scores(*b[f"{L}.qi"], own(b[f"{L}.weights"]), cache.keys, own(ix.key_start), own(ix.n_keys), ix.max_keys or cache.n_max,
                                  weight_scale=c.index_head_dim**-0.5 * c.index_n_heads**-0.5, weights_bf16=True)
            topk_indices(scores, own(ix.n_keys), c.index_topk, out=own(ix.attn_idx), out_col=c.window_size, offset=own(ix.comp_base))
            if b.get("split"):
                ix.attn_idx.copy_(self.tp.collective.all_gather_rows(own(ix.attn_idx)))

        def attend(b: dict) -> None:
            b[f"{L}.o"] = sparse_attention(b[f"{L}.q"], cache.pool, ix.attn_idx, self.sink, hd**-0.5, inverse_rope=(ix.cos, ix.sin), used=ix.attn_used)
            if ix.ring_copy is not None:  # every row has attended: the chunk's last W positions join the ring
                src, dst = ix.ring_copy
                cache.pool[dst.long()] = cache.pool[src.long()]

        def wo_a(b: dict) -> None:
            b[f"{L}.oa"] = fp8_grouped_gemv(b[f"{L}.o"].view(b[f"{L}.o"].shape[0], -1), *self.wo_a, c.o_groups * heads // c.n_heads)

        def wo_b_expand(b: dict) -> None:
            wait_for(b, f"{L}.comb{READY}")
            b[f"{L}.attn"], b[f"{L}.xa"] = self._sum_expand(self.wo_b(b[f"{L}.oa"]), b[f"x{L}"], b[f"{L}.post"], b[f"{L}.comb"], split=b.get("split", False))

        def mhc_ffn_route(b: dict) -> None:
            site, b[f"{L}.y2"], b[f"{L}.y2q"] = self._block_input(self.hc_ffn, b, b[f"{L}.xa"], self.ffn_norm)
            b[f"{L}.post2"], b[f"{L}.comb2"] = site.post, site.comb
            if site.ready is not None:
                b[f"{L}.comb2{READY}"] = site.ready
            if not self.moe.decodes(b[f"{L}.y2"].shape[0]):  # a prompt chunk (split or not): the MoE runs its shared expert itself
                b[f"{L}.route"] = self._route(b, site.y)
                return
            scores = self.router.scores(site.y)
            # The shared expert needs no routing: queued here it streams its weights beside the
            # selection (one CTA); queued before the scores it slowed them, queued after the
            # selection it ended after the routed w2 (BENCHMARKS milestones 20 and 27).
            b[f"{L}.shared"], b[f"{L}.shared{READY}"] = self.moe.shared_alongside(*b[f"{L}.y2q"])
            b[f"{L}.route"] = self.router.select(scores, b["ids"])

        def moe_expand(b: dict) -> None:
            # The site's Sinkhorn (for the expand) is joined with the shared expert, before the
            # combine: joined here, it would hold the routed gate/up's launch until it ended.
            sinkhorn = b.pop(f"{L}.comb2{READY}", None)
            shared = (b[f"{L}.shared"], b.pop(f"{L}.shared{READY}", None)) if f"{L}.shared" in b else None
            split = b.get("split", False)
            to = None if split else self._sender(b[f"{L}.y2"].shape[0])
            moe = self.moe(b[f"{L}.y2"], *b[f"{L}.route"], xq=b[f"{L}.y2q"], joins=(sinkhorn,) if sinkhorn is not None else (), shared=shared, to=to)
            b[f"{L}.moe"], b[f"x{L + 1}"] = self._sum_expand(moe, b[f"{L}.xa"], b[f"{L}.post2"], b[f"{L}.comb2"], pushed=to is not None, split=split)

        def attention_inputs(b: dict) -> None:
            # q on this stream; alongside, each a chain of small latency-bound launches that leaves
            # the GPU mostly idle: the window's KV, the compressors (compressed layers) and, once qr
            # is made, the indexer's query (CSA). All joined before the stage ends.
            y = b[f"{L}.y"]
            main, rows = torch.cuda.current_stream(y.device), y.shape[0]
            sides, later = [], []
            if ratio:
                sides.append(self._alongside("compressors", lambda: later.extend(compress(b)), [y]))
                sides += later
            xq, sx = b[f"{L}.yq"]

            def window_kv() -> None:
                kv = rms_norm(self.wkv.forward_quantized(xq, sx), self.kv_norm, c.norm_eps, rope=(ix.cos, ix.sin))
                pack_kv(kv, cache.pool, ix.window_slot)

            sides.append(self._alongside("kv", window_kv, [xq, sx]))
            b[f"{L}.qr_q"] = rms_norm_fp8(self.wq_a.forward_quantized(xq, sx), self.q_norm, c.norm_eps)
            if ratio == 4:
                sides.append(self._alongside("indexer", lambda: index_query(b), b[f"{L}.qr_q"]))
            b[f"{L}.q"] = rms_norm(self.wq_b.forward_quantized(*b[f"{L}.qr_q"]).view(rows, heads, hd), None, c.norm_eps, rope=(ix.cos, ix.sin))
            for side in sides:
                main.wait_stream(side)
            # The site's Sinkhorn too, which only wo_b's mHC expand reads: the kernel after a join
            # starts only once its predecessor ends (no PDL overlap), and here that kernel is
            # behind a join already; at wo_b it would be wo_b, whose weights would then be posted late.
            wait_for(b, f"{L}.comb{READY}")
            if ratio == 4:
                for t in (b[f"{L}.weights"], *b[f"{L}.qi"]):  # made on the side streams, read here
                    t.record_stream(main)

        out = [Stage(f"L{L} mHC mixes + collapse + norm (Sinkhorn alongside)", "kernels", mhc_attn)]
        compressors = f"the {kind} compressor{'s' if ratio == 4 else ''} (projections; pooling, norm, RoPE, entry write)" if ratio else ""
        index_query_note = "the indexer query (wq_b; RoPE, Hadamard, FP4)" if ratio == 4 else ""
        alongside = ", ".join(part for part in ("the kv projection, norm, RoPE and window write", compressors, index_query_note) if part)
        out.append(Stage(f"L{L} q projections, norms, RoPE; alongside, {alongside}", "kernels + torch" if ratio else "kernels", attention_inputs))
        if ratio == 4:
            out.append(Stage(f"L{L} index scores + top-{c.index_topk}", "kernels", index_select))
        out += [
            Stage(f"L{L} sparse attention ({kind}) + inverse RoPE", "kernels", attend),
            Stage(f"L{L} wo_a (FP8 grouped GEMV)", "kernels", wo_a),
            Stage(f"L{L} wo_b + mHC expand", "kernels", wo_b_expand),
            Stage(f"L{L} mHC mixes + collapse + norm (Sinkhorn alongside) + router{' (hash)' if self.hash else ''}", "kernels", mhc_ffn_route),
            Stage(f"L{L} MoE (6 routed FP4 + shared FP8) + mHC expand", "kernels", moe_expand),
        ]
        return out


def stacked_experts(t: dict[str, torch.Tensor], ffn: str, w: str, kind: str) -> torch.Tensor:
    """The routed experts' `w` tensors stacked [E, ...] (random weights keep them stacked already)."""
    stacked = t.get(f"{ffn}.experts.stacked.{w}.{kind}")
    if stacked is not None:
        return stacked
    e = 0
    parts = []
    while (part := t.get(f"{ffn}.experts.{e}.{w}.{kind}")) is not None:
        parts.append(part)
        e += 1
    return torch.stack(parts)
