"""V4-Flash on one GPU: the worker's model when it serves with `--gpu`.

It answers the reference model's serving interface (`new_state`, `forward_batch`, `free`, and
`export_state` / `import_state` for conversation caches), so the worker and the scheduler do not
care which path runs. Sequences live in slots of preallocated caches (`layer.LayerCache`) of
`max_batch` sequences of up to `max_context` tokens; slot 0 is scratch for padding rows.

A step feeds one token to each of B rows, every row at its own position; the rows of one
sequence (up to PREFILL_CHUNK of a prompt, at consecutive positions) sit side by side in position
order. The step (index computation, embedding, the layers, the head) is captured as one CUDA
graph per row-count bucket on first use and replayed after: the host only copies the rows' token
ids, slots, positions and runs in and the logits it samples from out.

A prompt of PREFILL_MIN tokens or more is prefilled on its own first, in chunks of up to
`prefill_rows` rows run eagerly (no graph: a chunk's launches are few against its work): its
matmuls on the tensor cores over bf16 weight copies (dense.py), its KV through the caches'
scratch entries, its compressors' groups in parallel (layer.py).

Speculative decoding (dsuf.model.speculative): `verify_batch` feeds a sequence's token and its MTP
draft as two rows of one step (with `ahead`, both still on the device: the worker's look-ahead),
`take_back` forgets a rejected draft's row (or a look-ahead's two), and `mtp_forward` runs the MTP
layer (a window-only block with its own cache; a decode step's one or two rows replay a graph)
for the next draft.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsuf.model.config import ModelConfig
from dsuf.model.layers import Numerics
from dsuf.model.speculative import Verified
from dsuf.model.state import CompressorState, LayerState, SequenceState, StateError

from .attention import pack_kv, unpack_kv
from .dense import DENSE_MIN_ROWS
from .indexer import pack_index_keys, unpack_index_keys
from .layer import PREFILL_CHUNK, DecodeLayer, LayerCache, StepIndex, has_mm_out_dtype, ring_size, step_index, step_indices
from .linear import Fp8Linear
from .moe import GROUPED_MIN_TOKENS
from .norm import hc_block_input, rms_norm
from .tp import TensorParallel, check_tp

# Where the model's tensors come from: source(None) -> the embedding, the head and their norms,
# source(i) -> layer i's, source(MTP) -> the MTP layer's (checkpoint names; a tensor-parallel
# rank's shard of them, see tp.shard).
TensorSource = Callable[[int | str | None], dict[str, torch.Tensor]]
HEAD_PREFIXES = ("embed.", "head.", "norm.", "hc_head_")
MTP = "mtp.0"


def taking_from(tensors: dict[str, torch.Tensor]) -> TensorSource:
    """A source that takes the tensors out of a dict as the model asks for them (so a converted
    layer's checkpoint tensors can be freed before the next is converted)."""

    def take(layer: int | str | None) -> dict[str, torch.Tensor]:
        prefixes = HEAD_PREFIXES if layer is None else (f"{layer}.",) if isinstance(layer, str) else (f"layers.{layer}.",)
        return {k: tensors.pop(k) for k in [k for k in tensors if k.startswith(prefixes)]}

    return take

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536)
PREFILL_MIN = PREFILL_CHUNK  # prompts this long are prefilled in large chunks, outside the step graphs (shorter: one step)
PREFILL_MAX = 8192  # rows of a prefill chunk
INDEX_SCORE_BYTES = 2 << 30  # a prefill chunk's index scores (float32 [rows, keys]) stay below this
SPLIT_CHUNKS = True  # split over ranks, a prompt chunk's streams are split by rows too (_layers; tests compare both ways)
DRAFT_GRAPH_ROWS = 2  # MTP drafts of up to this many rows (a decode step's one, or two after an accepted draft) replay graphs


def prefill_rows(max_context: int) -> int:
    """A prefill chunk's rows: as many as the index scores of its rows against every key allow."""
    return max(PREFILL_CHUNK, min(PREFILL_MAX, max_context, INDEX_SCORE_BYTES // (4 * max(1, max_context // 4))))


def new_caches(c: ModelConfig, max_batch: int, max_context: int, device: torch.device, mtp: bool) -> tuple[list[LayerCache], LayerCache | None]:
    """Every layer's caches of max_batch sequences (and slot 0, the scratch), and the MTP layer's."""
    slots = max_batch + 1
    caches = [LayerCache.new(c, c.compress_ratios[i], slots, max_context, device, scratch=prefill_rows(max_context)) for i in range(c.n_layers)]
    return caches, LayerCache.new(c, 0, slots, max_context, device) if mtp else None


def check_cache_room(c: ModelConfig, max_batch: int, max_context: int, mtp: bool, free: int, device: object = "the GPU") -> None:
    """Refuse, naming the largest --max-batch that fits, caches larger than the `free` bytes
    (e.g. a 1M-token context at the default batch: about 225 GiB a GPU)."""

    def need(batch: int) -> int:
        caches, mtp_cache = new_caches(c, batch, max_context, torch.device("meta"), mtp)
        return sum(cache.nbytes for cache in caches + ([mtp_cache] if mtp_cache else []))

    if need(max_batch) <= free:
        return
    fits = [b for b in range(1, max_batch) if need(b) <= free]
    advice = f"use --max-batch {fits[-1]} or less" if fits else "even one sequence does not fit"
    raise ValueError(f"caches for {max_batch} sequences of {max_context} tokens need {need(max_batch) / 2**30:.1f} GiB on {device}, "
                     f"which has {free / 2**30:.1f} GiB free after the weights: {advice}, or lower --max-model-len")


def step_rows(max_batch: int) -> int:
    """Rows a step holds at most: a decode token of every sequence, or a prompt chunk."""
    return max(max_batch, PREFILL_CHUNK)


# What the kernels are written for: V4-Flash's layer shapes (any number of layers, experts, vocabulary).
KERNEL_SHAPES = {"head_dim": 512, "n_heads": 64, "rope_head_dim": 64, "index_n_heads": 64, "index_head_dim": 128, "hc_mult": 4}


class Mtp:
    """The NextN MTP layer on the GPU (v4.MTPLayer): e = enorm(embed(next token)), h = hnorm of each
    stream, x = e_proj(e) + h_proj(h) on every stream, a window-only block, then its own mHC head
    and norm before the model's head."""

    def __init__(self, c: ModelConfig, t: dict[str, torch.Tensor], device: torch.device, tp: TensorParallel | None) -> None:
        p = MTP
        self.c = c
        self.e_proj, self.h_proj = (Fp8Linear(t[f"{p}.{n}.weight"], t[f"{p}.{n}.scale"]) for n in ("e_proj", "h_proj"))
        self.enorm, self.hnorm, self.norm = (t[f"{p}.{n}.weight"].float() for n in ("enorm", "hnorm", "norm"))
        self.hc_fn, self.hc_base, self.hc_scale = (t[f"{p}.hc_head_{k}"].float() for k in ("fn", "base", "scale"))
        self.layer = DecodeLayer(c, c.n_layers, t, device, tp, prefix=p)
        self.cache: LayerCache | None = None  # made with the model's caches

    def inputs(self, embedded: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The block's input streams bf16 [B, hc, D] from the next tokens' embeddings [B, D] and
        the main model's final streams [B, hc, D]: bf16 projections added in bf16, as the reference."""
        b, hc, d = streams.shape
        e = self.e_proj(rms_norm(embedded, self.enorm, self.c.norm_eps))
        h = self.h_proj(rms_norm(streams.reshape(b * hc, d).contiguous(), self.hnorm, self.c.norm_eps)).view(b, hc, d)
        return (e.unsqueeze(1) + h).contiguous()


def check_kernel_shapes(c: ModelConfig) -> None:
    """A one-line ValueError for a model the GPU kernels cannot run (e.g. the embedded tiny model)."""
    wrong = [f"{k} {getattr(c, k)} (needs {v})" for k, v in KERNEL_SHAPES.items() if getattr(c, k) != v]
    if c.dim % 2048 or c.moe_inter_dim % 128 or c.q_lora_rank % 128:
        wrong.append(f"dim {c.dim} / moe_inter_dim {c.moe_inter_dim} / q_lora_rank {c.q_lora_rank} (need multiples of 2048 / 128 / 128)")
    if c.family != "v4":
        wrong.append(f"family {c.family} (needs v4)")
    if wrong:
        raise ValueError(f"the GPU path runs V4-Flash's layer shapes; {c.name} has " + ", ".join(wrong))


class GpuSequence:
    """A sequence's place in the caches: its slot, how many tokens it has fed (`pos`), and up to
    which position the MTP layer's window holds its rows (`mtp_pos`: speculative decoding)."""

    def __init__(self, slot: int) -> None:
        self.slot, self.pos, self.mtp_pos = slot, 0, 0


class GpuModel:
    """Takes the tensors it uses (checkpoint names; the MTP layer's too, which `draft` runs) from `tensors`
    (a dict, emptied as they are converted, or a TensorSource). With `tp`, this is one rank of a
    tensor-parallel model: every rank is built, and steps, together."""

    def __init__(self, c: ModelConfig, tensors: dict[str, torch.Tensor] | TensorSource, device: torch.device, max_batch: int = 8,
                 max_context: int = 65536, graphs: bool = True, tp: TensorParallel | None = None) -> None:
        check_kernel_shapes(c)
        check_tp(c, tp.world if tp else 1)
        if max_context % 128 or max_context < 128:
            raise ValueError(f"max_context must be a positive multiple of 128, got {max_context}")
        self.config, self.device, self.max_batch, self.max_context, self.graphs, self.tp = c, device, max_batch, max_context, graphs, tp
        source = taking_from(tensors) if isinstance(tensors, dict) else tensors

        def take(layer: int | None) -> dict[str, torch.Tensor]:
            return {k: v.to(device) for k, v in source(layer).items()}

        head = take(None)
        self.embed, self.head = head["embed.weight"], head["head.weight"]
        self.norm = head["norm.weight"].float()
        self.hc_fn, self.hc_base, self.hc_scale = (head[f"hc_head_{k}"].float() for k in ("fn", "base", "scale"))
        if not has_mm_out_dtype(device):  # float32 logits need a float32 head then
            self.head = self.head.float()
        # Layer by layer, dropping each layer's checkpoint tensors once converted, so the weights
        # are never all held twice (the experts' kernel layout is a copy).
        self.layers = [DecodeLayer(c, i, take(i), device, tp) for i in range(c.n_layers)]
        self.mtp = Mtp(c, take(MTP), device, tp) if c.n_mtp_layers and c.dspark is None else None
        rows = step_rows(max_batch)
        # Every batch the MoE kernels may take: the step's rows, or a prefill chunk short of the
        # grouped path (the MTP layer's: a draft's rows, up to a window and one more).
        for layer in self.layers + ([self.mtp.layer] if self.mtp else []):
            layer.moe.reserve(max(rows, GROUPED_MIN_TOKENS - 1) * c.n_activated_experts)
        slots = max_batch + 1
        self.prefill_rows = prefill_rows(max_context)
        check_cache_room(c, max_batch, max_context, self.mtp is not None, torch.cuda.mem_get_info(device)[0], device)
        self.caches, mtp_cache = new_caches(c, max_batch, max_context, device, self.mtp is not None)
        if self.mtp:
            self.mtp.cache = mtp_cache
        self.free_slots = list(range(slots - 1, 0, -1))
        self.buckets = [b for b in BUCKETS if b < rows] + [rows]
        self.dev_in = torch.zeros((3, rows), dtype=torch.int64, device=device)  # ids, slots, positions
        self.dev_runs = torch.zeros(rows + 1, dtype=torch.int32, device=device)  # rows of run r: runs[r] .. runs[r + 1] - 1
        # Their pinned host copies: a step's inputs go over without waiting for the steps before.
        self.host_in, self.host_runs = self.dev_in.cpu().pin_memory(), self.dev_runs.cpu().pin_memory()
        self.staged = torch.cuda.Event()  # the last copy from them is done once this has passed
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}  # rows -> graph, logits, streams
        # Speculative decoding: the compressed layers' ratios, views of the slots' compressor
        # states (_states), an empty state row's score by width.
        self._ratios = sorted({layer.ratio for layer in self.layers if layer.ratio})
        self._state_views: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._neg_inf = {n: torch.full((n,), float("-inf"), device=device) for cache in self.caches if cache.comp_score is not None
                         for n in {cache.comp_score.shape[-1]} | ({cache.idx_score.shape[-1]} if cache.idx_score is not None else set())}
        self._draft_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # rows -> graph, streams, ids / slots / positions, logits
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        # Compile every kernel (NVRTC, cached on disk) and capture the batch-1 step now, so that the
        # worker says Ready only once the first request can run at full speed.
        if tp:
            tp.kernels_ready(device)
        if graphs:
            self._capture(self.buckets[0])
        else:
            self._step(self.buckets[0])

    # ---- sequences --------------------------------------------------------------------------------

    def new_state(self, num: Numerics | None = None) -> GpuSequence:
        if not self.free_slots:
            raise RuntimeError(f"all {self.max_batch} sequence slots of this worker are taken")
        seq = GpuSequence(self.free_slots.pop())
        for cache in self.caches:
            cache.reset(seq.slot)
        return seq

    def free(self, seq: GpuSequence) -> None:
        if seq.slot:
            self.free_slots.append(seq.slot)
            seq.slot = 0

    # ---- speculative decoding (dsuf.model.speculative) -------------------------------------------

    @torch.inference_mode()
    def verify_batch(self, batch: list[tuple[torch.Tensor, GpuSequence, int | torch.Tensor | None]], num: Numerics | None = None,
                     ahead: bool = False) -> list[Verified]:
        """Each sequence's tokens with its draft (where it has one) as one more row of the same
        step. A draft row leaves behind its window entry and its compressor state row, and where
        it completes a group also that group's entry and the states moved on (kernels_cu/
        compressor.cu). The entries are written again when the position is fed again (no snapshot
        holds them before); take_back empties the rows, or for a CSA group (overlapping: the
        completed group's rows live on as the previous group's) moves the rows back and puts back
        the previous group's rows, saved before the step (so the step's tokens must not complete
        one: at most 3 before a draft that does). No draft where it would complete an HCA group
        (whose completion clears the rows of the tokens before it) or the context has no room.

        `ahead` (the worker's look-ahead): one token a sequence, int64 [1] on the device, and the
        drafts too (sampled and drafted, not read yet): one step queued without waiting for them.
        Its Verified also holds `retract`, take_back's undo of both rows (None where the token's
        own row completes an HCA group)."""
        def room(p: int, tokens: int) -> bool:  # for a draft row at position p after `tokens` rows
            return p < self.max_context and not self._completes_hca(p) and not ((p + 1) % 4 == 0 and tokens > 3)

        if ahead:
            return self._verify_ahead([(token, seq, draft if room(seq.pos + 1, 1) else None) for token, seq, draft in batch])
        batch = [(tokens, seq, int(draft) if draft is not None and room(seq.pos + len(tokens), len(tokens)) else None) for tokens, seq, draft in batch]
        undo = [(seq.pos + len(tokens), self._saved_states(seq, seq.pos + len(tokens), 1)) if draft is not None else None for tokens, seq, draft in batch]
        fed = self._feed([(torch.cat((tokens.view(-1), torch.tensor([draft] if draft is not None else [], dtype=tokens.dtype))), seq)
                          for tokens, seq, draft in batch], last=[1 + (draft is not None) for _, _, draft in batch], tail=self.config.window_size + 1)
        return [Verified(logits, streams, u) for (logits, streams), u in zip(fed, undo)]

    def _verify_ahead(self, batch: list[tuple[torch.Tensor, GpuSequence, torch.Tensor | int | None]]) -> list[Verified]:
        self._check_room([(token.view(-1), seq) for token, seq, _ in batch])
        if not all(token.is_cuda and token.numel() == 1 for token, _, _ in batch) or len(batch) > self.max_batch:
            raise ValueError(f"a look-ahead feeds one token on the device a sequence (at most {self.max_batch} sequences)")
        rows, ids, spans = [], [], []
        for token, seq, draft in batch:
            n, p = 1 + (draft is not None), seq.pos
            spans.append((len(rows), n, p, self._saved_states(seq, p, n)))
            rows += [(seq.slot, p + j, 0) for j in range(n)]
            ids += [token.view(1)] + ([torch.as_tensor(draft).view(1).to(self.device)] if draft is not None else [])
            seq.pos += n
        logits, streams = self.step(rows, ids=torch.cat(ids).to(torch.int64))
        return [Verified(logits[a : a + n].clone(), streams[a : a + n].clone(), (p + 1, saved) if n == 2 else None,
                         None if self._completes_hca(p) else (p, saved)) for a, n, p, saved in spans]

    def _completes_hca(self, p: int) -> bool:
        return any(ratio != 4 and (p + 1) % ratio == 0 for ratio in self._ratios)

    def _states(self, slot: int, ratio: int, rows: slice | int = slice(None)) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The compressor states' (kv, score) rows of `slot` in every layer of `ratio` (views, kept:
        take_back runs every rejected step)."""
        key = (slot, ratio, rows if isinstance(rows, int) else (rows.start, rows.stop))
        if key not in self._state_views:
            pairs = [(kv[slot, rows], score[slot, rows]) for layer, cache in zip(self.layers, self.caches) if layer.ratio == ratio
                     for kv, score in ((cache.comp_kv, cache.comp_score), (cache.idx_kv, cache.idx_score)) if kv is not None]
            self._state_views[key] = ([kv for kv, _ in pairs], [score for _, score in pairs])
        return self._state_views[key]

    def _saved_states(self, seq: GpuSequence, p: int, rows: int) -> list[torch.Tensor]:
        """What take_back needs besides a position for rows at p … p+rows−1 (at most one of them
        completing a CSA group): where one does, a copy of the CSA states' previous-group rows
        (one multi-tensor copy), else nothing."""
        if all((q + 1) % 4 for q in range(p, p + rows)):
            return []
        prev = [t for views in self._states(seq.slot, 4, slice(0, 4)) for t in views]
        saved = [torch.empty_like(t) for t in prev]
        torch._foreach_copy_(saved, prev)
        return saved

    @torch.inference_mode()
    def take_back(self, seq: GpuSequence, undo: tuple[int, list[torch.Tensor]]) -> GpuSequence:
        """Forget the rows fed to seq from position p on (undo: p and the saved states, from
        verify_batch: a rejected draft's row, or a look-ahead's two), last first: each one's
        compressor state rows back to empty (kv 0, score -inf), and where one completed a CSA
        group, that group's rows back from the previous group's, and those from the copy."""
        p, saved = undo
        for q in reversed(range(p, seq.pos)):
            if (q + 1) % 4 == 0:  # rows 4..7 (the group) were moved to 0..3, then emptied
                prev = [t for views in self._states(seq.slot, 4, slice(0, 4)) for t in views]
                torch._foreach_copy_([t for views in self._states(seq.slot, 4, slice(4, 8)) for t in views], prev)
                torch._foreach_copy_(prev, saved)
            for ratio in self._ratios:
                kv, score = self._states(seq.slot, ratio, (ratio if ratio == 4 else 0) + q % ratio)
                torch._foreach_zero_(kv)
                torch._foreach_copy_(score, [self._neg_inf[t.shape[0]] for t in score])
        seq.pos = p
        return seq

    @torch.inference_mode()
    def mtp_forward(self, streams: torch.Tensor, next_tokens: torch.Tensor, start: int, seq: GpuSequence, num: Numerics | None = None) -> torch.Tensor:
        """The reference's mtp_forward for one sequence: draft logits [T, vocab] from its final
        streams at positions start … start+T−1 and the tokens chosen after them. A decode step's
        few rows replay a CUDA graph (the block's launches cost more than its work)."""
        t = streams.shape[0]
        seq.mtp_pos = start + t
        ids = next_tokens.to(self.device, torch.int64)  # chosen on the device (not read yet) where they matter: no wait
        if not self.graphs or t > DRAFT_GRAPH_ROWS:
            pos = torch.arange(start, start + t, device=self.device)
            return self.draft(streams.to(self.device, torch.bfloat16).contiguous(), ids, torch.full_like(pos, seq.slot), pos)
        if t not in self._draft_graphs:
            self._capture_draft(t)
        graph, x, dev_inputs, logits = self._draft_graphs[t]
        x.copy_(streams)
        dev_inputs[0].copy_(ids)
        dev_inputs[1].fill_(seq.slot)
        torch.arange(start, start + t, out=dev_inputs[2])
        graph.replay()
        return logits

    def _capture_draft(self, rows: int) -> None:
        """Capture the MTP draft of `rows` rows of one slot, after one eager run on slot 0 (scratch)."""
        x = torch.zeros((rows, self.config.hc_mult, self.config.dim), dtype=torch.bfloat16, device=self.device)
        inputs = torch.zeros((3, rows), dtype=torch.int64, device=self.device)
        inputs[2] = torch.arange(rows)
        self.draft(x, *inputs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.draft(x, *inputs)
        self._draft_graphs[rows] = (graph, x, inputs, logits)

    # ---- the step ---------------------------------------------------------------------------------

    def _indices(self, slots: torch.Tensor, pos: torch.Tensor, chunk_start: int | None = None,
                 layers: list[tuple[DecodeLayer, LayerCache]] | None = None) -> dict[int, StepIndex]:
        """The step's indices for each kind of layer (of `layers`, by default the model's); at
        decode in one launch, else the int32 positions and each RoPE's cos/sin made once
        (compressed layers share theirs: every kernel here is one of the step's graph)."""
        layers = layers or list(zip(self.layers, self.caches))
        kinds = {layer.ratio: (layer.ratio, cache.n_max, layer.rope) for layer, cache in layers}
        if chunk_start is None and pos.is_cuda and pos.dtype == torch.int64:
            return step_indices(self.config, list(kinds.values()), slots, pos)  # one launch
        out: dict[int, StepIndex] = {}
        slots, pos = slots.int(), pos.int()
        cos_sin: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, cache in layers:
            if layer.ratio not in out:
                chunk = None if chunk_start is None else cache.chunk_at(chunk_start, pos.shape[0])
                compressed = layer.ratio != 0  # (layer_rope: one table for every compressed layer)
                if compressed not in cos_sin:
                    cos_sin[compressed] = layer.rope.cos_sin(pos)
                out[layer.ratio] = step_index(self.config, layer.ratio, cache.n_max, layer.rope, slots, pos, chunk, cos_sin=cos_sin[compressed])
        return out

    def _layers(self, ids: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, runs: torch.Tensor | None, chunk_start: int | None = None,
                last: int | None = None) -> torch.Tensor:
        """The embedding and every layer for the rows (ids, slots, pos: int64 [B] on the device) ->
        the final streams of every row, or of the last `last` rows.

        Split over ranks, a prompt chunk's rows are also split by rows where the work is per row
        (each rank keeps the streams of its share of the rows, makes their block inputs, routes
        them and picks their indexer entries; the sublayers' partial sums are reduce-scattered and
        the rest gathered: layer.py), so no rank repeats another's; decode steps keep every row's
        streams on every rank (one all-reduce a site)."""
        c = self.config
        index = self._indices(slots, pos, chunk_start)
        rows, tp = ids.shape[0], self.tp
        # (split where each rank's share is a chunk for the chunk kernels by itself: a shorter one gains little)
        split = SPLIT_CHUNKS and chunk_start is not None and tp is not None and tp.world > 1 and rows % tp.world == 0 and rows // tp.world >= DENSE_MIN_ROWS
        own = tp.own_rows(ids) if split else ids
        x = self.embed[own].unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        buf = {"x0": x, "ids": ids, "slots": slots, "pos": pos, "runs": runs, "split": split}
        for layer, cache in zip(self.layers, self.caches):
            for stage in layer.stages(cache, index[layer.ratio]):
                stage.run(buf)
            # Only the next layer's input lives on (a prefill chunk's intermediates take GBs a layer).
            for key in [k for k in buf if k.startswith(f"{layer.layer}.")] + [f"x{layer.layer}"]:
                del buf[key]
        x = buf[f"x{c.n_layers}"]
        if split:  # the last rows are the last rank's: every rank gathers the same few rows of each
            few = x.shape[0] if last is None else min(last, x.shape[0])
            x = tp.collective.all_gather_rows(x[-few:].contiguous())
        return x if last is None else x[-last:]

    def _step(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for each of the first `rows` rows of the device inputs -> logits float32
        [rows, vocab] and the final streams bf16 [rows, hc, D]."""
        ids, slots, pos = self.dev_in[:, :rows]
        x = self._layers(ids, slots, pos, self.dev_runs[: rows + 1])
        return self._logits(x), x

    def _prefill(self, seq: GpuSequence, tokens: torch.Tensor, tail: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed a prompt in chunks of up to prefill_rows rows, eagerly -> the logits after its
        last token, and the final streams of its last `tail` rows."""
        kept = torch.empty((0, self.config.hc_mult, self.config.dim), dtype=torch.bfloat16, device=self.device)
        # One copy of the whole prompt: a copy from pageable memory waits for the stream, which
        # a chunk's copy would make the host do for the chunk before it.
        tokens = tokens.to(self.device, torch.int64)
        for lo in range(0, len(tokens), self.prefill_rows):
            chunk = tokens[lo : lo + self.prefill_rows]
            n = chunk.shape[0]
            pos = torch.arange(seq.pos, seq.pos + n, device=self.device)
            x = self._layers(chunk, torch.full_like(pos, seq.slot), pos, None, chunk_start=seq.pos, last=max(tail, 1))
            seq.pos += n
            if tail:
                kept = torch.cat((kept, x[-tail:]))[-tail:]
        return self._logits(x[-1:]), kept

    def _logits(self, x: torch.Tensor, head: Mtp | None = None) -> torch.Tensor:
        """The head: the streams collapsed with sigmoid weights (HyperHead), RMSNorm, the vocabulary
        projection; with `head`, the MTP layer's own collapse and norm before the shared projection."""
        c = self.config
        fn, base, scale, norm = (head.hc_fn, head.hc_base, head.hc_scale, head.norm) if head else (self.hc_fn, self.hc_base, self.hc_scale, self.norm)
        h, _ = hc_block_input(x.contiguous(), fn, scale, base, c.hc_eps, c.norm_eps, norm, c.norm_eps)  # one launch, float64 sums as v4.HyperHead
        if self.head.dtype == torch.float32:
            logits = h.float() @ self.head.t()
        else:
            logits = torch.mm(h, self.head.t(), out_dtype=torch.float32)
        return self.tp.collective.all_gather(logits) if self.tp else logits  # a rank holds a slice of the vocabulary

    def draft(self, streams: torch.Tensor, next_ids: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The MTP layer's draft logits float32 [B, vocab] from the main model's final streams
        bf16 [B, hc, D] of rows at positions pos (int64 [B]) in slots (int64 [B]), each with the
        token chosen after it (int64 [B]): each row predicts the token after that one. Rows of one
        slot side by side in position order, as in a step; the MTP layer keeps its own window."""
        if self.mtp is None:
            raise ValueError(f"{self.config.name} has no MTP layer")
        x = self.mtp.inputs(self.embed[next_ids], streams)
        m = self.mtp
        index = self._indices(slots, pos, layers=[(m.layer, m.cache)])[m.layer.ratio]
        buf = {f"x{m.layer.layer}": x, "ids": next_ids, "slots": slots, "pos": pos}
        for stage in m.layer.stages(m.cache, index):
            stage.run(buf)
        return self._logits(buf[f"x{m.layer.layer + 1}"], m)

    def step(self, rows: list[tuple[int, int, int]], ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed one token to each (slot, position, token id) -> logits float32 [len(rows), vocab]
        and final streams bf16 [len(rows), hc, D] on the device (a graph's buffers: read them
        before the next step). Rows of one slot must be adjacent, at consecutive positions, at most
        PREFILL_CHUNK of them. `ids`: the token ids as an int64 tensor [len(rows)] on the device
        instead (tokens sampled there, not read yet): the step is queued without waiting for them."""
        n = len(rows)
        bucket = next(b for b in self.buckets if b >= n)
        if self.graphs and bucket not in self._graphs:
            self._capture(bucket)
        # A run per slot (its rows join its compressor states in order); every padding row its own.
        starts = [i for i in range(n) if i == 0 or rows[i][0] != rows[i - 1][0]] + list(range(n, bucket + 1))
        self.staged.synchronize()  # the pinned buffers' previous copy is made: they may be written
        self.host_in.zero_()  # padding rows: slot 0 (scratch), position 0, token 0
        self.host_in[:, :n] = torch.tensor([[t for _, _, t in rows], [s for s, _, _ in rows], [p for _, p, _ in rows]]).view(3, n)
        self.host_runs[: len(starts)] = torch.tensor(starts, dtype=torch.int32)
        self.host_runs[len(starts) :] = bucket  # then empty runs
        self.dev_in.copy_(self.host_in, non_blocking=True)  # stream-ordered after the last replay's reads
        self.dev_runs.copy_(self.host_runs, non_blocking=True)
        if ids is not None:
            self.dev_in[0, :n].copy_(ids)
        self.staged.record()
        if not self.graphs:
            logits, streams = self._step(bucket)
        else:
            graph, logits, streams = self._graphs[bucket]
            graph.replay()
        return logits[:n], streams[:n]

    def _capture(self, bucket: int) -> None:
        """Capture the step of `bucket` rows, after one eager run (it loads every kernel and settles
        torch's lazy state) on padding rows only, so that no sequence's caches move."""
        self.dev_in.zero_()
        self.dev_runs.copy_(torch.arange(self.dev_runs.shape[0], dtype=torch.int32))
        self._step(bucket)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, streams = self._step(bucket)
        self._graphs[bucket] = (graph, logits, streams)

    @torch.inference_mode()
    def forward_batch(self, batch: list[tuple[torch.Tensor, GpuSequence]], num: Numerics | None = None) -> list[torch.Tensor]:
        """The reference model's contract: feed each sequence its new tokens, return the logits
        after each sequence's last new token (float32 [1, vocab], on the GPU: the worker samples
        there, and only the chosen token crosses to the host). Tokens on the GPU (the worker's
        look-ahead: sampled, not read yet) go one a sequence, for every sequence of the batch."""
        if any(tokens.is_cuda for tokens, _ in batch):
            return self._feed_device_tokens(batch)
        return [logits for logits, _ in self._feed(batch, [1] * len(batch))]

    def _feed(self, batch: list[tuple[torch.Tensor, GpuSequence]], last: list[int], tail: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Feed each sequence its tokens (on the host): prompts of PREFILL_MIN tokens or more
        through _prefill, the rest in steps. Each sequence's logits after its last last[i] tokens
        float32 [last[i], vocab], and the final streams of its last `tail` rows bf16 [<= tail, hc, D]."""
        self._check_room(batch)
        logits: list[list[torch.Tensor]] = [[] for _ in batch]
        streams = [torch.empty((0, self.config.hc_mult, self.config.dim), dtype=torch.bfloat16, device=self.device) for _ in batch]
        fed = [0] * len(batch)
        for i, (tokens, seq) in enumerate(batch):
            if len(tokens) - last[i] + 1 >= PREFILL_MIN:  # up to the first row whose logits are asked for
                fed[i] = len(tokens) - last[i] + 1
                row, streams[i] = self._prefill(seq, tokens[: fed[i]], tail)
                logits[i].append(row)
        capacity = self.buckets[-1]
        while any(f < len(tokens) for f, (tokens, _) in zip(fed, batch)):
            # A step: every sequence's next tokens, up to a chunk each, while the step has room.
            rows, spans = [], []
            for i, (tokens, seq) in enumerate(batch):
                take = min(len(tokens) - fed[i], PREFILL_CHUNK, capacity - len(rows))
                if take <= 0:
                    continue
                rows += [(seq.slot, seq.pos + j, int(tokens[fed[i] + j])) for j in range(take)]
                spans.append((i, len(rows) - take, fed[i]))
                fed[i] += take
                seq.pos += take
            out, x = self.step(rows)
            for i, first, done in spans:  # the graph's output buffers are reused: keep copies
                n = fed[i] - done
                wanted = max(first, first + len(batch[i][0]) - last[i] - done)
                if wanted < first + n:
                    logits[i].append(out[wanted : first + n].clone())
                if tail:
                    streams[i] = torch.cat((streams[i], x[first : first + n]))[-tail:]
        return [(torch.cat(rows), kept) for rows, kept in zip(logits, streams)]

    def _check_room(self, batch: list[tuple[torch.Tensor, GpuSequence]]) -> None:
        for tokens, seq in batch:
            if seq.pos + len(tokens) > self.max_context:
                raise ValueError(f"a sequence of {seq.pos + len(tokens)} tokens exceeds this worker's context of {self.max_context}")

    def _feed_device_tokens(self, batch: list[tuple[torch.Tensor, GpuSequence]]) -> list[torch.Tensor]:
        """One step of one token a sequence, the tokens on the device (the worker's look-ahead)."""
        self._check_room(batch)
        if not all(tokens.is_cuda and tokens.numel() == 1 for tokens, _ in batch) or len(batch) > self.max_batch:
            raise ValueError(f"tokens on the device go one a sequence, for every sequence of the step (at most {self.max_batch})")
        rows = [(seq.slot, seq.pos, 0) for _, seq in batch]
        logits, _ = self.step(rows, ids=torch.cat([tokens.view(1) for tokens, _ in batch]).to(self.device, torch.int64))
        for _, seq in batch:
            seq.pos += 1
        return [logits[i : i + 1].clone() for i in range(len(batch))]

    # ---- conversation caches: the reference's SequenceState on the host --------------------------

    def export_state(self, seq: GpuSequence) -> SequenceState:
        """The sequence's state in the reference layout (CPU tensors; KV rows are what the FP8 / FP4
        entries decode to, bit for bit what the reference would hold)."""
        c = self.config
        host = SequenceState.new(c, torch.bfloat16)
        host.pos = seq.pos
        if self.mtp:  # the rows the MTP layer was fed (none without speculative decoding)
            self._export_window(self.mtp.cache, seq.slot, min(seq.mtp_pos, seq.pos), host.mtp[0])
        for layer, cache, st in zip(self.layers, self.caches, host.layers):
            base = seq.slot * cache.stride + ring_size(c)  # the compressed entries
            self._export_window(cache, seq.slot, seq.pos, st)
            if layer.ratio:
                st.compressed = unpack_kv(cache.pool[base : base + seq.pos // layer.ratio]).cpu()
                st.compressor = CompressorState(cache.comp_kv[seq.slot].cpu(), cache.comp_score[seq.slot].cpu())
            if layer.ratio == 4:
                first = seq.slot * cache.n_max
                st.index_keys = unpack_index_keys(cache.keys[first : first + seq.pos // 4]).to(torch.bfloat16).cpu()
                st.indexer = CompressorState(cache.idx_kv[seq.slot].cpu(), cache.idx_score[seq.slot].cpu())
        return host

    def import_state(self, host: SequenceState) -> GpuSequence:
        """A sequence resumed from a reference-layout state (a conversation cache)."""
        c = self.config
        if host.pos > self.max_context:
            raise StateError(f"a cached prefix of {host.pos} tokens exceeds this worker's context of {self.max_context}")
        seq = self.new_state()
        try:
            if self.mtp and host.mtp:
                self._import_window(self.mtp.cache, seq.slot, host.pos, host.mtp[0])
                seq.mtp_pos = host.pos
            for layer, cache, st in zip(self.layers, self.caches, host.layers):
                base = seq.slot * cache.stride + ring_size(c)
                self._import_window(cache, seq.slot, host.pos, st)
                if layer.ratio:
                    n = st.compressed.shape[0]
                    if n:
                        pack_kv(st.compressed.to(self.device, torch.bfloat16), cache.pool, self._entries(base, n))
                    cache.comp_kv[seq.slot], cache.comp_score[seq.slot] = st.compressor.kv, st.compressor.score
                if layer.ratio == 4:
                    n = st.index_keys.shape[0]
                    if n:
                        rows = torch.arange(seq.slot * cache.n_max, seq.slot * cache.n_max + n, device=self.device)
                        pack_index_keys(st.index_keys.to(self.device, torch.bfloat16), cache.keys, rows)
                    cache.idx_kv[seq.slot], cache.idx_score[seq.slot] = st.indexer.kv, st.indexer.score
        except Exception:
            self.free(seq)
            raise
        seq.pos = host.pos
        return seq

    def _export_window(self, cache: LayerCache, slot: int, pos: int, st: LayerState) -> None:
        """st.window from the slot's window entries of the positions before pos;
        rows not written yet: zeros, as the reference keeps them."""
        rows, entries = cache.window(self.config, slot, pos)
        st.window = torch.zeros(self.config.window_size, self.config.head_dim, dtype=torch.bfloat16)
        st.window[rows] = unpack_kv(cache.pool[entries.long()]).cpu()

    def _import_window(self, cache: LayerCache, slot: int, pos: int, st: LayerState) -> None:
        rows, entries = cache.window(self.config, slot, pos)
        if len(rows):
            pack_kv(st.window[rows].to(self.device, torch.bfloat16), cache.pool, entries)

    def _entries(self, first: int, n: int) -> torch.Tensor:
        return torch.arange(first, first + n, dtype=torch.int32, device=self.device)
