"""Random weights of V4-Flash's real shapes and formats, made on the GPU (no checkpoint needed):
FP8 e4m3 with 128x128 E8M0 scales, FP4 experts with per-32 scales, bf16 and float32 where the
checkpoint has them, under the checkpoint's tensor names. `dsuf bench` and `dsuf serve
--random-weights` use the same generator. Values are sized like trained weights (~N(0, 1/fan_in))
so activations stay in range through many layers."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from dsuf.model import quant
from dsuf.model.config import ModelConfig, parse_config

from .linear import BLOCK
from .tp import shard

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
    return block_tensors(c, f"layers.{layer}", c.compress_ratios[layer], c.is_hash_layer(layer), device)


def mtp_tensors(c: ModelConfig, device: torch.device, stage: int = 0) -> dict[str, torch.Tensor]:
    """The NextN MTP layer's tensors (checkpoint.mtp_schema): a window-only block, its input
    projections and norms, and its own mHC head."""
    p, d = f"mtp.{stage}", c.dim
    t = block_tensors(c, p, 0, False, device)
    for name in ("e_proj", "h_proj"):
        t[f"{p}.{name}.weight"], t[f"{p}.{name}.scale"] = _fp8(d, d, device)
    for name in ("enorm", "hnorm", "norm"):
        t[f"{p}.{name}.weight"] = (1 + 0.1 * torch.randn(d, device=device)).to(torch.bfloat16)
    t[f"{p}.hc_head_fn"] = torch.randn(c.hc_mult, c.hc_mult * d, device=device) * (c.hc_mult * d) ** -0.5
    t[f"{p}.hc_head_base"] = torch.randn(c.hc_mult, device=device) * 0.5
    t[f"{p}.hc_head_scale"] = torch.rand(1, device=device) + 0.5
    return t


def block_tensors(c: ModelConfig, p: str, ratio: int, hashed: bool, device: torch.device) -> dict[str, torch.Tensor]:
    """A block's tensors under the checkpoint prefix p (a backbone layer's or the MTP layer's)."""
    t: dict[str, torch.Tensor] = {}
    d = c.dim

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
    if hashed:
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


def head_tensors(c: ModelConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """The embedding, the head, the final norm and the head's mHC collapse."""
    d = c.dim
    return {
        "embed.weight": torch.randn(c.vocab_size, d, device=device).to(torch.bfloat16),
        "head.weight": (torch.randn(c.vocab_size, d, device=device) * d**-0.5).to(torch.bfloat16),
        "norm.weight": (1 + 0.1 * torch.randn(d, device=device)).to(torch.bfloat16),
        "hc_head_fn": torch.randn(c.hc_mult, c.hc_mult * d, device=device) * (c.hc_mult * d) ** -0.5,
        "hc_head_base": torch.randn(c.hc_mult, device=device) * 0.5,
        "hc_head_scale": torch.rand(1, device=device) + 0.5,
    }


def model_tensors(c: ModelConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """The whole model's tensors at once (the MTP layer's too, where the config has one), from the
    global random generator."""
    t = head_tensors(c, device)
    for i in range(c.n_layers):
        t |= layer_tensors(c, i, device)
    if c.n_mtp_layers and c.dspark is None:
        t |= mtp_tensors(c, device)
    return t


def random_source(c: ModelConfig, device: torch.device, seed: int, rank: int = 0, world: int = 1) -> Callable[[int | None], dict[str, torch.Tensor]]:
    """The model's tensors made one layer at a time as GpuModel asks for them (a TensorSource),
    each part from its own seed: every rank of a tensor-parallel model makes the same whole part
    and keeps its shard, so any number of ranks holds the same model."""

    def take(layer: int | str | None) -> dict[str, torch.Tensor]:
        mtp = isinstance(layer, str)  # the MTP layer ("mtp.0"), made after the backbone's
        torch.manual_seed(seed * 1_000_003 + (0 if layer is None else c.n_layers + 1 if mtp else layer + 1))
        t = head_tensors(c, device) if layer is None else mtp_tensors(c, device) if mtp else layer_tensors(c, layer, device)
        # The routed experts as the stacked tensors only (the per-expert views are for the reference model).
        return shard({k: v for k, v in t.items() if ".experts." not in k or ".experts.stacked." in k}, rank, world)

    return take


def random_weights_config(path: Path) -> ModelConfig:
    """The config of `--random-weights CONFIG` (a config.json), named after the file: the front end
    and the worker must agree on the name, which conversation caches record."""
    return parse_config(json.loads(path.read_text()), f"random-{path.stem}")
