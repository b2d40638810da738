"""Collectives among the tensor-parallel ranks of one host, for the decode step.

Two implementations of one small interface (`all_reduce`: bf16 partial sums -> their sum on every
rank; `all_gather`: each rank's float32 columns -> every rank's, side by side), both capturable in
CUDA graphs, and, for prompt chunks split by rows over the ranks (GpuModel._layers), a
reduce-scatter of bf16 partial sums and an all-gather of rows:

- `IpcCollective`: kernels_cu/collective.cu over CUDA IPC peer buffers, one launch a call and no
  NCCL; built for the decode step's small messages, where NCCL's latency (~36 µs an all-reduce
  between two H200, design.md) would cost more than the layer it serves. Its 32 CTAs move a
  prompt chunk's megabytes slowly, so it hands messages of BULK_BYTES and more, outside graph
  capture, to an NCCL group (`bulk`).
- `NcclCollective`: torch.distributed on NCCL, for comparison (`dsuf bench --collective nccl`).

Both need a process group over all ranks to set up (the IPC one exchanges its memory handles
through it, e.g. gloo).
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch
import torch.distributed as dist

from .mhc import HC_N, hc_expand
from .peers import EMPTY, MAX_RANKS, Peers
from .runtime import _check, _driver, get_kernel

CTAS = 32  # mirror of collective.cu
THREADS = 128
HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
BULK_BYTES = 1 << 20  # from here an all-reduce goes to NCCL (a prompt chunk of 128 rows and more)


def bulk_message(nbytes: int) -> bool:
    """Whether a message of nbytes is one the split hands to NCCL (a prompt chunk's large one,
    outside graph capture)."""
    return nbytes >= BULK_BYTES and not torch.cuda.is_current_stream_capturing()


class Collective(Protocol):
    rank: int
    world: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 [..., n] partial sums -> their sum over the ranks (same bits on every rank)."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [rows, n] -> [rows, world * n], rank r's columns at r * n."""
        ...

    def all_reduce_expand(self, partial: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                          pushed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A sublayer's partial outputs bf16 [T, D] summed, then the mHC update of the streams x
        bf16 [T, 4, D] with it (mhc.hc_expand): (the sum, the new streams). pushed: the kernel that
        made `partial` pushed it to the peers (given `sender`'s peers)."""
        ...

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 partial sums [T, ...], T a multiple of world -> this rank's rows of their sum:
        [rank·T/world, (rank+1)·T/world)."""
        ...

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Each rank's rows [T/world, ...] (a multiple of 16 bytes in all) -> [T, ...], rank r's rows
        at r·T/world."""
        ...

    def sender(self, nbytes: int) -> Peers | None:
        """Where the kernel making this rank's part (bf16, nbytes) of the next all-reduce can push
        it to the peers itself (peers.cuh's send_vec): the peers to give it, or None (nothing to
        push, or a message that does not go through the IPC kernels)."""
        ...


class _CollParams(ctypes.Structure):
    _fields_ = [
        ("peers", Peers),
        ("inp", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("rows", ctypes.c_int),
        ("x", ctypes.c_void_p),
        ("post", ctypes.c_void_p),
        ("comb", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("dim", ctypes.c_int),
        ("pushed", ctypes.c_int),
    ]


class IpcCollective:
    """Inboxes in every rank's memory, two slots of `slot_bytes` (the largest message a rank
    contributes) for each sender, mapped into every other rank through CUDA IPC. Construct it on
    every rank of `group` at the same time (it exchanges handles and waits for all)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, slot_bytes: int, bulk: NcclCollective | None = None) -> None:
        self._setup(dist.get_rank(group), dist.get_world_size(group), device, slot_bytes, bulk)
        own = self._buffers()
        everyone: list[bytes | None] = [None] * self.world
        dist.all_gather_object(everyone, self._handle(own), group=group)
        self._wire([own if r == self.rank else self._open(theirs) for r, theirs in enumerate(everyone)])
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # nobody launches before every rank has mapped every buffer

    @classmethod
    def sharing_one_device(cls, world: int, device: torch.device, slot_bytes: int) -> list[IpcCollective]:
        """`world` ranks' collectives for ranks that share one GPU in this process (tests of the
        tensor-parallel path on a machine of one GPU): each rank's inbox addressed by the others
        directly. Run each rank's work on a stream of its own, so that one rank's kernel
        waiting for its peers never holds back theirs; messages of any size take the IPC kernels."""
        ranks = [cls.__new__(cls) for _ in range(world)]
        for r, c in enumerate(ranks):
            c._setup(r, world, device, slot_bytes, None)
        buffers = [c._buffers() for c in ranks]
        for c in ranks:
            c._wire(buffers)
        torch.cuda.synchronize(device)
        return ranks

    def _setup(self, rank: int, world: int, device: torch.device, slot_bytes: int, bulk: NcclCollective | None) -> None:
        if world > MAX_RANKS:
            raise ValueError(f"IpcCollective: at most {MAX_RANKS} ranks, got {world}")
        if device.index is None:  # ("cuda": the current one, as tensors made there name it)
            device = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.world, self.device, self.bulk = rank, world, device, bulk
        self.slot_bytes = -(-slot_bytes // 16) * 16
        torch.zeros(1, device=device)  # the primary context, current on this thread
        self.epoch = torch.zeros(CTAS, dtype=torch.int32, device=device)

    def _buffers(self) -> object:
        """This rank's inbox, every word EMPTY. Held for the process's life: the driver frees it,
        and unmaps the peers', at exit."""
        nbytes = 2 * self.world * self.slot_bytes
        inbox = self._alloc(nbytes)
        (err,) = _driver().cuMemsetD32(inbox, EMPTY, nbytes // 4)
        _check(err, "cuMemsetD32")
        return inbox

    def _wire(self, inboxes: list) -> None:
        """Every rank's inbox as this rank addresses it."""
        peers = Peers()
        for r, inbox in enumerate(inboxes):
            peers.inbox[r] = int(inbox)
        peers.epoch, peers.slot_bytes, peers.rank, peers.world = self.epoch.data_ptr(), self.slot_bytes, self.rank, self.world
        self._peers = peers

    @staticmethod
    def _alloc(nbytes: int):
        err, p = _driver().cuMemAlloc(nbytes)
        _check(err, f"cuMemAlloc({nbytes})")
        return p

    @staticmethod
    def _handle(p) -> bytes:
        err, h = _driver().cuIpcGetMemHandle(p)
        _check(err, "cuIpcGetMemHandle")
        return ctypes.string_at(h.getPtr(), HANDLE_BYTES)

    @staticmethod
    def _open(raw: bytes):
        driver = _driver()
        h = driver.CUipcMemHandle()
        ctypes.memmove(h.getPtr(), raw, HANDLE_BYTES)
        err, p = driver.cuIpcOpenMemHandle(h, driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        _check(err, "cuIpcOpenMemHandle")
        return p

    def _launch(self, name: str, inp: torch.Tensor, out: torch.Tensor, n: int, rows: int, **expand: int) -> None:
        if inp.device != self.device or not inp.is_contiguous():
            raise ValueError(f"{name}: need a contiguous tensor on {self.device}")
        if inp.numel() * inp.element_size() > self.slot_bytes:
            raise ValueError(f"{name}: {inp.numel() * inp.element_size()} bytes exceed the inbox slot of {self.slot_bytes}")
        p = _CollParams(self._peers, inp.data_ptr(), out.data_ptr(), n, rows, **expand)
        get_kernel("collective", name, self.device)((CTAS, 1, 1), THREADS, [p])

    def _to_bulk(self, nbytes: int) -> bool:
        return self.bulk is not None and bulk_message(nbytes)

    def sender(self, nbytes: int) -> Peers | None:
        return self._peers if self.world > 1 and not self._to_bulk(nbytes) and nbytes <= self.slot_bytes else None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.numel() % 8:
            raise ValueError(f"all_reduce: need bf16 with a multiple of 8 elements, got {x.dtype} {tuple(x.shape)}")
        if self._to_bulk(x.numel() * x.element_size()):
            return self.bulk.all_reduce(x)
        out = torch.empty_like(x)
        self._launch("all_reduce_bf16", x, out, x.numel(), 1)
        return out

    def all_reduce_expand(self, partial: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                          pushed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        t, d = partial.shape
        if partial.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or tuple(x.shape) != (t, HC_N, d) or d % 8:
            raise ValueError(f"all_reduce_expand: need bf16 partial [T, D] and streams [T, {HC_N}, D], got {tuple(partial.shape)}, {tuple(x.shape)}")
        nbytes = partial.numel() * partial.element_size()
        if pushed and self.sender(nbytes) is None:
            raise ValueError(f"all_reduce_expand: a part of {nbytes} bytes cannot have been pushed (sender gives no peers for it)")
        if self._to_bulk(nbytes):
            return self.bulk.all_reduce_expand(partial, x, post, comb)
        out, x = torch.empty_like(partial), x.contiguous()
        y = torch.empty_like(x)
        post, comb = post.float().contiguous(), comb.float().contiguous()
        self._launch("all_reduce_expand_bf16", partial, out, partial.numel(), 1,
                     x=x.data_ptr(), post=post.data_ptr(), comb=comb.data_ptr(), y=y.data_ptr(), dim=d, pushed=int(pushed))
        return out, y

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % 4:
            raise ValueError(f"all_gather: need float32 [rows, n] with n a multiple of 4, got {x.dtype} {tuple(x.shape)}")
        rows, n = x.shape
        out = torch.empty((rows, self.world * n), dtype=torch.float32, device=x.device)
        self._launch("all_gather_f32", x, out, n, rows)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        _check_rows(x, self.world)
        if self._to_bulk(x.numel() * x.element_size()):
            return self.bulk.reduce_scatter(x)
        return self.all_reduce(x).chunk(self.world)[self.rank]  # (small: ranks sharing a GPU in tests)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        if nbytes % 16 or x.dim() < 1:
            raise ValueError(f"all_gather_rows: need rows of a multiple of 16 bytes in all, got {x.dtype} {tuple(x.shape)}")
        if self._to_bulk(self.world * nbytes):
            return self.bulk.all_gather_rows(x)
        # The kernel gathers float32 columns: the rows' bytes as one row of them, ranks side by side.
        words = x.contiguous().view(-1).view(torch.uint8).view(torch.float32).view(1, -1)
        return self.all_gather(words).view(torch.uint8).view(x.dtype).view(self.world * x.shape[0], *x.shape[1:])


class NcclCollective:
    """The same interface on torch.distributed's NCCL process group `group`."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def all_reduce_expand(self, partial: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                          pushed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        total = self.all_reduce(partial)
        return total, hc_expand(total, x, post, comb)

    def sender(self, nbytes: int) -> Peers | None:
        return None

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        rows, n = x.shape
        out = torch.empty((self.world, rows, n), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out.permute(1, 0, 2).reshape(rows, self.world * n)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        _check_rows(x, self.world)
        out = torch.empty((x.shape[0] // self.world, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=self.group)
        return out

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((self.world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out


class AbsentPeers:
    """Rank 0 of a `world`-rank split run without its peers (`dsuf bench --shard-of`): the GPU does a
    real rank's share of every step, and the collectives' communication is left out. With `local`
    (an IpcCollective of this rank alone) a step's all-reduces run the IPC kernels as the split
    would, less the peers (no pushes, nothing to wait for): their footprint on the GPU stays in
    the step's time; messages the split hands to NCCL are left out (a partial sum stands for the
    sum), as is the logits' all-gather (this rank's slice repeated). Its numbers are not the
    model's."""

    def __init__(self, world: int, local: IpcCollective | None = None) -> None:
        self.rank, self.world, self.local = 0, world, local

    def _runs(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return self.local is not None and not bulk_message(nbytes) and nbytes <= self.local.slot_bytes

    def sender(self, nbytes: int) -> Peers | None:
        return None  # (no peers to push to)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.local.all_reduce(x) if self._runs(x) else x

    def all_reduce_expand(self, partial: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                          pushed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if self._runs(partial):
            return self.local.all_reduce_expand(partial, x, post, comb)
        return partial, hc_expand(partial, x, post, comb)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, self.world)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        _check_rows(x, self.world)
        return x[: x.shape[0] // self.world]

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(self.world, *(1,) * (x.dim() - 1))


def _check_rows(x: torch.Tensor, world: int) -> None:
    if x.dtype != torch.bfloat16 or x.dim() < 1 or x.shape[0] % world:
        raise ValueError(f"reduce_scatter: need bf16 partial sums of a multiple of {world} rows, got {x.dtype} {tuple(x.shape)}")
