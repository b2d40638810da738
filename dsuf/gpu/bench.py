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
- the decode step through the layers, captured as one CUDA graph, median of replays;
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
import json
import math
import statistics
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dsuf.model import quant
from dsuf.model.config import ModelConfig, parse_config
from dsuf.model.layers import Numerics, Rope

from .attention import KV_ENTRY_BYTES, new_pool, pack_kv, sparse_attention, unpack_kv
from .indexer import (
    INDEX_ENTRY_BYTES,
    fp4_quantize,
    index_scores,
    pack_index_keys,
    topk_indices,
    unpack_index_keys,
)
from .linear import BLOCK, Fp8Linear, act_quant
from .mhc import HcSite, hc_expand
from .moe import Fp4Experts, Fp8Expert, MoeDecode
from .norm import hc_collapse_rms_norm, rms_norm
from .rope import rope_
from .router import Router

# DeepSeek-V4-Flash's config.json: the architecture keys, with the released values.
V4_FLASH_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "sliding_window": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 3,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
    "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}
NUM = Numerics()  # reference numerics, bf16 activations


# ---- random weights in the checkpoint's formats ---------------------------------------------


def _fp8(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 [n, k] with E8M0 128x128 scales, values ~ N(0, 1/k)."""
    return quant.quant_fp8_weight(torch.randn(n, k, device=device) * k**-0.5, BLOCK)


def _fp4_stack(experts: int, n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 [E, n, k/2] (every code equally likely) with E8M0 per-32 scales near
    1/(3 sqrt(k)), so the values are ~ N(0, 1/k)-sized."""
    w = torch.randint(-128, 128, (experts, n, k // 2), dtype=torch.int8, device=device)
    code = 127 + round(math.log2(k**-0.5 / 2.9))
    s = torch.randint(code - 1, code + 2, (experts, n, k // 32), dtype=torch.uint8, device=device)
    return w, s.view(torch.float8_e8m0fnu)


def layer_tensors(c: ModelConfig, layer: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One layer's tensors under their checkpoint names (routed experts are views of stacked
    [E, ...] tensors, which `stacked_experts` returns)."""
    p, t = f"layers.{layer}", {}
    ratio, d = c.compress_ratios[layer], c.dim

    def fp8(name: str, n: int, k: int) -> None:
        t[f"{name}.weight"], t[f"{name}.scale"] = _fp8(n, k, device)

    def bf16(name: str, n: int, k: int) -> None:
        t[f"{name}.weight"] = (torch.randn(n, k, device=device) * k**-0.5).to(torch.bfloat16)

    def norm(name: str, n: int) -> None:
        t[f"{name}.weight"] = (1 + 0.1 * torch.randn(n, device=device)).to(torch.bfloat16)

    def compressor(name: str, ratio: int, width: int) -> None:
        rows = (2 if ratio == 4 else 1) * width
        t[f"{name}.ape"] = torch.randn(ratio, rows, device=device)
        bf16(f"{name}.wkv", rows, d)
        bf16(f"{name}.wgate", rows, d)
        norm(f"{name}.norm", width)

    hc_rows = (2 + c.hc_mult) * c.hc_mult
    for site in ("attn", "ffn"):
        t[f"{p}.hc_{site}_fn"] = torch.randn(hc_rows, c.hc_mult * d, device=device) * (c.hc_mult * d) ** -0.5
        t[f"{p}.hc_{site}_base"] = torch.randn(hc_rows, device=device) * 0.5
        t[f"{p}.hc_{site}_scale"] = torch.rand(3, device=device) + 0.5
    norm(f"{p}.attn_norm", d)
    norm(f"{p}.ffn_norm", d)
    a = f"{p}.attn"
    t[f"{a}.attn_sink"] = torch.randn(c.n_heads, device=device)
    fp8(f"{a}.wq_a", c.q_lora_rank, d)
    norm(f"{a}.q_norm", c.q_lora_rank)
    fp8(f"{a}.wq_b", c.n_heads * c.head_dim, c.q_lora_rank)
    fp8(f"{a}.wkv", c.head_dim, d)
    norm(f"{a}.kv_norm", c.head_dim)
    fp8(f"{a}.wo_a", c.o_groups * c.o_lora_rank, c.n_heads * c.head_dim // c.o_groups)
    fp8(f"{a}.wo_b", d, c.o_groups * c.o_lora_rank)
    if ratio:
        compressor(f"{a}.compressor", ratio, c.head_dim)
    if ratio == 4:
        fp8(f"{a}.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        bf16(f"{a}.indexer.weights_proj", c.index_n_heads, d)
        compressor(f"{a}.indexer.compressor", 4, c.index_head_dim)
    f = f"{p}.ffn"
    bf16(f"{f}.gate", c.n_routed_experts, d)
    if c.is_hash_layer(layer):
        t[f"{f}.gate.tid2eid"] = torch.rand(c.vocab_size, c.n_routed_experts, device=device).argsort(-1)[:, : c.n_activated_experts].contiguous()
    else:
        t[f"{f}.gate.bias"] = 0.1 * torch.randn(c.n_routed_experts, device=device)
    inter = c.moe_inter_dim
    stacks = {"w1": _fp4_stack(c.n_routed_experts, inter, d, device), "w3": _fp4_stack(c.n_routed_experts, inter, d, device), "w2": _fp4_stack(c.n_routed_experts, d, inter, device)}
    for name, (w, s) in stacks.items():
        t[f"{f}.experts.stacked.{name}.weight"], t[f"{f}.experts.stacked.{name}.scale"] = w, s
        for e in range(c.n_routed_experts):
            t[f"{f}.experts.{e}.{name}.weight"], t[f"{f}.experts.{e}.{name}.scale"] = w[e], s[e]
    fp8(f"{f}.shared_experts.w1", inter, d)
    fp8(f"{f}.shared_experts.w3", inter, d)
    fp8(f"{f}.shared_experts.w2", d, inter)
    return t


def layer_rope(c: ModelConfig, ratio: int, device: torch.device) -> Rope:
    """The layer's rotary table, as v4.Attention builds it (compressed layers: YaRN on the
    compressed base), on the device."""
    if ratio:
        rope = Rope(c.rope_head_dim, c.compress_rope_theta, (c.rope_factor, c.original_seq_len, c.beta_fast, c.beta_slow))
    else:
        rope = Rope(c.rope_head_dim, c.rope_theta)
    rope.freqs = rope.freqs.to(device)
    return rope


# ---- caches ---------------------------------------------------------------------------------


@dataclass
class Caches:
    """One layer's decode state for B sequences that all stand at position P = context - 1, in
    the fast path's layout. Sequence b owns pool entries [b*S, b*S + S), S = 128 + n: its window
    ring (slot pos % 128), then its n compressed entries (entry n - 1 is made by this step);
    index keys: rows [b*n, b*n + n) of the key pool (row n - 1 made by this step)."""

    batch: int
    position: int
    n_comp: int  # compressed entries after this step
    pool: torch.Tensor  # uint8 [B*S, 584]
    attn_idx: torch.Tensor  # int32 [B, 128 + selected]: the window, then the compressed picks
    window_slot: torch.Tensor  # int32 [B]
    comp_slot: torch.Tensor | None = None  # int32 [B]
    comp_base: torch.Tensor | None = None  # int32 [B]: pool entry of each sequence's compressed entry 0
    comp_kv: torch.Tensor | None = None  # float32 [B, rows, coff*512]: compressor state
    comp_score: torch.Tensor | None = None
    keys: torch.Tensor | None = None  # uint8 [B*n, 68]
    key_row: torch.Tensor | None = None  # int64 [B]: the key this step makes
    key_start: torch.Tensor | None = None  # int32 [B]
    n_keys: torch.Tensor | None = None  # int32 [B]
    idx_kv: torch.Tensor | None = None  # float32 [B, 8, 256]: indexer compressor state
    idx_score: torch.Tensor | None = None

    @property
    def stride(self) -> int:
        return self.pool.shape[0] // self.batch


def _compressor_state(batch: int, ratio: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random state of a compressor whose group completes at the next token: for ratio 4 the
    previous group (rows 0..3) and three pending rows (4..6); else ratio - 1 pending rows."""
    coff = 2 if ratio == 4 else 1
    kv = torch.zeros(batch, coff * ratio, coff * width, device=device)
    score = torch.full_like(kv, float("-inf"))
    used = coff * ratio - 1
    kv[:, :used] = torch.randn(batch, used, coff * width, device=device)
    score[:, :used] = torch.randn(batch, used, coff * width, device=device)
    return kv, score


def random_caches(c: ModelConfig, ratio: int, batch: int, context: int, device: torch.device) -> Caches:
    window, position = c.window_size, context - 1
    n = context // ratio if ratio else 0
    stride = window + n
    pool = new_pool(batch * stride, device)
    rows = torch.randn(batch * stride, c.head_dim, device=device) * torch.exp2(torch.randint(-2, 2, (batch * stride, c.head_dim // 64), device=device).float()).repeat_interleave(64, 1)
    pack_kv(rows.to(torch.bfloat16), pool)
    base = torch.arange(batch, device=device, dtype=torch.int32) * stride
    selected = min(c.index_topk, n) if ratio == 4 else n
    attn_idx = torch.full((batch, window + selected), -1, dtype=torch.int32, device=device)
    attn_idx[:, :window] = base[:, None] + torch.arange(window, device=device, dtype=torch.int32)
    if ratio and ratio != 4:
        attn_idx[:, window:] = base[:, None] + window + torch.arange(n, device=device, dtype=torch.int32)
    caches = Caches(batch, position, n, pool, attn_idx, (base + position % window).int())
    if ratio:
        caches.comp_slot = (base + window + n - 1).int()
        caches.comp_base = (base + window).int()
        caches.comp_kv, caches.comp_score = _compressor_state(batch, ratio, c.head_dim, device)
    if ratio == 4:
        keys = torch.randn(batch * n, c.index_head_dim, device=device) * torch.exp2(torch.randint(-3, 3, (batch * n, 4), device=device).float()).repeat_interleave(32, 1)
        caches.keys = pack_index_keys(keys.to(torch.bfloat16))
        caches.key_start = (torch.arange(batch, device=device, dtype=torch.int32) * n).int()
        caches.n_keys = torch.full((batch,), n, dtype=torch.int32, device=device)
        caches.key_row = caches.key_start.long() + n - 1
        caches.idx_kv, caches.idx_score = _compressor_state(batch, 4, c.index_head_dim, device)
    return caches


# ---- the fast path ----------------------------------------------------------------------------


def _kind(ratio: int) -> str:
    return "CSA" if ratio == 4 else "HCA" if ratio else "SWA"


@dataclass
class Stage:
    name: str
    by: str  # "kernels", "torch", or a mix
    run: Callable[[dict], None]


def _has_mm_out_dtype(device: torch.device) -> bool:
    """Whether this torch multiplies bf16 matrices into float32 (torch.mm(..., out_dtype=))."""
    try:
        torch.mm(torch.ones(2, 8, dtype=torch.bfloat16, device=device), torch.ones(8, 2, dtype=torch.bfloat16, device=device), out_dtype=torch.float32)
        return True
    except (TypeError, RuntimeError):
        return False


class FastLayer:
    """One decode layer on the GPU path: the kernels of dsuf.gpu where they exist, torch for the
    compressors' projections and pooling, the indexer's Hadamard rotation, and wo_a."""

    def __init__(self, c: ModelConfig, layer: int, t: dict[str, torch.Tensor], device: torch.device) -> None:
        p, a, f = f"layers.{layer}", f"layers.{layer}.attn", f"layers.{layer}.ffn"
        self.c, self.layer, self.ratio = c, layer, c.compress_ratios[layer]
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
        # wo_a: the reference dequantises it to bf16 and runs a bf16 einsum (torch here too).
        self.wo_a = quant.dequant_fp8_weight(t[f"{a}.wo_a.weight"], t[f"{a}.wo_a.scale"], BLOCK).to(torch.bfloat16).view(c.o_groups, c.o_lora_rank, -1)
        self.rope = layer_rope(c, self.ratio, device)
        # Every bf16 projection of the attention input in one matrix: the compressor's wkv, wgate,
        # the indexer compressor's wkv, wgate and the indexer's weights_proj.
        names = []
        if self.ratio:
            names += [f"{a}.compressor.wkv", f"{a}.compressor.wgate"]
            self.ape, self.comp_norm = t[f"{a}.compressor.ape"], t[f"{a}.compressor.norm.weight"].float()
        if self.ratio == 4:
            names += [f"{a}.indexer.compressor.wkv", f"{a}.indexer.compressor.wgate", f"{a}.indexer.weights_proj"]
            self.idx_ape, self.idx_norm = t[f"{a}.indexer.compressor.ape"], t[f"{a}.indexer.compressor.norm.weight"].float()
            self.idx_wq_b = fp8(f"{a}.indexer.wq_b")
        self.proj_split = [t[f"{n}.weight"].shape[0] for n in names]
        self.mm_out_dtype = _has_mm_out_dtype(device)
        if names:
            proj = torch.cat([t[f"{n}.weight"] for n in names])
            self.proj = proj if self.mm_out_dtype else proj.float()
        self.router = Router(t[f"{f}.gate.weight"], t.get(f"{f}.gate.bias"), t.get(f"{f}.gate.tid2eid"), c.n_activated_experts, c.route_scale)
        stacked = [t[f"{f}.experts.stacked.{w}.{k}"] for w in ("w1", "w3", "w2") for k in ("weight", "scale")]
        w1, s1, w3, s3, w2, s2 = stacked
        shared = [t[f"{f}.shared_experts.{w}.{k}"] for w in ("w1", "w3", "w2") for k in ("weight", "scale")]
        self.moe = MoeDecode(Fp4Experts.from_checkpoint(w1, s1, w3, s3, w2, s2), Fp8Expert(*shared), c.swiglu_limit)

    def torch_parts(self) -> list[str]:
        parts = ["wo_a (bf16 einsum, as the reference)"]
        if self.ratio:
            parts.insert(0, f"compressor projections ({'torch.mm bf16 -> fp32' if self.mm_out_dtype else 'fp32 matmul'}) and pooling")
        if self.ratio == 4:
            parts.insert(1, "indexer: the Hadamard rotation of queries and keys")
        return parts

    def _project(self, y: torch.Tensor) -> list[torch.Tensor]:
        """The bf16 projections of y in float32, split per weight."""
        out = torch.mm(y, self.proj.t(), out_dtype=torch.float32) if self.mm_out_dtype else y.float() @ self.proj.t()
        return list(out.split(self.proj_split, dim=1))

    @staticmethod
    def _pool(kv: torch.Tensor, score: torch.Tensor, st_kv: torch.Tensor, st_score: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
        """The entry the new token completes (layers.Compressor: softmax over the group's slots in
        float64, weighted sum of kv), bf16 [B, width], before its norm."""
        if ratio == 4:  # overlap: the previous group on channels [0, width), this group on [width, 2 width)
            pool_kv = torch.cat((st_kv[:, :4, :width], st_kv[:, 4:7, width:], kv[:, None, width:]), dim=1)
            pool_score = torch.cat((st_score[:, :4, :width], st_score[:, 4:7, width:], score[:, None, width:]), dim=1)
        else:
            pool_kv = torch.cat((st_kv[:, : ratio - 1], kv[:, None]), dim=1)
            pool_score = torch.cat((st_score[:, : ratio - 1], score[:, None]), dim=1)
        # The slots last: softmax over the innermost dim (torch's "spatial" softmax over dim 1 is slow).
        kv64, score64 = pool_kv.double().transpose(1, 2), pool_score.double().transpose(1, 2)
        return (kv64 * score64.softmax(dim=-1)).sum(dim=-1).float().to(torch.bfloat16)

    def stages(self, st: Caches, cos_sin: tuple[torch.Tensor, torch.Tensor], entry_cos_sin: tuple[torch.Tensor, torch.Tensor]) -> list[Stage]:
        """The decode step of this layer as stages over a buffer dict: reads f"x{layer}" (bf16
        [B, 4, D]) and "ids", writes f"x{layer + 1}". In-place ops touch only tensors made in the
        same stage, so any stage can be replayed alone."""
        c, L, ratio = self.c, self.layer, self.ratio
        batch, heads, hd = st.batch, c.n_heads, c.head_dim
        cos, sin = cos_sin

        def mhc_attn(b: dict) -> None:
            b[f"{L}.pre"], b[f"{L}.post"], b[f"{L}.comb"] = self.hc_attn.coefficients(b[f"x{L}"])
            b[f"{L}.y"] = hc_collapse_rms_norm(b[f"x{L}"], b[f"{L}.pre"], self.attn_norm, c.norm_eps)

        def qkv(b: dict) -> None:
            xq, sx = act_quant(b[f"{L}.y"])
            qr = rms_norm(self.wq_a.forward_quantized(xq, sx), self.q_norm, c.norm_eps)
            b[f"{L}.qr_q"] = act_quant(qr)
            q = rms_norm(self.wq_b.forward_quantized(*b[f"{L}.qr_q"]).view(batch, heads, hd), None, c.norm_eps)
            b[f"{L}.q"] = rope_(q, cos, sin)
            kv = rms_norm(self.wkv.forward_quantized(xq, sx), self.kv_norm, c.norm_eps)
            rope_(kv.view(batch, 1, hd), cos, sin)
            pack_kv(kv, st.pool, st.window_slot)

        def compress(b: dict) -> None:
            parts = self._project(b[f"{L}.y"])
            kv, score = parts[0], parts[1] + self.ape[ratio - 1]
            entry = rms_norm(self._pool(kv, score, st.comp_kv, st.comp_score, ratio, hd), self.comp_norm, c.norm_eps)
            pack_kv(rope_(entry.view(batch, 1, hd), *entry_cos_sin).view(batch, hd), st.pool, st.comp_slot)
            if ratio == 4:
                width = c.index_head_dim
                key = rms_norm(self._pool(parts[2], parts[3] + self.idx_ape[3], st.idx_kv, st.idx_score, 4, width), self.idx_norm, c.norm_eps)
                key = quant.hadamard_transform(rope_(key.view(batch, 1, width), *entry_cos_sin).view(batch, width))
                pack_index_keys(key, st.keys, st.key_row)
                b[f"{L}.weights"] = parts[4].to(torch.bfloat16).float() * (c.index_head_dim**-0.5 * c.index_n_heads**-0.5)

        def index_query(b: dict) -> None:
            qi = self.idx_wq_b.forward_quantized(*b[f"{L}.qr_q"]).view(batch, c.index_n_heads, c.index_head_dim)
            b[f"{L}.qi"] = fp4_quantize(quant.hadamard_transform(rope_(qi, cos, sin)))

        def index_select(b: dict) -> None:
            scores = index_scores(*b[f"{L}.qi"], b[f"{L}.weights"], st.keys, st.key_start, st.n_keys, st.n_comp)
            topk_indices(scores, st.n_keys, c.index_topk, out=st.attn_idx, out_col=c.window_size, offset=st.comp_base)

        def attend(b: dict) -> None:
            o = sparse_attention(b[f"{L}.q"], st.pool, st.attn_idx, self.sink, hd**-0.5)
            b[f"{L}.o"] = rope_(o, cos, sin, inverse=True)

        def wo_a(b: dict) -> None:
            b[f"{L}.oa"] = torch.einsum("tgd,grd->tgr", b[f"{L}.o"].view(batch, c.o_groups, -1), self.wo_a).flatten(1)

        def wo_b_expand(b: dict) -> None:
            b[f"{L}.attn"] = self.wo_b(b[f"{L}.oa"])
            b[f"{L}.xa"] = hc_expand(b[f"{L}.attn"], b[f"x{L}"], b[f"{L}.post"], b[f"{L}.comb"])

        def mhc_ffn_route(b: dict) -> None:
            b[f"{L}.pre2"], b[f"{L}.post2"], b[f"{L}.comb2"] = self.hc_ffn.coefficients(b[f"{L}.xa"])
            b[f"{L}.y2"] = hc_collapse_rms_norm(b[f"{L}.xa"], b[f"{L}.pre2"], self.ffn_norm, c.norm_eps)
            b[f"{L}.route"] = self.router(b[f"{L}.y2"], b["ids"])

        def moe_expand(b: dict) -> None:
            b[f"{L}.moe"] = self.moe(b[f"{L}.y2"], *b[f"{L}.route"])
            b[f"x{L + 1}"] = hc_expand(b[f"{L}.moe"], b[f"{L}.xa"], b[f"{L}.post2"], b[f"{L}.comb2"])

        kind = _kind(ratio)
        out = [
            Stage(f"L{L} mHC coefficients + collapse + norm", "kernels", mhc_attn),
            Stage(f"L{L} q / kv projections, norms, RoPE, window write", "kernels", qkv),
        ]
        if ratio:
            out.append(Stage(f"L{L} {kind} compressor{'s' if ratio == 4 else ''} (projections, pooling, entry write)", "torch + kernels", compress))
        if ratio == 4:
            out += [
                Stage(f"L{L} indexer query (wq_b, RoPE, FP4; Hadamard in torch)", "kernels + torch", index_query),
                Stage(f"L{L} index scores + top-{c.index_topk}", "kernels", index_select),
            ]
        out += [
            Stage(f"L{L} sparse attention ({kind}) + inverse RoPE", "kernels", attend),
            Stage(f"L{L} wo_a (bf16 einsum)", "torch", wo_a),
            Stage(f"L{L} wo_b + mHC expand", "kernels", wo_b_expand),
            Stage(f"L{L} mHC + router{' (hash)' if self.hash else ''}", "kernels", mhc_ffn_route),
            Stage(f"L{L} MoE (6 routed FP4 + shared FP8) + mHC expand", "kernels", moe_expand),
        ]
        return out


# ---- bytes a step must read ----------------------------------------------------------------


def _fp8_bytes(n: int, k: int) -> int:
    return n * k + math.ceil(n / BLOCK) * math.ceil(k / BLOCK)


def step_bytes(c: ModelConfig, layer: int, batch: int, n_comp: int, distinct_experts: int) -> int:
    """Bytes one decode step of the layer must read at least once: its weights in checkpoint
    formats (routed experts: the distinct ones routed to) and the KV entries / index keys used."""
    ratio, d, hd, inter = c.compress_ratios[layer], c.dim, c.head_dim, c.moe_inter_dim
    total = 2 * ((2 + c.hc_mult) * c.hc_mult * (c.hc_mult * d + 1) * 4 + 12) + 2 * 2 * d  # mHC sites, norms
    total += _fp8_bytes(c.q_lora_rank, d) + _fp8_bytes(c.n_heads * hd, c.q_lora_rank) + _fp8_bytes(hd, d)
    total += _fp8_bytes(c.o_groups * c.o_lora_rank, c.n_heads * hd // c.o_groups) + _fp8_bytes(d, c.o_groups * c.o_lora_rank)
    total += 2 * (c.q_lora_rank + hd) + 4 * c.n_heads
    if ratio:
        rows = (2 if ratio == 4 else 1) * hd
        total += 2 * rows * d * 2 + ratio * rows * 4 + 2 * hd
    if ratio == 4:
        rows = 2 * c.index_head_dim
        total += _fp8_bytes(c.index_n_heads * c.index_head_dim, c.q_lora_rank) + c.index_n_heads * d * 2
        total += 2 * rows * d * 2 + 4 * rows * 4 + 2 * c.index_head_dim
    total += c.n_routed_experts * d * 2 + (0 if c.is_hash_layer(layer) else 4 * c.n_routed_experts)
    expert = 2 * (inter * d // 2 + inter * d // 32) + d * inter // 2 + d * inter // 32
    total += distinct_experts * expert + 2 * _fp8_bytes(inter, d) + _fp8_bytes(d, inter)
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


def reference_states(c: ModelConfig, ratio: int, st: Caches) -> list:
    """The reference's per-sequence LayerStates holding exactly what the fast path's caches hold."""
    from dsuf.model.state import CompressorState, LayerState

    window, n = c.window_size, st.n_comp
    out = []
    for b in range(st.batch):
        base = b * st.stride
        state = LayerState(window=unpack_kv(st.pool[base : base + window]))
        if ratio:
            state.compressed = unpack_kv(st.pool[base + window : base + window + n - 1])
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


def sublayer_errors(blocks: list, c: ModelConfig, layers: list[int], caches: list[Caches], buf: dict, position: int) -> list[tuple[float, float, float]]:
    """Per layer, on the fast path's own sublayer inputs: (rel err of its attention output against
    the reference Attention's, how far the reference's attention output itself moves when 1% of
    its input elements are one bf16 ulp off, rel err of its MoE output against the reference
    MoE's). Chained layers are no use for this with random weights: the reference alone turns a
    one-ulp input change into a different routed expert or different top-k picks."""
    from dsuf.model import v4

    def attention(block, layer: int, st: Caches, y: torch.Tensor) -> torch.Tensor:
        states = reference_states(c, c.compress_ratios[layer], st)
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
    """The stages captured as one CUDA graph, replayed once (so its outputs are valid)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in stages:
            s.run(buf)
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
    p.add_argument("--first-layer", type=int, default=2, help="first layer (default 2: a CSA layer with hash routing, then an HCA layer)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    p.add_argument("--context", type=int, nargs="+", default=[4096, 65536], help="context lengths, multiples of 128 (default 4096 65536)")
    p.add_argument("--reps", type=int, default=20, help="graph replays timed (median)")
    p.add_argument("--no-reference", action="store_true", help="skip the reference path")
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage timing")
    p.add_argument("--profile", action="store_true", help="also print the CUDA kernels of one eager step of the first configuration (torch.profiler)")
    p.add_argument("--config", help="a config.json to take the shapes from (default: V4-Flash's, built in)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("dsuf bench: no CUDA device", file=sys.stderr)
        return 2
    raw = json.loads(Path(args.config).read_text()) if args.config else V4_FLASH_CONFIG
    c = parse_config(raw)
    if getattr(c, "family", "v4") != "v4":
        raise SystemExit("dsuf bench: only V4-Flash layers are benchmarked so far")
    layers = list(range(args.first_layer, args.first_layer + args.layers))
    if not layers or layers[-1] >= c.n_layers:
        raise SystemExit(f"dsuf bench: layers {layers} are not all in the model's {c.n_layers}")
    for ctx in args.context:
        if ctx % 128 or ctx < 256:
            raise SystemExit(f"dsuf bench: contexts must be multiples of 128 of at least 256, got {ctx}")
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    props = torch.cuda.get_device_properties(device)
    print(f"dsuf bench: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}; layers {layers} "
          f"({', '.join(_kind(c.compress_ratios[i]) + (' hash' if c.is_hash_layer(i) else '') for i in layers)}), "
          f"batch {args.batch}, context {args.context}", flush=True)
    bw = copy_bandwidth(device)
    print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)", flush=True)

    tensors: dict[str, torch.Tensor] = {}
    fast = []
    for i in layers:
        t = layer_tensors(c, i, device)
        tensors |= t
        fast.append(FastLayer(c, i, t, device))
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


def bench_one(c: ModelConfig, layers: list[int], fast: list[FastLayer], blocks, batch: int, ctx: int, bw: float, args, device) -> Result:
    position = ctx - 1
    caches = [random_caches(c, c.compress_ratios[i], batch, ctx, device) for i in layers]
    stages = []
    for fl, st in zip(fast, caches):
        rope = fl.rope
        cos_sin = rope.cos_sin(torch.full((batch,), position, device=device))
        entry = rope.cos_sin(torch.full((batch,), position - (fl.ratio - 1 if fl.ratio else 0), device=device))
        stages += fl.stages(st, cos_sin, entry)
    x0 = (torch.randn(batch, c.hc_mult, c.dim, device=device) * torch.exp(torch.randn(batch, c.hc_mult, 1, device=device))).to(torch.bfloat16)
    ids = torch.randint(0, c.vocab_size, (batch,), device=device)
    buf = {f"x{layers[0]}": x0, "ids": ids}
    for s in stages:  # eager: loads every kernel, fills the buffers
        s.run(buf)
    torch.cuda.synchronize()
    out = buf[f"x{layers[-1] + 1}"].clone()
    distinct = [int(buf[f"{i}.route"][1].unique().numel()) for i in layers]
    if args.profile and (batch, ctx) == (args.batch[0], args.context[0]):
        print_profile(stages, buf, batch, ctx)

    errors = ref_ms = None
    if blocks is not None:

        def fresh_states() -> list[list]:
            return [reference_states(c, c.compress_ratios[i], st) for i, st in zip(layers, caches)]

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
    if not torch.equal(buf[f"x{layers[-1] + 1}"], out):
        print(f"  note: batch {batch} context {ctx}: the graph's output differs from the eager step's", flush=True)
    del graph
    nbytes = sum(step_bytes(c, i, batch, st.n_comp, n) for i, st, n in zip(layers, caches, distinct))
    result = Result(batch, ctx, step_us, nbytes, nbytes / bw * 1e6, ref_ms, errors, stage_us)
    ref_text = f", reference {ref_ms:.1f} ms, {_errors_text(layers, errors)}" if ref_ms is not None else ""
    print(f"  batch {batch}, context {ctx}: {step_us:.1f} µs a step ({nbytes / 1e6:.0f} MB, floor {result.floor_us:.1f} µs){ref_text}; "
          f"distinct experts {distinct}", flush=True)
    return result


def print_profile(stages: list[Stage], buf: dict, batch: int, context: int) -> None:
    """The CUDA kernels of one eager step, by total device time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for s in stages:
            s.run(buf)
        torch.cuda.synchronize()
    print(f"\nCUDA kernels of one eager step, batch {batch}, context {context}:")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=70), flush=True)


def _errors_text(layers: list[int], errors: list[tuple[float, float, float]]) -> str:
    return "; ".join(f"L{i} attn {a:.1e} (ref {n:.1e}), MoE {m:.1e}" for i, (a, n, m) in zip(layers, errors))


def print_report(c: ModelConfig, layers: list[int], fast: list[FastLayer], results: list[Result], bw: float) -> None:
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
