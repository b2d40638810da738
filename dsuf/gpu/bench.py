"""`dsuf bench`: V4-Flash decode steps on one GPU, against the HBM floor and the reference path.

What it builds, with no checkpoint: random weights in the checkpoint's formats and shapes (FP8
e4m3 with 128x128 E8M0 scales, FP4 experts with per-32 scales, bf16 and float32 where the
checkpoint has them) for `--layers` consecutive layers of V4-Flash from `--first-layer` (default
layers 2 and 3: a CSA layer with hash routing and an HCA layer with biased routing), made on the
GPU. Per batch size and context: every sequence at position context - 1 (the step that completes
a compressed group in both kinds of layer), KV caches of random entries in their cache formats
(584-byte FP8 entries for the window and the compressed KV, 68-byte FP4 index keys) and random
compressor states.

What it measures:
- the decode step through the layers, captured as one CUDA graph, median of replays; with
  `--model`, also the typical step: the mean over the four positions before context - 1, where
  CSA layers complete one group and HCA layers none (decoding completes a group every 4th and
  every 128th step);
- the bytes the step must read: every weight in its checkpoint format (routed experts: the
  distinct experts the step's tokens route to), the KV entries attended and the index keys
  scored; the floor those bytes take at the device-to-device copy bandwidth measured in the same
  run, and measured / floor;
- the same step on the reference path (dsuf.model's Block in reference numerics, torch ops on the
  GPU, eager; routed experts dequantised when first used); the fast path's attention and MoE
  outputs against the reference's on the same inputs (see `sublayer_errors`);
- per stage: each stage of the step alone as a CUDA graph (so each includes one graph launch),
  marked by what runs it: our kernels, or torch where no kernel exists yet.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dsuf.model.config import ModelConfig, parse_config
from dsuf.model.layers import Numerics

from .attention import KV_ENTRY_BYTES, pack_kv, unpack_kv
from .collective import AbsentPeers, IpcCollective
from .indexer import INDEX_ENTRY_BYTES, pack_index_keys, unpack_index_keys
from .layer import (
    PREFILL_CHUNK,
    DecodeLayer,
    LayerCache,
    Stage,
    join_all,
    layer_kind,
    ring_size,
    step_index,
)
from .linear import BLOCK
from .timeline import analyse, graph_spans, report, trace_spans
from .tp import TensorParallel, check_tp
from .weights import V4_FLASH_CONFIG, layer_tensors

NUM = Numerics()  # reference numerics, bf16 activations


# ---- caches ---------------------------------------------------------------------------------


def _random_state(kv: torch.Tensor, score: torch.Tensor, ratio: int) -> None:
    """A compressor state whose group completes at the next token: for ratio 4 the previous group
    (rows 0..3) and three pending rows (4..6); else ratio - 1 pending rows."""
    used = (2 if ratio == 4 else 1) * ratio - 1
    kv[:, :used] = torch.randn_like(kv[:, :used])
    score[:, :used] = torch.randn_like(score[:, :used])


def random_caches(c: ModelConfig, ratio: int, batch: int, context: int, device: torch.device) -> LayerCache:
    """Slots 0..batch-1 at position context - 1 (the step that completes a compressed group in
    both kinds of layer)."""
    cache = LayerCache.new(c, ratio, batch, context, device)
    fill_random(c, cache)
    return cache


def fill_random(c: ModelConfig, cache: LayerCache) -> None:
    """Every window and compressed entry and index key of every slot random, in their cache
    formats, and compressor states whose group completes at the next token."""
    device = cache.pool.device
    entries = cache.pool.shape[0]
    rows = torch.randn(entries, c.head_dim, device=device) * torch.exp2(torch.randint(-2, 2, (entries, c.head_dim // 64), device=device).float()).repeat_interleave(64, 1)
    pack_kv(rows.to(torch.bfloat16), cache.pool)
    if cache.ratio:
        _random_state(cache.comp_kv, cache.comp_score, cache.ratio)
    if cache.ratio == 4:
        n = cache.keys.shape[0]
        keys = torch.randn(n, c.index_head_dim, device=device) * torch.exp2(torch.randint(-3, 3, (n, 4), device=device).float()).repeat_interleave(32, 1)
        pack_index_keys(keys.to(torch.bfloat16), cache.keys, torch.arange(n, device=device))
        _random_state(cache.idx_kv, cache.idx_score, 4)


def compressor_states(cache: LayerCache) -> list[torch.Tensor]:
    """The cache's compressor-state tensors (a decode step updates them in place)."""
    return [t for t in (cache.comp_kv, cache.comp_score, cache.idx_kv, cache.idx_score) if t is not None]


# ---- bytes a step must read ----------------------------------------------------------------


def _fp8_bytes(n: int, k: int) -> int:
    return n * k + math.ceil(n / BLOCK) * math.ceil(k / BLOCK)


def step_bytes(c: ModelConfig, layer: int, batch: int, n_comp: int, distinct_experts: int, world: int = 1) -> int:
    """Bytes one decode step of the layer must read at least once: its weights in checkpoint
    formats (routed experts: the distinct ones routed to) and the KV entries / index keys used;
    with `world` tensor-parallel ranks, what each rank reads (tp.py: split parts / world, the
    rest whole)."""
    ratio, d, hd, inter = c.compress_ratios[layer], c.dim, c.head_dim, c.moe_inter_dim
    total = 2 * ((2 + c.hc_mult) * c.hc_mult * (c.hc_mult * d + 1) * 4 + 12) + 2 * 2 * d  # mHC sites, norms
    total += _fp8_bytes(c.q_lora_rank, d) + _fp8_bytes(hd, d) + 2 * (c.q_lora_rank + hd)
    split = _fp8_bytes(c.n_heads * hd, c.q_lora_rank) + _fp8_bytes(c.o_groups * c.o_lora_rank, c.n_heads * hd // c.o_groups)
    split += _fp8_bytes(d, c.o_groups * c.o_lora_rank) + 4 * c.n_heads
    if ratio:
        rows = (2 if ratio == 4 else 1) * hd
        total += 2 * rows * d * 2 + ratio * rows * 4 + 2 * hd
    if ratio == 4:
        rows = 2 * c.index_head_dim
        total += _fp8_bytes(c.index_n_heads * c.index_head_dim, c.q_lora_rank) + c.index_n_heads * d * 2
        total += 2 * rows * d * 2 + 4 * rows * 4 + 2 * c.index_head_dim
    total += c.n_routed_experts * d * 2 + (0 if c.is_hash_layer(layer) else 4 * c.n_routed_experts)
    expert = 2 * (inter * d // 2 + inter * d // 32) + d * inter // 2 + d * inter // 32
    split += distinct_experts * expert + 2 * _fp8_bytes(inter, d) + _fp8_bytes(d, inter)
    total += split // world
    attended = min(c.index_topk, n_comp) if ratio == 4 else n_comp
    total += batch * (c.window_size + attended) * KV_ENTRY_BYTES
    if ratio == 4:
        total += batch * n_comp * INDEX_ENTRY_BYTES
    return total


# ---- the reference path ----------------------------------------------------------------------


class _ExpertCache:
    """Dequantised routed-expert linears of the reference path, least recently used dropped
    beyond `capacity` (each is 67 MB in float64)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: OrderedDict[str, object] = OrderedDict()

    def get(self, name: str, build: Callable[[], object]) -> object:
        if name in self.held:
            self.held.move_to_end(name)
        else:
            self.held[name] = build()
            while len(self.held) > self.capacity:
                self.held.popitem(last=False)
        return self.held[name]


class _LazyLinear:
    """A reference Linear of a routed expert, dequantised when first called."""

    def __init__(self, cache: _ExpertCache, name: str, build: Callable[[], object]) -> None:
        self.cache, self.name, self.build = cache, name, build

    def __call__(self, *args, **kwargs):
        return self.cache.get(self.name, self.build)(*args, **kwargs)


def reference_blocks(c: ModelConfig, layers: list[int], tensors: dict[str, torch.Tensor], device: torch.device, expert_capacity: int) -> list:
    """dsuf.model's V4 Blocks for the layers over the same tensors, on the device; routed experts
    are dequantised on first use (all 256 would take 51 GB a layer in float64)."""
    from dsuf.model import v4

    cache = _ExpertCache(expert_capacity)

    class Weights(v4.Weights):
        def linear(self, name: str):
            if ".experts." not in name:
                return super().linear(name)
            return _LazyLinear(cache, name, lambda: v4.Weights.linear(self, name))

    w = Weights(tensors, c)
    with torch.device(device):
        return [v4.Block(w, f"layers.{i}", c.compress_ratios[i], c.is_hash_layer(i)) for i in layers]


def reference_states(c: ModelConfig, ratio: int, st: LayerCache, position: int) -> list:
    """The reference's per-sequence LayerStates holding exactly what the fast path's caches hold
    before the step at `position` (the compressed entry and index key the step makes are left out)."""
    from dsuf.model.state import CompressorState, LayerState

    n = st.n_max
    out = []
    for b in range(st.slots):
        base = b * st.stride
        rows, entries = st.window(c, b, position)
        state = LayerState(window=torch.zeros(c.window_size, c.head_dim, dtype=torch.bfloat16, device=st.pool.device))
        state.window[rows.to(st.pool.device)] = unpack_kv(st.pool[entries.long()])
        if ratio:
            state.compressed = unpack_kv(st.pool[base + ring_size(c) : base + ring_size(c) + n - 1])
            state.compressor = CompressorState(st.comp_kv[b].clone(), st.comp_score[b].clone())
        if ratio == 4:
            state.index_keys = unpack_index_keys(st.keys[b * n : b * n + n - 1]).to(torch.bfloat16)
            state.indexer = CompressorState(st.idx_kv[b].clone(), st.idx_score[b].clone())
        out.append(state)
    return out


def reference_step(blocks: list, states: list[list], position: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One decode step of every sequence (at `position`) through the reference Blocks; `states`
    holds each layer's per-sequence LayerStates, which the step updates."""
    from dsuf.model import v4

    with torch.device(x.device):
        for block, layer_states in zip(blocks, states):
            segments = [v4.Segment(slice(b, b + 1), position, s) for b, s in enumerate(layer_states)]
            x = block(x, ids, segments, NUM)
    return x


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def sublayer_errors(blocks: list, c: ModelConfig, layers: list[int], caches: list[LayerCache], buf: dict, position: int) -> list[tuple[float, float, float]]:
    """Per layer, on the fast path's own sublayer inputs: (rel err of its attention output against
    the reference Attention's, how far the reference's attention output itself moves when 1% of
    its input elements are one bf16 ulp off, rel err of its MoE output against the reference
    MoE's). Chained layers are no use for this with random weights: the reference alone turns a
    one-ulp input change into a different routed expert or different top-k picks."""
    from dsuf.model import v4

    def attention(block, layer: int, st: LayerCache, y: torch.Tensor) -> torch.Tensor:
        states = reference_states(c, c.compress_ratios[layer], st, position)
        return block.attn(y, [v4.Segment(slice(b, b + 1), position, s) for b, s in enumerate(states)], NUM)

    out = []
    with torch.device(buf["ids"].device):
        for block, layer, st in zip(blocks, layers, caches):
            y = buf[f"{layer}.y"]
            ref = attention(block, layer, st, y)
            nudged = y.clone().view(-1)
            nudged[::100] = (nudged[::100].float() * (1 + 2**-7)).to(torch.bfloat16)
            moe = block.ffn(buf[f"{layer}.y2"], buf["ids"], NUM)
            out.append((_rel(buf[f"{layer}.attn"], ref), _rel(attention(block, layer, st, nudged.view_as(y)), ref), _rel(buf[f"{layer}.moe"], moe)))
    return out


# ---- timing ------------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second (median of 10)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (2 << 30) / statistics.median(times)


def graph_of(stages: list[Stage], buf: dict) -> torch.cuda.CUDAGraph:
    """The stages captured as one CUDA graph (joining what they leave on other streams), replayed
    once (so its outputs are valid)."""
    return graph_of_calls([lambda s=s: s.run(buf) for s in stages] + [lambda: join_all(buf)])


def graph_of_calls(calls: list[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """The calls captured as one CUDA graph, replayed once (so its outputs are valid)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median µs of one replay."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


# ---- the command -------------------------------------------------------------------------------


@dataclass
class Result:
    batch: int
    context: int
    step_us: float
    nbytes: int
    floor_us: float
    ref_ms: float | None
    errors: list[tuple[float, float, float]] | None  # per layer, see sublayer_errors
    stage_us: dict[str, tuple[str, float]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=2, help="decode layers to run (default 2)")
    p.add_argument("--model", action="store_true", help="time the worker's whole step (embedding, layers 0..N-1, head) instead")
    p.add_argument("--first-layer", type=int, default=2, help="first layer (default 2: a CSA layer with hash routing, then an HCA layer)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    p.add_argument("--context", type=int, nargs="+", default=[4096, 65536], help="context lengths, multiples of 128 (default 4096 65536)")
    p.add_argument("--max-context", type=int, default=0, help="with --model: caches sized for this many tokens a sequence, as a server's "
                   "--max-model-len sizes them, for every context measured (default: each context's own)")
    p.add_argument("--reps", type=int, default=20, help="graph replays timed (median)")
    p.add_argument("--no-reference", action="store_true", help="skip the reference path")
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage timing")
    p.add_argument("--profile", action="store_true", help="also print the CUDA kernels of one eager step of the first configuration "
                   "(with --model --prefill: of the first prompt's first chunk; with --model --tokens-per-seq 2: of one MTP draft) (torch.profiler)")
    p.add_argument("--trace", nargs="?", const="", metavar="JSON", help="with --model: also print where one replay of the first batch's step "
                   "goes (kernels alone on the GPU, overlap, idle gaps; dsuf.gpu.timeline), and the first prompt's first chunk with --prefill; "
                   "rank 0's traces are written to JSON and JSON's stem + -prefill.json if given")
    p.add_argument("--config", help="a config.json to take the shapes from (default: V4-Flash's, built in)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill", type=int, nargs="*", default=[], metavar="TOKENS",
                   help="with --model: also time one prompt of each size (at the smallest context that holds it)")
    p.add_argument("--tokens-per-seq", type=int, default=1, metavar="N",
                   help="with --model: every sequence feeds N consecutive tokens a step (the verify step of speculative decoding "
                        "with N - 1 draft tokens; tokens/s then counts all of them as accepted), and the MTP layer's draft is timed too")
    p.add_argument("--tp", type=int, default=1, help="with --model: tensor-parallel over this many GPUs (one process each)")
    p.add_argument("--collective", choices=("ipc", "nccl"), default="ipc", help="with --tp: the all-reduce and all-gather (default ipc)")
    p.add_argument("--shard-of", type=int, default=1, metavar="N", help="with --model: one rank's share of a --tp N split on this one GPU, its "
                   "collectives' communication left out (the all-reduce kernels run with this rank alone: a tensor-parallel rank's work "
                   "timed where N GPUs are not at hand)")


def head_bytes(c: ModelConfig, batch: int, world: int = 1) -> int:
    """What the embedding and the head read a step (a rank of `world`): the rows embedded, the
    bf16 vocabulary projection (split over the ranks), the final norm and mHC collapse."""
    return batch * c.dim * 2 + c.vocab_size * c.dim * 2 // world + c.dim * 2 + c.hc_mult * (c.hc_mult * c.dim + 2) * 4


def bench_model(c: ModelConfig, args: argparse.Namespace, device: torch.device, bw: float, tp: TensorParallel | None = None) -> int:
    """`--model`: the worker's whole decode step (dsuf.gpu.model: step indices, embedding, layers
    0 .. --layers-1, head) as the server replays it, per batch and context; with `tp`, this
    rank's part of it (every rank runs this; rank 0 reports)."""
    from .model import GpuModel
    from .weights import random_source

    rank, world = (tp.rank, tp.world) if tp else (0, 1)
    say = print if rank == 0 else (lambda *a, **k: None)
    n = args.layers
    drafting = args.tokens_per_seq > 1 and c.n_mtp_layers > 0  # then the MTP layer is built and its draft timed too
    small = dataclasses.replace(c, n_layers=n, compress_ratios=c.compress_ratios[:n], n_mtp_layers=c.n_mtp_layers if drafting else 0)
    alone = tp is not None and isinstance(tp.collective, AbsentPeers)
    split = f"one rank of a {world}-GPU split alone on this GPU, its collectives' communication left out" if alone else f"tensor-parallel over {world} GPUs ({args.collective} collectives)"
    say(f"whole model: layers 0..{n - 1} ({', '.join(layer_kind(r) for r in small.compress_ratios)}) + embedding + head"
        + (f", {split}" if tp else ""), flush=True)
    rows_out, prefills = [], []
    for ctx in args.context:
        # One model per context, as a server of that context would hold it; it takes the weights
        # over layer by layer, so they are never held twice.
        capacity = args.max_context or ctx
        model = GpuModel(small, random_source(small, device, args.seed, rank, world), device, max_batch=max(args.batch), max_context=capacity, tp=tp)
        torch.manual_seed(args.seed)  # the same caches on every rank (they are replicated)
        for cache in model.caches:
            fill_random(small, cache)
        n_comp = {r: ctx // r if r else 0 for r in small.compress_ratios}  # the entries a row at the context sees
        k = args.tokens_per_seq
        for batch in args.batch:
            tokens = torch.randint(0, c.vocab_size, (batch, k))
            rows = [(slot, ctx - k + j, int(tokens[slot - 1, j])) for slot in range(1, batch + 1) for j in range(k)]
            model.step(rows)  # captures the bucket's graph
            graph = model._graphs[next(b for b in model.buckets if b >= len(rows))][0]
            step_us = replay_us(graph, args.reps)
            if args.trace is not None and not rows_out:  # every rank replays (the collectives need their peers); rank 0 reports
                spans = graph_spans(graph, Path(args.trace) if args.trace and rank == 0 else None)
                say(f"\nwhere one replay of the step goes (batch {batch}, context {ctx} of {capacity}, rank 0):\n{report(analyse(spans))}\n", flush=True)
            typical_us = typical_step_us(model, graph, batch, ctx, args.reps) if k == 1 else None
            fed = batch * k
            nbytes = head_bytes(small, fed, world) + sum(
                step_bytes(small, i, fed, n_comp[r], min(c.n_routed_experts, fed * c.n_activated_experts), world) for i, r in enumerate(small.compress_ratios))
            floor = nbytes / bw * 1e6
            coll = collective_us(small, tp, fed, args.reps) if tp and not alone else 0.0
            rows_out.append((batch, ctx, step_us, typical_us, nbytes, floor, coll))
            say(f"  batch {batch}, context {ctx}: {step_us:.1f} µs a step = {fed * 1e6 / step_us:.0f} tokens/s "
                f"({nbytes / 1e6:.0f} MB a GPU, floor {floor:.1f} µs, {step_us / floor:.1f}x; collectives {coll:.0f} µs)", flush=True)
            if drafting:
                draft = draft_call(model, batch, k, ctx)
                d_us = replay_us(graph_of_calls([draft]), args.reps)
                if args.profile and len(rows_out) == 1:
                    profiled(draft, f"one MTP draft of {batch * k} rows, rank 0", show=rank == 0)
                projected = ", ".join(f"{a:.0%}: {batch * (1 + (k - 1) * a) * 1e6 / (step_us + d_us):.0f}" for a in (0.6, 0.8, 0.9))
                say(f"    MTP draft of {batch * k} rows: {d_us:.1f} µs; tokens/s a step plus a draft would give if this share of "
                    f"drafts were accepted (k - 1 = {k - 1} a step; random weights accept none): {projected}", flush=True)
        for n_tokens in prompts_for(args.prefill, args.context, ctx):
            seconds, host, mallocs = prefill_seconds(model, n_tokens, c.vocab_size)
            if args.profile and not prefills:
                profile_chunk(model, c.vocab_size, n_tokens, show=rank == 0)
            if args.trace is not None and not prefills:
                save = Path(args.trace).with_name(Path(args.trace).stem + "-prefill.json") if args.trace and rank == 0 else None
                spans = trace_spans(prefill_chunk(model, c.vocab_size, n_tokens), save)
                say(f"\nwhere one prefill chunk of {min(n_tokens, model.prefill_rows)} tokens goes (rank 0):\n{report(analyse(spans))}\n", flush=True)
            prefills.append((n_tokens, ctx, seconds, host, mallocs))
            say(f"  prefill of a {n_tokens}-token prompt (context {ctx}): {seconds:.2f} s = {n_tokens / seconds:.0f} tokens/s "
                f"(the host's launches {host:.3f} s; {mallocs} cudaMalloc calls)", flush=True)
        del model
        torch.cuda.empty_cache()
    say(f"\n### dsuf bench --model{f' --shard-of {world}' if alone else f' --tp {world}' if tp else ''}: embedding + {n} V4-Flash layers + head, one CUDA graph per step "
        f"(median of {args.reps} replays); routed experts counted as batch x 6 distinct; floor = bytes a GPU reads / {bw / 1e9:.0f} GB/s"
        + (f"; caches sized for {args.max_context} tokens a sequence" if args.max_context else ""))
    if args.tokens_per_seq > 1:
        say(f"every sequence feeds {args.tokens_per_seq} consecutive tokens a step (speculative decoding's verify step): "
            "tokens/s counts all of them as accepted")
    if alone:
        say(f"one rank's work: its {2 * n} all-reduces run their kernels with this rank alone (no peers to push to or wait for); "
            "add their communication and one logits all-gather, which is not run (collectives µs: 0)")
    elif tp:
        say(f"collectives µs = the step's {2 * n} all-reduces and one logits all-gather ({args.collective}), timed alone in a CUDA graph")
    say("step µs: the step at position context - 1, which completes a compressed group in every compressed layer; "
        "typical µs: the mean of the four steps before it, where CSA layers complete one group and HCA layers none, "
        "as decoding does on average (a group every 4th step, every 128th)")
    say("\n| batch | context | step µs | typical µs | tokens/s | typical tokens/s | MB read a GPU | floor µs | × floor | collectives µs |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    for batch, ctx, us, typical, nbytes, floor, coll in rows_out:
        tokens = batch * args.tokens_per_seq * 1e6
        typ_us, typ_rate = (f"{typical:.1f}", f"{tokens / typical:.0f}") if typical else ("—", "—")
        say(f"| {batch} | {ctx} | {us:.1f} | {typ_us} | {tokens / us:.0f} | {typ_rate} | {nbytes / 1e6:.0f} | {floor:.1f} | {us / floor:.1f} | {coll:.0f} |")
    if prefills:
        say("\n| prompt tokens | context | prefill s | tokens/s | host's launches s | cudaMalloc calls |\n|---|---|---|---|---|---|")
        for n_tokens, ctx, seconds, host, mallocs in prefills:
            say(f"| {n_tokens} | {ctx} | {seconds:.3f} | {n_tokens / seconds:.0f} | {host:.3f} | {mallocs} |")
    return 0


def typical_step_us(model, graph: torch.cuda.CUDAGraph, batch: int, ctx: int, reps: int) -> float:
    """The mean µs of the step graph replayed with every sequence at positions ctx - 5 .. ctx - 2
    (ctx a multiple of 128): a CSA layer completes a compressed group at one of them, an HCA layer
    at none. Leaves the graph's inputs at ctx - 2."""
    times = []
    for pos in range(ctx - 5, ctx - 1):
        tokens = torch.randint(0, model.config.vocab_size, (batch,))
        model.step([(slot, pos, int(tokens[slot - 1])) for slot in range(1, batch + 1)])  # the inputs, and one step
        times.append(replay_us(graph, reps))
    return statistics.mean(times)


def draft_call(model, batch: int, k: int, ctx: int) -> Callable[[], object]:
    """One MTP draft (GpuModel.draft) of the rows a verify step of k tokens a sequence keeps at
    most (every rank runs it: the MTP layer's collectives), run once (kernels loaded, buffers grown)."""
    c, device = model.config, model.device
    streams = torch.randn(batch * k, c.hc_mult, c.dim, device=device).to(torch.bfloat16)
    ids = torch.randint(0, c.vocab_size, (batch * k,), device=device)
    slots = torch.arange(1, batch + 1, device=device).repeat_interleave(k)
    pos = (ctx - k + torch.arange(k, device=device)).repeat(batch)
    model.draft(streams, ids, slots, pos)
    return lambda: model.draft(streams, ids, slots, pos)


def prompts_for(sizes: list[int], contexts: list[int], ctx: int) -> list[int]:
    """The prompt sizes timed at context ctx: each at the smallest context that holds it."""
    return [n for n in sizes if min((c for c in contexts if c >= n), default=None) == ctx]


def prefill_chunk(model, vocab: int, n_tokens: int) -> Callable[[], None]:
    """The first prefill chunk of an n_tokens prompt (random tokens) into a new sequence, freed
    after (every call the same)."""
    chunk = torch.randint(0, vocab, (min(n_tokens, model.prefill_rows),))

    def run() -> None:
        seq = model.new_state()
        try:
            model.forward_batch([(chunk, seq)])
        finally:
            model.free(seq)

    return run


def profile_chunk(model, vocab: int, n_tokens: int, show: bool) -> None:
    """The kernels of an n_tokens prompt's first prefill chunk (every rank runs it; `show` prints)."""
    profiled(prefill_chunk(model, vocab, n_tokens), f"one prefill chunk of {min(n_tokens, model.prefill_rows)} tokens, rank 0", show)


def prefill_seconds(model, n_tokens: int, vocab: int) -> tuple[float, float, int]:
    """Wall time of one prompt of n_tokens through forward_batch (the server's path: chunks of up
    to prefill_rows rows, or steps of PREFILL_CHUNK for a short prompt), after a warm-up prompt of
    one chunk (kernels loaded, cuBLAS's choices for the chunk's shapes made), and the time until
    forward_batch returned, its last launch queued: well short of the wall time, the GPU bounds
    the prompt; close to it, the host's launches do, or the launch queue was full (a long prompt:
    the host waits there for the GPU). Also how many segments torch's allocator asked the driver
    for meanwhile (cudaMalloc waits for the GPU: a prompt that needs them is not host-bound by its
    launches alone)."""
    import time

    warm = model.new_state()
    model.forward_batch([(torch.randint(0, vocab, (min(n_tokens, model.prefill_rows),)), warm)])
    model.free(warm)
    seq = model.new_state()
    prompt = torch.randint(0, vocab, (n_tokens,))
    torch.cuda.synchronize()
    mallocs = torch.cuda.memory_stats()["num_device_alloc"]
    began = time.perf_counter()
    model.forward_batch([(prompt, seq)])
    launched = time.perf_counter()
    torch.cuda.synchronize()
    mallocs = torch.cuda.memory_stats()["num_device_alloc"] - mallocs
    model.free(seq)
    return time.perf_counter() - began, launched - began, mallocs


def collective_us(c: ModelConfig, tp: TensorParallel, batch: int, reps: int) -> float:
    """What a step's collectives take at `batch` rows: 2 all-reduces a layer (attention and MoE
    outputs) and the logits' all-gather, each timed as 20 back-to-back calls in a CUDA graph."""
    x = torch.randn(batch, c.dim, device=torch.cuda.current_device()).to(torch.bfloat16)
    part = torch.randn(batch, c.vocab_size // tp.world, device=x.device)
    reduce_us = replay_us(graph_of_calls([lambda: tp.collective.all_reduce(x)] * 20), reps) / 20
    gather_us = replay_us(graph_of_calls([lambda: tp.collective.all_gather(part)] * 20), reps) / 20
    return 2 * c.n_layers * reduce_us + gather_us


def _bench_rank(rank: int, c: ModelConfig, args: argparse.Namespace, init: str) -> None:
    """One rank of `dsuf bench --model --tp N` (a process of its own, on GPU `rank`)."""
    from . import tp as tensor_parallel
    from .model import step_rows

    device = torch.device("cuda", rank)
    group = tensor_parallel.start(rank, args.tp, init, device, args.collective, tensor_parallel.slot_bytes(c, args.tp, step_rows(max(args.batch))))
    bw = copy_bandwidth(device)
    if rank == 0:
        print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write), GPU 0", flush=True)
    bench_model(c, args, device, bw, group)


def run(args: argparse.Namespace) -> int:
    raw = json.loads(Path(args.config).read_text()) if args.config else V4_FLASH_CONFIG
    c = parse_config(raw)
    if getattr(c, "family", "v4") != "v4":
        raise SystemExit("dsuf bench: only V4-Flash layers are benchmarked so far")
    first = 0 if args.model else args.first_layer
    layers = list(range(first, first + args.layers))
    if not layers or layers[-1] >= c.n_layers:
        raise SystemExit(f"dsuf bench: layers {layers} are not all in the model's {c.n_layers}")
    for ctx in args.context:
        if ctx % 128 or ctx < 256:
            raise SystemExit(f"dsuf bench: contexts must be multiples of 128 of at least 256, got {ctx}")
    if args.max_context and not args.model:
        raise SystemExit("dsuf bench: --max-context sizes the whole model's caches: add --model")
    if args.max_context and (args.max_context % 128 or max(args.context) > args.max_context):
        raise SystemExit(f"dsuf bench: --max-context must be a multiple of 128 that holds every context, got {args.max_context}")
    if args.tokens_per_seq != 1 and not (args.model and 1 <= args.tokens_per_seq <= PREFILL_CHUNK):
        raise SystemExit(f"dsuf bench: --tokens-per-seq takes 1 to {PREFILL_CHUNK}, with --model")
    if args.tp > 1 and not args.model:
        raise SystemExit("dsuf bench: --tp runs the whole model: add --model")
    if args.shard_of > 1 and (not args.model or args.tp > 1):
        raise SystemExit("dsuf bench: --shard-of times one rank of the whole model on one GPU: add --model, without --tp")
    for world in {args.tp, args.shard_of} - {1}:
        try:
            check_tp(c, world)
        except ValueError as e:
            raise SystemExit(f"dsuf bench: {e}") from None
    if not torch.cuda.is_available():
        print("dsuf bench: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    props = torch.cuda.get_device_properties(device)
    print(f"dsuf bench: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}; layers {layers} "
          f"({', '.join(layer_kind(c.compress_ratios[i]) + (' hash' if c.is_hash_layer(i) else '') for i in layers)}), "
          f"batch {args.batch}, context {args.context}", flush=True)
    if args.tp > 1:
        if torch.cuda.device_count() < args.tp:
            raise SystemExit(f"dsuf bench: --tp {args.tp} needs {args.tp} GPUs, this machine has {torch.cuda.device_count()}")
        with tempfile.TemporaryDirectory() as tmp:
            torch.multiprocessing.start_processes(_bench_rank, args=(c, args, f"file://{tmp}/rendezvous"), nprocs=args.tp, start_method="spawn")
        return 0
    bw = copy_bandwidth(device)
    print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    if args.model:
        alone = None
        if args.shard_of > 1:  # the all-reduce kernels run with this rank alone (AbsentPeers)
            from . import tp as tensor_parallel
            from .model import step_rows

            local = IpcCollective.sharing_one_device(1, device, tensor_parallel.slot_bytes(c, args.shard_of, step_rows(max(args.batch))))[0]
            alone = TensorParallel(0, args.shard_of, AbsentPeers(args.shard_of, local))
        return bench_model(c, args, device, bw, alone)

    tensors: dict[str, torch.Tensor] = {}
    fast = []
    for i in layers:
        t = layer_tensors(c, i, device)
        tensors |= t
        fast.append(DecodeLayer(c, i, t, device))
    torch.cuda.synchronize()
    blocks = None
    if not args.no_reference:
        per_step = min(c.n_routed_experts, max(args.batch) * c.n_activated_experts)
        blocks = reference_blocks(c, layers, tensors, device, 3 * len(layers) * per_step)
    print(f"weights ready: {torch.cuda.memory_allocated() / 2**30:.1f} GiB on the GPU", flush=True)

    results = []
    for batch in args.batch:
        for ctx in args.context:
            results.append(bench_one(c, layers, fast, blocks, batch, ctx, bw, args, device))
            torch.cuda.empty_cache()
    print_report(c, layers, fast, results, bw)
    return 0


def bench_one(c: ModelConfig, layers: list[int], fast: list[DecodeLayer], blocks, batch: int, ctx: int, bw: float, args, device) -> Result:
    position = ctx - 1
    caches = [random_caches(c, c.compress_ratios[i], batch, ctx, device) for i in layers]
    before = [[t.clone() for t in compressor_states(st)] for st in caches]

    def rewind() -> None:
        """Put the compressor states back to before the step (every other cache write of the step
        is the same on a replay)."""
        for st, saved in zip(caches, before):
            for t, s in zip(compressor_states(st), saved):
                t.copy_(s)

    slots = torch.arange(batch, device=device)
    pos = torch.full((batch,), position, device=device)
    stages = []
    for fl, st in zip(fast, caches):
        stages += fl.stages(st, step_index(c, fl.ratio, st.n_max, fl.rope, slots, pos))
    x0 = (torch.randn(batch, c.hc_mult, c.dim, device=device) * torch.exp(torch.randn(batch, c.hc_mult, 1, device=device))).to(torch.bfloat16)
    ids = torch.randint(0, c.vocab_size, (batch,), device=device)
    buf = {f"x{layers[0]}": x0, "ids": ids, "slots": slots, "pos": pos}
    for s in stages:  # eager: loads every kernel, fills the buffers
        s.run(buf)
    torch.cuda.synchronize()
    out = buf[f"x{layers[-1] + 1}"].clone()
    distinct = [int(buf[f"{i}.route"][1].unique().numel()) for i in layers]
    rewind()
    if args.profile and (batch, ctx) == (args.batch[0], args.context[0]):
        print_profile(stages, buf, batch, ctx)
        rewind()

    errors = ref_ms = None
    if blocks is not None:

        def fresh_states() -> list[list]:
            return [reference_states(c, c.compress_ratios[i], st, position) for i, st in zip(layers, caches)]

        errors = sublayer_errors(blocks, c, layers, caches, buf, position)
        reference_step(blocks, fresh_states(), position, x0, ids)  # warm-up: dequantises the experts it routes to
        times = []
        for _ in range(3):
            states = fresh_states()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            reference_step(blocks, states, position, x0, ids)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ref_ms = statistics.median(times)

    stage_us: dict[str, tuple[str, float]] = {}
    if not args.no_stages:
        for s in stages:
            stage_us[s.name] = (s.by, replay_us(graph_of([s], buf), args.reps))
    graph = graph_of(stages, buf)
    step_us = replay_us(graph, args.reps)
    rewind()
    graph.replay()
    if not torch.equal(buf[f"x{layers[-1] + 1}"], out):
        print(f"  note: batch {batch} context {ctx}: the graph's output differs from the eager step's", flush=True)
    del graph
    nbytes = sum(step_bytes(c, i, batch, st.n_max, n) for i, st, n in zip(layers, caches, distinct))
    result = Result(batch, ctx, step_us, nbytes, nbytes / bw * 1e6, ref_ms, errors, stage_us)
    ref_text = f", reference {ref_ms:.1f} ms, {_errors_text(layers, errors)}" if ref_ms is not None else ""
    print(f"  batch {batch}, context {ctx}: {step_us:.1f} µs a step ({nbytes / 1e6:.0f} MB, floor {result.floor_us:.1f} µs){ref_text}; "
          f"distinct experts {distinct}", flush=True)
    return result


def print_profile(stages: list[Stage], buf: dict, batch: int, context: int) -> None:
    """The CUDA kernels of one eager step, by total device time (torch.profiler)."""
    profiled(lambda: [s.run(buf) for s in stages], f"one eager step, batch {batch}, context {context}")


def profiled(run: Callable[[], object], what: str, show: bool = True) -> None:
    """Run once under torch.profiler and print its CUDA kernels by total device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    if show:
        print(f"\nCUDA kernels of {what}:")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=70), flush=True)


def _errors_text(layers: list[int], errors: list[tuple[float, float, float]]) -> str:
    return "; ".join(f"L{i} attn {a:.1e} (ref {n:.1e}), MoE {m:.1e}" for i, (a, n, m) in zip(layers, errors))


def print_report(c: ModelConfig, layers: list[int], fast: list[DecodeLayer], results: list[Result], bw: float) -> None:
    torch_parts = sorted({part for fl in fast for part in fl.torch_parts()})
    print(f"\n### dsuf bench: {len(layers)} V4-Flash decode layer(s) {layers}, CUDA-graph replay (median), "
          f"floor = bytes / {bw / 1e9:.0f} GB/s (device-to-device copy, same run)")
    print("Kernels: mHC (coefficients, collapse + norm, expand), act_quant + FP8 linears, RMSNorm, RoPE, FP8 KV packing, "
          "index scores + top-k, sparse attention, router, MoE. Torch: " + "; ".join(torch_parts) + ".")
    stage_names = list(results[0].stage_us) if results and results[0].stage_us else []
    if stage_names:
        print("\n| stage | by | " + " | ".join(f"B{r.batch} {r.context // 1024}k µs" for r in results) + " |")
        print("|---|---|" + "---|" * len(results))
        for name in stage_names:
            by = results[0].stage_us[name][0]
            print(f"| {name} | {by} | " + " | ".join(f"{r.stage_us[name][1]:.1f}" for r in results) + " |")
        print("(each stage alone as a CUDA graph: includes one graph launch, and small weights may stay in L2 between replays)")
    if results and results[0].errors is not None:
        print("\nrel err vs reference: each sublayer's output against the reference's on the same input; (ref …) = how far the "
              "reference's own attention output moves when 1% of its input elements are one bf16 ulp off (top-k picks and "
              "FP8 roundings flip with random weights).")
    print("\n| batch | context | step µs | µs / layer | MB read | floor µs | × floor | reference ms | speed-up | rel err vs reference, per sublayer |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ref = f"{r.ref_ms:.1f} | {r.ref_ms * 1e3 / r.step_us:.0f}x | {_errors_text(layers, r.errors)}" if r.ref_ms is not None else "– | – | –"
        print(f"| {r.batch} | {r.context} | {r.step_us:.1f} | {r.step_us / len(layers):.1f} | {r.nbytes / 1e6:.0f} | "
              f"{r.floor_us:.1f} | {r.step_us / r.floor_us:.1f} | {ref} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsuf bench", description="time V4-Flash decode layers on the GPU against the HBM floor and the reference path")
    add_arguments(parser)
    return run(parser.parse_args(argv))
