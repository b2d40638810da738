"""The RDMA READ data path of the KV transfer (kv_sharing.md §3.2, §4.4), through pyverbs.

pyverbs is optional and imported lazily: without it, without a device, or with a kernel that has
no RDMA at all (ENOSYS/ENODEV), `RdmaDevice.shared()` raises `RdmaUnavailable`, the caller logs
one line (`note_unavailable`) and moves the bytes over TCP (`transport.py`).

The verbs layer is kept thin so that everything but the hardware can be tested against a fake:

* `Enums`/`load_enums` — a compat shim for the pyverbs enum modules: rdma-core ≤ 55 has flat
  names in ``pyverbs.enums``/``pyverbs.cm_enums``, 56+ has enum classes in
  ``pyverbs.libibverbs_enums``/``pyverbs.librdmacm_enums``; both become one flat namespace.
* `Verbs`/`load_verbs` — the handful of pyverbs classes used here, as one object.
* `discover` — picks device, port and GID index from what is present (``DSUF_RDMA_DEVICE=
  name[:port[:gid_index]]`` overrides): the first ACTIVE port; on RoCE the GID preferring
  RoCE v2 and IPv4-mapped addresses, on InfiniBand index 0 and LID routing.
* `RdmaDevice` — one per process: the opened context, one protection domain, and the arena
  registrations. Each arena is registered ONCE as a memory region with LOCAL_WRITE | REMOTE_READ,
  shared by the owner (who hands out its rkey) and the fetcher (who READs into it with its lkey).
* `RcQueuePair` — one RC queue pair per control connection, brought RESET→INIT→RTR→RTS from the
  peer's `QpInfo` (exchanged over the TCP control channel, never through Redis). The fetcher
  posts RDMA READs of at most 16 MiB each, polls the CQ with a no-progress deadline (backing off
  so the event loop stays responsive), maps error completions to `RdmaError`, and on any failure
  moves the QP to ERROR and drains the CQ before the destination can be reused.

Wire codecs (all integers little-endian, 32 bytes each, carried as msgpack bin by transport.py):

QP info (`QpInfo`)::

    off size  field
      0    1  u8  version (1)
      1    1  u8  gid_index
      2    2  u16 lid (0 on RoCE)
      4    4  u32 qpn (< 2^24)
      8    4  u32 psn (< 2^24), the first packet sequence number of the sender's send queue
     12    1  u8  mtu (ibv_mtu: 1 = 256 … 5 = 4096), the sender's active port MTU
     13    1  u8  rd_atomic (≥ 1), outstanding RDMA READs the sender's device allows
     14    2  reserved (0)
     16   16  gid (raw)

Descriptor (`RdmaDescriptor`), one per granted blob::

    off size  field
      0    1  u8  version (1)
      1    3  reserved (0)
      4    4  u32 rkey of the owner's arena registration
      8    8  u64 base, the virtual address the owner's arena was registered at
     16    8  u64 offset of the blob in the arena
     24    8  u64 length of the blob; offset + length ≤ the arena's length

An arena-wide rkey lets a connected peer read the whole arena: acceptable inside the trusted
cluster network (kv_sharing.md §4.4), and only peers that passed the HMAC handshake get a QP.
The owner destroys a connection's QP before it ends that connection's lease, so READs that
arrive after the lease fail instead of reading reused bytes; the fetcher's header/CRC check is
the final guard either way. Never cache an rkey across leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import importlib
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .transport import TransferError

log = logging.getLogger(__name__)

WR_MAX_BYTES = 16 << 20  # one RDMA READ work request moves at most this much
SQ_DEPTH = 64  # READs in flight per queue pair
MAX_RD_ATOMIC = 16
DRAIN_SECONDS = 1.0  # after ERROR, wait this long for flushed completions before destroying the QP
POLL_BATCH = 16
_POLL_MAX_SLEEP = 0.002
_NO_RDMA_ERRNOS = (errno.ENOSYS, errno.ENODEV, errno.EOPNOTSUPP, errno.ENOENT, errno.EPERM, errno.EACCES)


class RdmaUnavailable(Exception):
    """No usable RDMA here (no pyverbs, no device, no active port); use TCP."""


class RdmaError(TransferError):
    """An RDMA transfer or queue-pair setup failed; the transfer falls back to TCP once."""


_noted = False
_note_lock = threading.Lock()


def note_unavailable(reason: str) -> None:
    """Log, once per process, that RDMA is unavailable and transfers use TCP."""
    global _noted
    with _note_lock:
        if _noted:
            return
        _noted = True
    log.info("RDMA unavailable (%s); KV transfers use TCP", reason)


# ---- pyverbs compat shim ------------------------------------------------------------------------


class Enums:
    """The pyverbs constants as one flat namespace (`e.IBV_ACCESS_REMOTE_READ` → int), built from
    module-level ints/enum members (rdma-core ≤ 55) and from enum classes (56+) alike."""

    def __init__(self, *modules: Any) -> None:
        names: dict[str, int] = {}
        for mod in modules:
            for name, value in vars(mod).items():
                if isinstance(value, type) and issubclass(value, enum.Enum):
                    for member_name, member in value.__members__.items():  # aliases included
                        names.setdefault(member_name, int(member.value))
                elif name.isupper() and isinstance(value, int) and not isinstance(value, bool):
                    names.setdefault(name, int(value))
        self._names = names

    def __getattr__(self, name: str) -> int:
        try:
            return self.__dict__["_names"][name]
        except KeyError:
            raise AttributeError(f"pyverbs has no constant {name}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def name_of(self, prefix: str, value: int, suffix: str = "") -> str:
        """The constant named `prefix…suffix` with this value (e.g. a WC status), or the number."""
        for name, v in self._names.items():
            if v == value and name.startswith(prefix) and name.endswith(suffix):
                return name
        return f"{prefix}{value}"


def load_enums() -> Enums:
    """Import whichever pyverbs enum modules this rdma-core has. ImportError if none."""
    mods = []
    for name in ("pyverbs.libibverbs_enums", "pyverbs.enums", "pyverbs.librdmacm_enums", "pyverbs.cm_enums"):
        with contextlib.suppress(ImportError):
            mods.append(importlib.import_module(name))
    if not any(m.__name__ in ("pyverbs.libibverbs_enums", "pyverbs.enums") for m in mods):
        raise ImportError("pyverbs has neither libibverbs_enums nor enums")
    return Enums(*mods)


@dataclass(frozen=True)
class Verbs:
    """The pyverbs entry points this module uses (a fake with the same shape tests the rest)."""

    e: Enums
    Error: type[BaseException]  # pyverbs' base exception
    get_device_list: Callable[[], list[Any]]
    Context: Any
    PD: Any
    MR: Any
    CQ: Any
    QP: Any
    QPInitAttr: Any
    QPCap: Any
    QPAttr: Any
    AHAttr: Any
    GlobalRoute: Any
    GID: Any
    SGE: Any
    SendWR: Any


def load_verbs() -> Verbs:
    """Import pyverbs (lazily: it is an optional dependency). RdmaUnavailable if absent."""
    try:
        from pyverbs import addr, cq, device, mr, pd, pyverbs_error, qp, wr

        e = load_enums()
    except ImportError as ex:
        raise RdmaUnavailable(f"pyverbs not importable: {ex}") from None
    return Verbs(
        e=e,
        Error=pyverbs_error.PyverbsError,
        get_device_list=device.get_device_list,
        Context=device.Context,
        PD=pd.PD,
        MR=mr.MR,
        CQ=cq.CQ,
        QP=qp.QP,
        QPInitAttr=qp.QPInitAttr,
        QPCap=qp.QPCap,
        QPAttr=qp.QPAttr,
        AHAttr=addr.AHAttr,
        GlobalRoute=addr.GlobalRoute,
        GID=addr.GID,
        SGE=wr.SGE,
        SendWR=wr.SendWR,
    )


# ---- wire codecs --------------------------------------------------------------------------------

_QP = struct.Struct("<BBHIIBB2x16s")
_DESC = struct.Struct("<B3xIQQQ")
assert _QP.size == 32 and _DESC.size == 32
_CODEC_VERSION = 1


@dataclass(frozen=True)
class QpInfo:
    """What a peer needs to connect its RC QP to ours (see the module docstring for the bytes)."""

    lid: int
    gid: bytes
    gid_index: int
    qpn: int
    psn: int
    mtu: int
    rd_atomic: int

    def __post_init__(self) -> None:
        if len(self.gid) != 16:
            raise ValueError("gid must be 16 bytes")
        if not 0 <= self.lid < 1 << 16 or not 0 <= self.gid_index < 256:
            raise ValueError("lid or gid_index out of range")
        if not 0 < self.qpn < 1 << 24 or not 0 <= self.psn < 1 << 24:
            raise ValueError("qpn or psn out of the 24-bit range")
        if not 1 <= self.mtu <= 5:
            raise ValueError(f"mtu {self.mtu} is not an ibv_mtu (1..5)")
        if not 1 <= self.rd_atomic < 256:
            raise ValueError("rd_atomic must be 1..255")

    def encode(self) -> bytes:
        return _QP.pack(_CODEC_VERSION, self.gid_index, self.lid, self.qpn, self.psn, self.mtu, self.rd_atomic, self.gid)

    @classmethod
    def decode(cls, raw: bytes) -> QpInfo:
        """ValueError on anything malformed."""
        if len(raw) != _QP.size:
            raise ValueError(f"QP info is {len(raw)} bytes, not {_QP.size}")
        version, gid_index, lid, qpn, psn, mtu, rd_atomic, gid = _QP.unpack(raw)
        if version != _CODEC_VERSION:
            raise ValueError(f"QP info version {version} (this side reads {_CODEC_VERSION})")
        return cls(lid=lid, gid=gid, gid_index=gid_index, qpn=qpn, psn=psn, mtu=mtu, rd_atomic=rd_atomic)


@dataclass(frozen=True)
class RdmaDescriptor:
    """Where a granted blob lies in the owner's registered arena."""

    rkey: int
    base: int
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not 0 <= self.rkey < 1 << 32:
            raise ValueError("rkey out of range")
        if min(self.base, self.offset, self.length) < 0 or self.base + self.offset + self.length >= 1 << 64:
            raise ValueError("descriptor range out of the 64-bit address space")

    @property
    def remote_addr(self) -> int:
        return self.base + self.offset

    def encode(self) -> bytes:
        return _DESC.pack(_CODEC_VERSION, self.rkey, self.base, self.offset, self.length)

    @classmethod
    def decode(cls, raw: bytes) -> RdmaDescriptor:
        if len(raw) != _DESC.size:
            raise ValueError(f"descriptor is {len(raw)} bytes, not {_DESC.size}")
        version, rkey, base, offset, length = _DESC.unpack(raw)
        if version != _CODEC_VERSION:
            raise ValueError(f"descriptor version {version} (this side reads {_CODEC_VERSION})")
        return cls(rkey=rkey, base=base, offset=offset, length=length)


def buffer_address(buf: Any) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers included)."""
    import numpy as np

    view = memoryview(buf)
    if not view.contiguous:
        raise ValueError("buffer is not contiguous")
    if view.nbytes == 0:
        raise ValueError("an empty buffer has no address")
    return int(np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8).ctypes.data)


def gid_text(raw: bytes) -> str:
    """pyverbs' GID text form, 'xxxx:xxxx:…' (8 groups of 4 hex digits)."""
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


def gid_bytes(text: str) -> bytes:
    raw = bytes.fromhex(str(text).replace(":", ""))
    if len(raw) != 16:
        raise ValueError(f"bad GID {text!r}")
    return raw


# ---- discovery ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PortChoice:
    device: str
    port: int
    gid_index: int
    gid: bytes
    lid: int
    mtu: int
    ethernet: bool  # RoCE: routed by GID (GRH), not LID
    rd_atomic: int
    max_msg: int
    max_wr: int


def _is_no_rdma(ex: BaseException) -> bool:
    code = getattr(ex, "error_code", None) or getattr(ex, "errno", None)
    return code in _NO_RDMA_ERRNOS


def _gid_type_v2(v: Verbs, ctx: Any, device: str, port: int, index: int) -> bool:
    """Whether GID `index` is RoCE v2 (pyverbs query, else sysfs); False if unknown."""
    try:
        return int(ctx.query_gid_type(port, index)) == v.e.IBV_GID_TYPE_SYSFS_ROCE_V2
    except (AttributeError, v.Error, OSError, ValueError):
        pass
    try:
        kind = Path(f"/sys/class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}").read_text()
    except OSError:
        return False
    return "v2" in kind.lower()


def _pick_gid(v: Verbs, ctx: Any, device: str, port: int, table_len: int, ethernet: bool, want: int | None) -> tuple[int, bytes] | None:
    """(index, gid) to use on this port, or None if it has no usable GID."""
    candidates = [want] if want is not None else ([0] if not ethernet else range(min(table_len, 256)))
    best: tuple[int, int, bytes] | None = None  # (score, index, gid)
    for index in candidates:
        try:
            gid = gid_bytes(str(ctx.query_gid(port, index)))
        except (v.Error, OSError, ValueError):
            continue
        if not any(gid):
            continue
        if not ethernet or want is not None:
            return index, gid
        score = 2 * _gid_type_v2(v, ctx, device, port, index) + (gid[:12] == b"\0" * 10 + b"\xff\xff")
        if best is None or score > best[0]:
            best = (score, index, gid)
    return (best[1], best[2]) if best else None


def discover(v: Verbs, spec: str | None = None) -> tuple[Any, PortChoice]:
    """Open the first device with an ACTIVE port and a usable GID: (context, choice).

    `spec` ("name[:port[:gid_index]]", default $DSUF_RDMA_DEVICE) narrows the search. Raises
    RdmaUnavailable with a one-line reason when nothing fits."""
    spec = spec if spec is not None else os.environ.get("DSUF_RDMA_DEVICE") or None
    want_dev, want_port, want_gid = None, None, None
    if spec:
        parts = spec.split(":")
        want_dev = parts[0]
        want_port = int(parts[1]) if len(parts) > 1 and parts[1] else None
        want_gid = int(parts[2]) if len(parts) > 2 and parts[2] else None
    try:
        devices = v.get_device_list()
    except (v.Error, OSError) as ex:
        raise RdmaUnavailable(f"no RDMA devices ({' '.join(str(ex).split())})") from None
    names = sorted(d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices)
    if want_dev is not None:
        names = [n for n in names if n == want_dev]
    if not names:
        raise RdmaUnavailable("no RDMA devices" + (f" named {want_dev}" if want_dev else ""))
    e = v.e
    why: list[str] = []
    for name in names:
        try:
            ctx = v.Context(name=name)
        except (v.Error, OSError) as ex:
            why.append(f"{name}: {'no device' if _is_no_rdma(ex) else ' '.join(str(ex).split())}")
            continue
        try:
            dattr = ctx.query_device()
            rd_atomic = min(int(dattr.max_qp_rd_atom), int(dattr.max_qp_init_rd_atom), MAX_RD_ATOMIC)
            if rd_atomic < 1:
                why.append(f"{name}: no outstanding RDMA READs allowed")
                ctx.close()
                continue
            ports = [want_port] if want_port else range(1, int(dattr.phys_port_cnt) + 1)
            for port in ports:
                pattr = ctx.query_port(port)
                if int(pattr.state) != e.IBV_PORT_ACTIVE:
                    why.append(f"{name}:{port}: port not active")
                    continue
                ethernet = int(pattr.link_layer) == e.IBV_LINK_LAYER_ETHERNET
                picked = _pick_gid(v, ctx, name, port, int(pattr.gid_tbl_len), ethernet, want_gid)
                if picked is None:
                    why.append(f"{name}:{port}: no usable GID")
                    continue
                gid_index, gid = picked
                return ctx, PortChoice(
                    device=name,
                    port=port,
                    gid_index=gid_index,
                    gid=gid,
                    lid=int(pattr.lid),
                    mtu=int(pattr.active_mtu),
                    ethernet=ethernet,
                    rd_atomic=rd_atomic,
                    max_msg=int(pattr.max_msg_sz) or WR_MAX_BYTES,
                    max_wr=int(dattr.max_qp_wr),
                )
        except (v.Error, OSError) as ex:
            why.append(f"{name}: {' '.join(str(ex).split())}")
        ctx.close()
    raise RdmaUnavailable("no usable RDMA port (" + "; ".join(why) + ")")


# ---- device, arena registration, queue pairs ----------------------------------------------------


@contextlib.contextmanager
def _verbs_call(v: Verbs, what: str) -> Iterator[None]:
    try:
        yield
    except (v.Error, OSError) as ex:
        raise RdmaError(f"{what} failed: {' '.join(str(ex).split())}") from None


class ArenaMR:
    """One arena's memory region: registered once, shared by every user of the arena in this
    process (refcounted by `RdmaDevice.register`)."""

    def __init__(self, device: RdmaDevice, arena: memoryview, mr: Any, base: int) -> None:
        self._device = device
        self.arena = arena  # holds the buffer export: the arena cannot be unmapped under the MR
        self.mr = mr
        self.base = base
        self.length = len(arena)
        self.lkey = int(mr.lkey)
        self.rkey = int(mr.rkey)
        self.refs = 1

    def span(self, view: memoryview) -> tuple[int, int] | None:
        """(offset in the arena, length) of a non-empty view lying wholly inside it, else None."""
        if not len(view):
            return None
        try:
            offset = buffer_address(view) - self.base
        except (ValueError, TypeError):
            return None
        if offset < 0 or offset + view.nbytes > self.length:
            return None
        return offset, view.nbytes

    def descriptor(self, offset: int, length: int) -> RdmaDescriptor:
        """The descriptor of arena[offset:offset+length]; ValueError outside the arena."""
        if offset < 0 or length <= 0 or offset + length > self.length:
            raise ValueError(f"[{offset}, {offset + length}) is not inside the {self.length}-byte arena")
        return RdmaDescriptor(rkey=self.rkey, base=self.base, offset=offset, length=length)

    def describe(self, view: memoryview) -> RdmaDescriptor | None:
        """The descriptor of an owned blob's view, or None if it is not in the arena (→ TCP)."""
        span = self.span(view)
        return self.descriptor(*span) if span is not None else None

    def local_addr(self, view: memoryview) -> int | None:
        """The address to READ into for a destination view, or None if it is not in the arena."""
        span = self.span(view)
        return self.base + span[0] if span is not None else None

    def release(self) -> None:
        self._device.unregister(self)


class RdmaDevice:
    """The process's RDMA device: context, protection domain, port choice, arena registrations."""

    _shared: RdmaDevice | None = None
    _shared_error: str | None = None
    _lock = threading.Lock()

    def __init__(self, verbs: Verbs, ctx: Any, port: PortChoice) -> None:
        self.verbs = verbs
        self.e = verbs.e
        self.ctx = ctx
        self.port = port
        with _verbs_call(verbs, "allocating a protection domain"):
            self.pd = verbs.PD(ctx)
        self._mrs: dict[tuple[int, int], ArenaMR] = {}
        self._mr_lock = threading.Lock()

    @classmethod
    def shared(cls) -> RdmaDevice:
        """The process-wide device, opened at the first call (the verdict is cached either way).
        RdmaUnavailable if there is none."""
        with cls._lock:
            if cls._shared is not None:
                return cls._shared
            if cls._shared_error is not None:
                raise RdmaUnavailable(cls._shared_error)
            try:
                verbs = load_verbs()
                ctx, port = discover(verbs)
                try:
                    cls._shared = cls(verbs, ctx, port)
                except RdmaError as ex:
                    ctx.close()
                    raise RdmaUnavailable(str(ex)) from None
            except RdmaUnavailable as ex:
                cls._shared_error = str(ex)
                raise
            log.info(
                "RDMA: %s port %d, GID index %d (%s), MTU code %d, %d READs in flight",
                port.device, port.port, port.gid_index, "RoCE" if port.ethernet else "InfiniBand", port.mtu, port.rd_atomic,
            )  # fmt: skip
            return cls._shared

    @classmethod
    def reset_shared(cls) -> None:
        """Forget (and close) the shared device: for tests and the self-test tool."""
        with cls._lock:
            dev, cls._shared, cls._shared_error = cls._shared, None, None
        if dev is not None:
            dev.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pd.close()
        with contextlib.suppress(Exception):
            self.ctx.close()

    def register(self, arena: memoryview) -> ArenaMR:
        """Register `arena` (once: later calls share the registration). RdmaUnavailable if the
        device refuses it (the caller then uses TCP)."""
        view = memoryview(arena)
        if view.readonly or not view.contiguous or not view.nbytes:
            raise ValueError("the arena must be a non-empty writable contiguous buffer")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        base = buffer_address(view)
        key = (base, len(view))
        with self._mr_lock:
            mr = self._mrs.get(key)
            if mr is not None:
                mr.refs += 1
                return mr
            e = self.e
            try:
                raw = self.verbs.MR(self.pd, len(view), e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ, address=base)
            except (self.verbs.Error, OSError) as ex:
                raise RdmaUnavailable(f"registering the {len(view)}-byte arena failed: {' '.join(str(ex).split())}") from None
            mr = self._mrs[key] = ArenaMR(self, view, raw, base)
            return mr

    def unregister(self, mr: ArenaMR) -> None:
        with self._mr_lock:
            mr.refs -= 1
            if mr.refs > 0:
                return
            self._mrs.pop((mr.base, mr.length), None)
        with contextlib.suppress(Exception):
            mr.mr.close()

    def create_qp(self, *, responder: bool) -> RcQueuePair:
        """A fresh RC queue pair in RESET (RdmaError if the device refuses)."""
        return RcQueuePair(self, responder=responder)


_QP_STATES = ("reset", "init", "rtr", "rts")


class RcQueuePair:
    """One reliable-connected QP: the owner's side answers READs (responder), the fetcher's side
    issues them. `connect` walks RESET→INIT→RTR→RTS; `read_into` moves one blob."""

    def __init__(self, device: RdmaDevice, *, responder: bool) -> None:
        v, e, port = device.verbs, device.e, device.port
        self.device = device
        self.responder = responder
        self.depth = 1 if responder else max(1, min(SQ_DEPTH, port.max_wr or SQ_DEPTH))
        self.cq = self.qp = None
        try:
            with _verbs_call(v, "creating a completion queue"):
                self.cq = v.CQ(device.ctx, self.depth * 2)
            cap = v.QPCap(max_send_wr=self.depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            init = v.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
            with _verbs_call(v, "creating a queue pair"):
                self.qp = v.QP(device.pd, init)
        except BaseException:
            self.close()
            raise
        self.info = QpInfo(
            lid=port.lid,
            gid=port.gid,
            gid_index=port.gid_index,
            qpn=int(self.qp.qp_num),
            psn=secrets.randbits(24),
            mtu=port.mtu,
            rd_atomic=port.rd_atomic,
        )
        self.state = "reset"
        self.outstanding = 0  # READs posted and not yet completed

    def connect(self, remote: QpInfo) -> None:
        """Bring the QP to RTS against the peer's QP (RdmaError on failure)."""
        if self.state != "reset":
            raise RdmaError(f"queue pair is {self.state}, not reset")
        v, e, port = self.device.verbs, self.device.e, self.device.port
        access = e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_READ if self.responder else 0)
        attr = v.QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET, port_num=port.port)
        attr.pkey_index = 0
        attr.qp_access_flags = access
        self._modify(attr, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS, "init")

        attr = v.QPAttr(qp_state=e.IBV_QPS_RTR, cur_qp_state=e.IBV_QPS_INIT, port_num=port.port, path_mtu=min(port.mtu, remote.mtu))
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.max_dest_rd_atomic = port.rd_atomic  # READs we answer: our device's limit
        attr.min_rnr_timer = 12
        grh = port.ethernet or remote.lid == 0  # RoCE is routed by GID; InfiniBand by LID
        gr = v.GlobalRoute(dgid=v.GID(gid_text(remote.gid)), sgid_index=port.gid_index, hop_limit=64) if grh else None
        attr.ah_attr = v.AHAttr(dlid=remote.lid, sl=0, is_global=1 if grh else 0, port_num=port.port, gr=gr)
        mask = e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN | e.IBV_QP_RQ_PSN
        self._modify(attr, mask | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER, "rtr")

        attr = v.QPAttr(qp_state=e.IBV_QPS_RTS, cur_qp_state=e.IBV_QPS_RTR, port_num=port.port)
        attr.timeout = 14  # 4.096 µs · 2^14 ≈ 67 ms per try
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.sq_psn = self.info.psn
        attr.max_rd_atomic = max(1, min(port.rd_atomic, remote.rd_atomic))  # READs we issue
        mask = e.IBV_QP_STATE | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY | e.IBV_QP_SQ_PSN
        self._modify(attr, mask | e.IBV_QP_MAX_QP_RD_ATOMIC, "rts")

    def _modify(self, attr: Any, mask: int, to: str) -> None:
        if self.qp is None:
            raise RdmaError("queue pair is closed")
        with _verbs_call(self.device.verbs, f"moving the queue pair to {to.upper()}"):
            self.qp.modify(attr, mask)
        self.state = to

    async def read_into(
        self,
        desc: RdmaDescriptor,
        local_addr: int,
        lkey: int,
        *,
        io_timeout: float,
        renew: Callable[[], Awaitable[None]] | None = None,
        renew_every: float | None = None,
    ) -> None:
        """READ the descriptor's bytes to `local_addr` (inside the MR of `lkey`).

        Posts ≤ WR_MAX_BYTES work requests, at most `depth` in flight, and polls the CQ; raises
        RdmaError on an error completion or when no completion arrives within `io_timeout`. On
        any failure (cancellation included) the QP is moved to ERROR and drained first, so
        nothing more lands in the destination once this returns or raises."""
        if self.state != "rts":
            raise RdmaError(f"queue pair is {self.state}, not connected")
        v, e = self.device.verbs, self.device.e
        chunk = max(1, min(WR_MAX_BYTES, self.device.port.max_msg))
        pieces = [(off, min(chunk, desc.length - off)) for off in range(0, desc.length, chunk)]
        loop = asyncio.get_running_loop()
        posted = done = 0
        last = renewed = loop.time()
        pause = 0.0
        ok = False
        try:
            while done < len(pieces):
                while posted < len(pieces) and self.outstanding < self.depth:
                    off, n = pieces[posted]
                    sge = v.SGE(local_addr + off, n, lkey)
                    wr = v.SendWR(wr_id=posted, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
                    wr.set_wr_rdma(desc.rkey, desc.remote_addr + off)
                    with _verbs_call(v, "posting an RDMA READ"):
                        self.qp.post_send(wr)  # type: ignore[union-attr]
                    posted += 1
                    self.outstanding += 1
                with _verbs_call(v, "polling the completion queue"):
                    npolled, wcs = self.cq.poll(min(self.outstanding, POLL_BATCH))  # type: ignore[union-attr]
                for wc in wcs[:npolled]:
                    self.outstanding -= 1
                    if wc.status != e.IBV_WC_SUCCESS:
                        raise wc_error(e, wc.status, getattr(wc, "vendor_err", 0))
                    done += 1
                now = loop.time()
                if npolled:
                    last, pause = now, 0.0
                elif now - last > io_timeout:
                    raise RdmaError(f"RDMA READ made no progress within {io_timeout:g}s")
                if renew is not None and renew_every and now - renewed >= renew_every:
                    renewed = now
                    await renew()
                # Yield to the loop between polls, backing off while nothing completes.
                await asyncio.sleep(pause)
                if not npolled:
                    pause = min(max(pause * 2, 5e-5), _POLL_MAX_SLEEP)
            ok = True
        finally:
            if not ok:
                self.abort()

    def abort(self) -> None:
        """Move the QP to ERROR and drain its flushed completions (bounded by DRAIN_SECONDS);
        if they do not all come back, destroy the QP, which stops any further DMA. Afterwards the
        destination of an interrupted read may be reused. The QP is not usable again."""
        if self.qp is None:
            return
        v, e = self.device.verbs, self.device.e
        with contextlib.suppress(v.Error, OSError):
            self.qp.modify(v.QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
        self.state = "error"
        deadline = time.monotonic() + DRAIN_SECONDS
        while self.outstanding > 0 and time.monotonic() < deadline:
            try:
                npolled, _ = self.cq.poll(POLL_BATCH)  # type: ignore[union-attr]
            except (v.Error, OSError):
                break
            self.outstanding -= npolled
            if not npolled:
                time.sleep(1e-4)
        if self.outstanding > 0:
            log.warning("RDMA: %d READs did not flush within %.0fs; destroying the queue pair", self.outstanding, DRAIN_SECONDS)
            self.close()

    def close(self) -> None:
        """Destroy the QP and its CQ (idempotent)."""
        qp, cq, self.qp, self.cq = self.qp, self.cq, None, None
        self.state = "closed"
        for obj in (qp, cq):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()


_WC_HINTS = {
    "IBV_WC_REM_ACCESS_ERR": "the owner's memory region refused the read (stale rkey or range)",
    "IBV_WC_RETRY_EXC_ERR": "the owner stopped answering (transport retries exhausted)",
    "IBV_WC_RNR_RETRY_EXC_ERR": "the owner was not ready (RNR retries exhausted)",
    "IBV_WC_WR_FLUSH_ERR": "flushed after an earlier error",
    "IBV_WC_LOC_PROT_ERR": "the destination is not inside our registered arena",
    "IBV_WC_REM_INV_REQ_ERR": "the owner rejected the request (READs not enabled?)",
}


def wc_error(e: Enums, status: int, vendor_err: int = 0) -> RdmaError:
    """The RdmaError for an error work completion (one line: name, hint, status numbers)."""
    name = e.name_of("IBV_WC_", int(status), "_ERR") if status else "IBV_WC_SUCCESS"
    hint = _WC_HINTS.get(name)
    return RdmaError(f"RDMA READ failed: {name}" + (f", {hint}" if hint else "") + f" (status {int(status)}, vendor error {int(vendor_err):#x})")
