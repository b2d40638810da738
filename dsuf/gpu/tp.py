"""Tensor parallelism of the GPU path: how the weights split over the ranks of one host, and the
ranks' process group and collective.

The split is made for batch-1 decode, and differs from the reference converter's plan
(checkpoint.shard_rule) where that plan would cost time:
- attention: the query heads split (wq_b rows, attn_sink, wo_a's groups), wo_b by columns, so each
  rank adds a partial sum of the attention output: all-reduced. The single KV head, the
  compressors and the whole indexer are replicated: the indexer's top-k needs every head's
  scores, and reading its 8 MB wq_b costs less than one more all-reduce a layer.
- MoE: every routed expert and the shared expert split along the intermediate dimension (w1 / w3
  rows, w2 columns), so a token's six experts load every rank equally (an expert-parallel split
  leaves one rank most of them at batch 1); the partial outputs are all-reduced.
- the head by vocabulary rows, the logits all-gathered; the embedding replicated (a step reads B
  of its rows, not the table).
Replicated parts run on every rank on identical inputs (the collectives give every rank the same
bits), so replicated state (KV caches, compressor states, expert routes) stays identical on all
ranks, and any rank can export a sequence's state.

A prompt chunk is the exception: each rank keeps the mHC streams of its share of the chunk's rows
and does the per-row work no rank needs to repeat for them (the streams' update, collapse and norm,
the routing, the indexer's queries, scores and top-k: a quarter of a chunk's time, replicated);
the sublayers' partial sums are reduce-scattered instead of all-reduced, and the block inputs,
routes and top-k picks gathered, moving the same bytes (GpuModel._layers, layer.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsuf.model.checkpoint import ShardRule
from dsuf.model.config import ModelConfig

from .collective import Collective, IpcCollective, NcclCollective

_ROWS = re.compile(r"^head\.weight$|\.attn\.(wq_b|wo_a)\.(weight|scale)$|\.attn\.attn_sink$|\.ffn\.(shared_experts|experts\.\w+)\.w[13]\.(weight|scale)$")
_COLS = re.compile(r"\.attn\.wo_b\.(weight|scale)$|\.ffn\.(shared_experts|experts\.\w+)\.w2\.(weight|scale)$")


def shard_dim(name: str) -> int | None:
    """The dimension of tensor `name` split over the ranks (None: replicated). Stacked routed
    experts ([E, rows, cols], random weights) split one dimension further in."""
    stacked = ".experts.stacked." in name
    if _ROWS.search(name):
        return 1 if stacked else 0
    if _COLS.search(name):
        return 2 if stacked else 1
    return None


def shard_rule(name: str) -> ShardRule:
    """`shard_dim` as checkpoint.load_tensors takes it (for reading a rank's slices of a checkpoint)."""
    return ShardRule(dim=shard_dim(name))


def shard(tensors: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of every tensor (split ones copied out, so the whole can be freed)."""
    if world == 1:
        return tensors
    out = {}
    for name, t in tensors.items():
        dim = shard_dim(name)
        if dim is None:
            out[name] = t
            continue
        per = t.shape[dim] // world
        out[name] = t.narrow(dim, rank * per, per).clone()
    return out


def check_tp(c: ModelConfig, world: int) -> None:
    """A one-line ValueError where the split cannot fall on heads, groups, and quantisation
    blocks, or the kernels' tile sizes."""
    wrong = []
    if world < 1 or world > 8 or world & (world - 1):
        wrong.append("the ranks must be 1, 2, 4 or 8")
    elif world > 1:
        if c.n_heads % world or c.o_groups % world:
            wrong.append(f"{c.n_heads} heads in {c.o_groups} groups")
        if c.moe_inter_dim % (128 * world):
            wrong.append(f"moe_inter_dim {c.moe_inter_dim} (needs a multiple of {128 * world})")
        for what, rows in (("query rows (heads x head_dim)", c.n_heads * c.head_dim), ("wo_a rows (o_groups x o_lora_rank)", c.o_groups * c.o_lora_rank)):
            if rows % (128 * world):
                wrong.append(f"{what} {rows} (needs a multiple of {128 * world}: FP8 blocks of 128)")
        if c.vocab_size % (4 * world):
            wrong.append(f"vocab_size {c.vocab_size} (needs a multiple of {4 * world})")
    if wrong:
        raise ValueError(f"{c.name} cannot be split over {world} GPUs: " + ", ".join(wrong))


MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def slot_bytes(c: ModelConfig, world: int, rows: int) -> int:
    """The largest message a rank gives a collective of a step of `rows` rows (model.step_rows):
    the rows' hidden state (bf16) or its share of their logits (float32)."""
    return rows * max(2 * c.dim, 4 * c.vocab_size // world)


@dataclass
class TensorParallel:
    rank: int
    world: int
    collective: Collective

    def own_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's share of the rows of t (a prompt chunk split by rows: rank r's r·T/world …),
        as reduce_scatter leaves them and all_gather_rows takes them."""
        return t.chunk(self.world)[self.rank]

    def kernels_ready(self, device: torch.device) -> None:
        """Compile (or find cached) every kernel for the device, then wait for all ranks: a rank
        compiling while a peer waits in a collective could outlast the collective's timeout."""
        from .build import build_all
        from .runtime import device_arch

        build_all((device_arch(device),))
        if dist.is_initialized():  # (not for a rank timed alone: dsuf bench --shard-of)
            dist.barrier()


def start(rank: int, world: int, init_method: str, device: torch.device, kind: str = "ipc", slot_bytes: int = 16 << 20,
          bulk: bool = True) -> TensorParallel:
    """Join the ranks' process group (gloo, for setting up) and build the collective: "ipc"
    (kernels_cu/collective.cu, with inbox slots of slot_bytes, and with `bulk` NCCL for prompt
    chunks' large messages) or "nccl". NCCL's communicator is set up here, not on a first request.
    Without `bulk` (ranks sharing one GPU, which NCCL refuses: tests) the IPC kernels take every
    message, so slot_bytes must hold a prompt chunk's."""
    for key, off in MULTICAST_OFF.items():  # NVLink multicast stays off on these machines
        os.environ.setdefault(key, off)
    # No NCCL heartbeat thread: it only reports (noisily) that rank 0's store went away when the
    # server stops; a dead peer is caught by the engine, which stops every worker.
    os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    if kind not in ("ipc", "nccl") or (kind == "nccl" and not bulk):
        raise ValueError(f"unknown collective {kind!r} (ipc, or nccl with bulk)")
    nccl = None
    if bulk:
        nccl = NcclCollective(dist.new_group(backend="nccl"))
        nccl.all_reduce(torch.zeros(8, dtype=torch.bfloat16, device=device))
    return TensorParallel(rank, world, IpcCollective(None, device, slot_bytes, bulk=nccl) if kind == "ipc" else nccl)
