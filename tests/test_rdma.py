"""The RDMA READ data path, against a fake verbs layer (no RDMA exists here or in CI).

`Fabric` is a tiny in-process HCA behind the same shape as the pyverbs classes `rdma.Verbs`
bundles: memory regions with keys and access flags, RC queue pairs that enforce the
RESET→INIT→RTR→RTS state machine and its attribute masks, and RDMA READs that really copy bytes
between registered regions (checking rkey, lkey, bounds and access), complete on a CQ, and can be
made to fail, stall, or not flush. With it the whole transport runs end to end over "RDMA" on
loopback: codecs, discovery, one registration per arena, descriptors, the fallback to TCP at most
once, the "no device" path. Real verbs are exercised by tools/rdma-selftest on an RDMA host.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import enum
import errno
import logging
import re
import sys
import time
import types
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dsuf.kvcache import rdma
from dsuf.kvcache import transport as tr
from dsuf.kvcache.rdma import (
    Enums,
    QpInfo,
    RdmaDescriptor,
    RdmaDevice,
    RdmaError,
    RdmaUnavailable,
    Verbs,
    discover,
    wc_error,
)
from dsuf.kvcache.transport import ExportRefused, KvFetcher, KvTransferServer, TransferError

SECRET = b"rdma-test-secret"
MiB = 1 << 20

# The real ibverbs values (infiniband/verbs.h), flat as rdma-core <= 55 exposes them.
IBV = dict(
    IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2, IBV_ACCESS_REMOTE_READ=4,
    IBV_QPT_RC=2,
    IBV_QPS_RESET=0, IBV_QPS_INIT=1, IBV_QPS_RTR=2, IBV_QPS_RTS=3, IBV_QPS_SQD=4, IBV_QPS_SQE=5, IBV_QPS_ERR=6,
    IBV_QP_STATE=1, IBV_QP_CUR_STATE=2, IBV_QP_ACCESS_FLAGS=8, IBV_QP_PKEY_INDEX=16, IBV_QP_PORT=32, IBV_QP_AV=128,
    IBV_QP_PATH_MTU=256, IBV_QP_TIMEOUT=512, IBV_QP_RETRY_CNT=1024, IBV_QP_RNR_RETRY=2048, IBV_QP_RQ_PSN=4096,
    IBV_QP_MAX_QP_RD_ATOMIC=8192, IBV_QP_MIN_RNR_TIMER=32768, IBV_QP_SQ_PSN=65536, IBV_QP_MAX_DEST_RD_ATOMIC=131072,
    IBV_QP_DEST_QPN=1048576,
    IBV_WR_RDMA_WRITE=0, IBV_WR_SEND=2, IBV_WR_RDMA_READ=4, IBV_SEND_SIGNALED=2,
    IBV_WC_SEND=0, IBV_WC_RDMA_WRITE=1, IBV_WC_RDMA_READ=2,  # opcodes share values with statuses
    IBV_WC_SUCCESS=0, IBV_WC_LOC_LEN_ERR=1, IBV_WC_LOC_QP_OP_ERR=2, IBV_WC_LOC_PROT_ERR=4, IBV_WC_WR_FLUSH_ERR=5,
    IBV_WC_REM_INV_REQ_ERR=9, IBV_WC_REM_ACCESS_ERR=10, IBV_WC_REM_OP_ERR=11, IBV_WC_RETRY_EXC_ERR=12,
    IBV_WC_RNR_RETRY_EXC_ERR=13, IBV_WC_FATAL_ERR=19, IBV_WC_GENERAL_ERR=21,
    IBV_PORT_DOWN=1, IBV_PORT_INIT=2, IBV_PORT_ARMED=3, IBV_PORT_ACTIVE=4,
    IBV_LINK_LAYER_UNSPECIFIED=0, IBV_LINK_LAYER_INFINIBAND=1, IBV_LINK_LAYER_ETHERNET=2,
    IBV_MTU_256=1, IBV_MTU_512=2, IBV_MTU_1024=3, IBV_MTU_2048=4, IBV_MTU_4096=5,
    IBV_GID_TYPE_SYSFS_IB_ROCE_V1=0, IBV_GID_TYPE_SYSFS_ROCE_V2=1,
)  # fmt: skip
E = SimpleNamespace(**IBV)

REQUIRED_MASKS = {  # transition -> attribute mask bits the spec requires for an RC QP
    (0, 1): E.IBV_QP_STATE | E.IBV_QP_PKEY_INDEX | E.IBV_QP_PORT | E.IBV_QP_ACCESS_FLAGS,
    (1, 2): E.IBV_QP_STATE | E.IBV_QP_AV | E.IBV_QP_PATH_MTU | E.IBV_QP_DEST_QPN | E.IBV_QP_RQ_PSN
    | E.IBV_QP_MAX_DEST_RD_ATOMIC | E.IBV_QP_MIN_RNR_TIMER,
    (2, 3): E.IBV_QP_STATE | E.IBV_QP_TIMEOUT | E.IBV_QP_RETRY_CNT | E.IBV_QP_RNR_RETRY | E.IBV_QP_SQ_PSN
    | E.IBV_QP_MAX_QP_RD_ATOMIC,
}  # fmt: skip


ATTR_BITS = {
    "qp_access_flags": E.IBV_QP_ACCESS_FLAGS, "dest_qp_num": E.IBV_QP_DEST_QPN, "path_mtu": E.IBV_QP_PATH_MTU,
    "max_rd_atomic": E.IBV_QP_MAX_QP_RD_ATOMIC, "max_dest_rd_atomic": E.IBV_QP_MAX_DEST_RD_ATOMIC, "ah_attr": E.IBV_QP_AV,
}  # fmt: skip


# ---- the fake HCA -------------------------------------------------------------------------------


class FakeVerbsError(Exception):
    def __init__(self, msg: str, code: int = 0) -> None:
        super().__init__(msg)
        self.error_code = code


def gid_of(text: str) -> str:
    return rdma.gid_text(bytes.fromhex(text))


ROCE_GIDS = [  # (gid hex, RoCE v2?)
    ("fe80000000000000020000fffe000001", False),
    ("fe80000000000000020000fffe000001", True),
    ("00000000000000000000ffff0a000001", False),
    ("00000000000000000000ffff0a000001", True),  # ::ffff:10.0.0.1, RoCE v2: the one to pick
    ("00000000000000000000000000000000", True),
]


class Fabric:
    """Shared state of the fake devices: registrations, queue pairs, fault switches."""

    def __init__(self) -> None:
        self.devices: list[SimpleNamespace] = [SimpleNamespace(name=b"rxe0")]
        self.ports: dict[tuple[str, int], SimpleNamespace] = {
            ("rxe0", 1): SimpleNamespace(state=E.IBV_PORT_ACTIVE, link_layer=E.IBV_LINK_LAYER_ETHERNET, gid_tbl_len=len(ROCE_GIDS),
                                         lid=0, active_mtu=E.IBV_MTU_1024, max_msg_sz=1 << 31),
        }  # fmt: skip
        self.gids: dict[tuple[str, int], list[tuple[str, bool]]] = {("rxe0", 1): ROCE_GIDS}
        self.list_error: Exception | None = None
        self.open_error: Exception | None = None
        self.rd_atom = 16
        self.mrs: dict[int, FakeMR] = {}
        self.qps: dict[int, FakeQP] = {}
        self.mr_registrations = 0
        self.qps_created = 0
        self.transitions: list[tuple[int, int, int, int]] = []  # (qpn, from, to, mask)
        self.reads: list[int] = []  # bytes per completed READ
        self.fail_status: int | None = None  # complete every READ with this status
        self.fail_reads = 0  # ... but only this many (0 = all, while fail_status is set)
        self.stall = False  # READs never complete (until the QP goes to ERROR and flushes)
        self.no_flush = False  # ERROR does not flush outstanding READs
        self.completion_delay = 0.0  # seconds before a READ's completion shows on the CQ
        self._key = 0x1000
        self._qpn = 0x11

    def next_key(self) -> int:
        self._key += 7
        return self._key

    def next_qpn(self) -> int:
        self._qpn += 1
        return self._qpn


def make_verbs(fabric: Fabric) -> Verbs:  # noqa: C901 - one closure per pyverbs class
    class Context:
        def __init__(self, name: str) -> None:
            if fabric.open_error is not None:
                raise fabric.open_error
            self.name = name
            self.closed = False

        def query_device(self):
            return SimpleNamespace(max_qp_rd_atom=fabric.rd_atom, max_qp_init_rd_atom=fabric.rd_atom, phys_port_cnt=2, max_qp_wr=4096)

        def query_port(self, port: int):
            attr = fabric.ports.get((self.name, port))
            return attr or SimpleNamespace(state=E.IBV_PORT_DOWN, link_layer=E.IBV_LINK_LAYER_ETHERNET, gid_tbl_len=0, lid=0,
                                           active_mtu=E.IBV_MTU_1024, max_msg_sz=1 << 31)  # fmt: skip

        def query_gid(self, port: int, index: int):
            table = fabric.gids.get((self.name, port), [])
            if index >= len(table):
                raise FakeVerbsError("Failed to query gid", errno.EINVAL)
            return GID(gid_of(table[index][0]))

        def query_gid_type(self, port: int, index: int):
            return E.IBV_GID_TYPE_SYSFS_ROCE_V2 if fabric.gids[(self.name, port)][index][1] else E.IBV_GID_TYPE_SYSFS_IB_ROCE_V1

        def close(self) -> None:
            self.closed = True

    class PD:
        def __init__(self, ctx: Context) -> None:
            self.ctx = ctx

        def close(self) -> None:
            pass

    class MR:
        def __init__(self, pd: PD, length: int, access: int, address: int | None = None) -> None:
            assert address, "the arena is registered in place, never copied into an MR buffer"
            fabric.mr_registrations += 1
            self.pd, self.length, self.access, self.buf = pd, length, access, address
            self.lkey = fabric.next_key()
            self.rkey = fabric.next_key()
            fabric.mrs[self.lkey] = fabric.mrs[self.rkey] = self

        def close(self) -> None:
            fabric.mrs.pop(self.lkey, None)
            fabric.mrs.pop(self.rkey, None)

        def covers(self, addr: int, n: int) -> bool:
            return self.buf <= addr and addr + n <= self.buf + self.length

    class CQ:
        def __init__(self, ctx: Context, cqe: int) -> None:
            self.entries: deque[SimpleNamespace] = deque()

        def poll(self, num_entries: int = 1):
            out = []
            now = time.monotonic()
            while self.entries and len(out) < num_entries and self.entries[0].ready_at <= now:
                out.append(self.entries.popleft())
            return len(out), out

        def close(self) -> None:
            pass

    class QPCap:
        def __init__(self, max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1) -> None:
            self.max_send_wr = max_send_wr

    class QPInitAttr:
        def __init__(self, qp_type, scq, rcq, cap, sq_sig_all=1) -> None:
            assert qp_type == E.IBV_QPT_RC and scq is rcq
            self.cq, self.cap = scq, cap

    class QPAttr:
        def __init__(self, qp_state=E.IBV_QPS_INIT, cur_qp_state=E.IBV_QPS_RESET, port_num=1, path_mtu=E.IBV_MTU_1024) -> None:
            self.qp_state, self.cur_qp_state, self.port_num, self.path_mtu = qp_state, cur_qp_state, port_num, path_mtu
            self.max_rd_atomic = self.max_dest_rd_atomic = self.qp_access_flags = 0

    class AHAttr:
        def __init__(self, dlid=0, sl=0, is_global=0, port_num=1, gr=None) -> None:
            self.dlid, self.is_global, self.port_num, self.gr = dlid, is_global, port_num, gr

    class GlobalRoute:
        def __init__(self, dgid=None, sgid_index=0, hop_limit=1) -> None:
            self.dgid, self.sgid_index = dgid, sgid_index

    class GID:
        def __init__(self, val: str) -> None:
            self.val = val

        def __str__(self) -> str:
            return self.val

    class SGE:
        def __init__(self, addr: int, length: int, lkey: int) -> None:
            self.addr, self.length, self.lkey = addr, length, lkey

    class SendWR:
        def __init__(self, wr_id=0, opcode=E.IBV_WR_SEND, num_sge=0, sg=None, send_flags=E.IBV_SEND_SIGNALED) -> None:
            assert num_sge == 1 and len(sg) == 1
            self.wr_id, self.opcode, self.sg, self.send_flags = wr_id, opcode, sg, send_flags

        def set_wr_rdma(self, rkey: int, addr: int) -> None:
            self.rkey, self.remote_addr = rkey, addr

    class QP:
        def __init__(self, pd: PD, init: QPInitAttr) -> None:
            fabric.qps_created += 1
            self.pd, self.cq, self.depth = pd, init.cq, init.cap.max_send_wr
            self.qp_num = fabric.next_qpn()
            self.state = E.IBV_QPS_RESET
            self.attrs: dict[str, object] = {}
            self.pending: list[SimpleNamespace] = []  # stalled READs
            fabric.qps[self.qp_num] = self

        def modify(self, attr: QPAttr, mask: int) -> None:
            to = attr.qp_state
            if to != E.IBV_QPS_ERR:
                need = REQUIRED_MASKS.get((self.state, to))
                if need is None:
                    raise FakeVerbsError(f"invalid QP transition {self.state}->{to}", errno.EINVAL)
                if mask & need != need:
                    raise FakeVerbsError(f"missing attribute mask bits {need & ~mask:#x}", errno.EINVAL)
                if to == E.IBV_QPS_RTR:
                    assert attr.max_dest_rd_atomic > 0 and attr.ah_attr.port_num == 1
                if to == E.IBV_QPS_RTS:
                    assert attr.max_rd_atomic > 0
            fabric.transitions.append((self.qp_num, self.state, to, mask))
            for name, bit in ATTR_BITS.items():  # like the device: only what the mask names applies
                if mask & bit:
                    self.attrs[name] = getattr(attr, name)
            self.state = to
            if to == E.IBV_QPS_ERR and not fabric.no_flush:
                for wr in self.pending:
                    self._complete(wr, E.IBV_WC_WR_FLUSH_ERR)
                self.pending.clear()

        def _complete(self, wr, status: int, delay: float = 0.0) -> None:
            self.cq.entries.append(SimpleNamespace(wr_id=wr.wr_id, status=status, vendor_err=0, ready_at=time.monotonic() + delay))

        def post_send(self, wr: SendWR) -> None:
            if self.state not in (E.IBV_QPS_RTS, E.IBV_QPS_ERR):
                raise FakeVerbsError("post_send on a QP that is not RTS", errno.EINVAL)
            assert wr.opcode == E.IBV_WR_RDMA_READ and wr.send_flags & E.IBV_SEND_SIGNALED
            if sum(1 for _ in self.pending) >= self.depth:
                raise FakeVerbsError("send queue full", errno.ENOMEM)
            if self.state == E.IBV_QPS_ERR:
                return self._complete(wr, E.IBV_WC_WR_FLUSH_ERR)
            if fabric.stall:
                self.pending.append(wr)
                return None
            if fabric.fail_status is not None:
                if fabric.fail_reads >= 0:
                    fabric.fail_reads -= 1
                    if fabric.fail_reads == 0:
                        fabric.fail_reads = -1
                    self.state = E.IBV_QPS_ERR
                    return self._complete(wr, fabric.fail_status)
            status = self._read(wr)
            if status != E.IBV_WC_SUCCESS:
                self.state = E.IBV_QPS_ERR
            return self._complete(wr, status, fabric.completion_delay)

        def _read(self, wr: SendWR) -> int:
            sge = wr.sg[0]
            local = fabric.mrs.get(sge.lkey)
            if local is None or local.pd is not self.pd or not local.access & E.IBV_ACCESS_LOCAL_WRITE or not local.covers(sge.addr, sge.length):
                return E.IBV_WC_LOC_PROT_ERR
            peer = fabric.qps.get(self.attrs.get("dest_qp_num", -1))
            if peer is None or peer.state not in (E.IBV_QPS_RTR, E.IBV_QPS_RTS) or peer.attrs.get("dest_qp_num") != self.qp_num:
                return E.IBV_WC_RETRY_EXC_ERR
            remote = fabric.mrs.get(wr.rkey)
            if (
                remote is None
                or remote.rkey != wr.rkey
                or remote.pd is not peer.pd
                or not remote.access & E.IBV_ACCESS_REMOTE_READ
                or not peer.attrs["qp_access_flags"] & E.IBV_ACCESS_REMOTE_READ  # type: ignore[operator]
                or not remote.covers(wr.remote_addr, sge.length)
            ):
                return E.IBV_WC_REM_ACCESS_ERR
            ctypes.memmove(sge.addr, wr.remote_addr, sge.length)
            fabric.reads.append(sge.length)
            return E.IBV_WC_SUCCESS

        def close(self) -> None:
            fabric.qps.pop(self.qp_num, None)
            self.state = -1

    def get_device_list():
        if fabric.list_error is not None:
            raise fabric.list_error
        return list(fabric.devices)

    return Verbs(
        e=Enums(types.SimpleNamespace(**IBV)),
        Error=FakeVerbsError,
        get_device_list=get_device_list,
        Context=Context, PD=PD, MR=MR, CQ=CQ, QP=QP, QPInitAttr=QPInitAttr, QPCap=QPCap, QPAttr=QPAttr,
        AHAttr=AHAttr, GlobalRoute=GlobalRoute, GID=GID, SGE=SGE, SendWR=SendWR,
    )  # fmt: skip


@pytest.fixture
def fabric(monkeypatch) -> Iterator[Fabric]:
    """A fake RDMA device installed as the process's pyverbs (and the unavailable-note reset)."""
    fab = Fabric()
    verbs = make_verbs(fab)
    monkeypatch.setattr(rdma, "load_verbs", lambda: verbs)
    monkeypatch.setattr(rdma, "_noted", False)
    RdmaDevice.reset_shared()
    yield fab
    RdmaDevice.reset_shared()


@pytest.fixture
def no_rdma(monkeypatch):
    """pyverbs present, but the kernel has no RDMA (what CI and this machine look like)."""
    fab = Fabric()
    fab.list_error = FakeVerbsError("Failed to get devices list", errno.ENOSYS)
    monkeypatch.setattr(rdma, "load_verbs", lambda: make_verbs(fab))
    monkeypatch.setattr(rdma, "_noted", False)
    RdmaDevice.reset_shared()
    yield fab
    RdmaDevice.reset_shared()


def run(coro, timeout: float = 20.0):
    async def guarded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(guarded())


def device() -> RdmaDevice:
    return RdmaDevice.shared()


# ---- the pyverbs compat shim --------------------------------------------------------------------


def test_enum_shim_reads_flat_constants_and_enum_classes_alike():
    flat = types.SimpleNamespace(IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_READ=4, IBV_QPS_ERR=6, not_a_constant=3)

    class ibv_access_flags(enum.IntFlag):  # noqa: N801 - named as pyverbs 56+ names them
        IBV_ACCESS_LOCAL_WRITE = 1
        IBV_ACCESS_REMOTE_READ = 4

    class ibv_qp_state(enum.IntEnum):  # noqa: N801
        IBV_QPS_RESET = 0
        IBV_QPS_ERR = 6
        IBV_QPS_ERROR_ALIAS = 6  # an alias is still found by name

    new_style = types.SimpleNamespace(ibv_access_flags=ibv_access_flags, ibv_qp_state=ibv_qp_state)
    for e in (Enums(flat), Enums(new_style)):
        assert e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ == 5
        assert type(e.IBV_QPS_ERR) is int and e.IBV_QPS_ERR == 6
        with pytest.raises(AttributeError, match="IBV_NOPE"):
            _ = e.IBV_NOPE
    assert Enums(new_style).IBV_QPS_ERROR_ALIAS == 6
    assert "not_a_constant" not in Enums(flat)


def constants_used_by_rdma_module() -> set[str]:
    source = Path(rdma.__file__).read_text()
    return set(re.findall(r"\be\.(IBV_[A-Z0-9_]+)", source))


def test_fake_defines_every_constant_the_module_uses():
    assert constants_used_by_rdma_module() - set(IBV) == set()


def test_enum_shim_against_the_installed_pyverbs():
    """Catches API drift where pyverbs is importable (e.g. Debian's python3-pyverbs)."""
    pytest.importorskip("pyverbs")
    e = rdma.load_enums()
    missing = {name for name in constants_used_by_rdma_module() if name not in e}
    assert not missing
    for name, value in IBV.items():
        if name in e and not name.startswith("IBV_WC_") or name.endswith("_ERR") or name == "IBV_WC_SUCCESS":
            assert getattr(e, name) == value, name
    verbs = rdma.load_verbs()
    assert verbs.Error.__name__ == "PyverbsError"


def test_missing_pyverbs_is_no_rdma(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import pyverbs -> ImportError
    with pytest.raises(RdmaUnavailable, match="pyverbs not importable"):
        rdma.load_verbs()


# ---- codecs -------------------------------------------------------------------------------------


def test_qp_info_round_trips_and_rejects_malformed_input():
    info = QpInfo(lid=0x1234, gid=bytes(range(16)), gid_index=3, qpn=0xABCDE, psn=0xFFFFFF, mtu=5, rd_atomic=16)
    raw = info.encode()
    assert len(raw) == 32 and raw[0] == 1
    assert QpInfo.decode(raw) == info
    assert raw[16:] == bytes(range(16)) and int.from_bytes(raw[4:8], "little") == 0xABCDE
    with pytest.raises(ValueError, match="33 bytes"):
        QpInfo.decode(raw + b"\0")
    with pytest.raises(ValueError, match="version 2"):
        QpInfo.decode(b"\x02" + raw[1:])
    for bad in (dict(qpn=0), dict(qpn=1 << 24), dict(psn=1 << 24), dict(mtu=0), dict(mtu=6), dict(rd_atomic=0), dict(gid=b"short")):
        fields = dict(lid=0, gid=bytes(16), gid_index=0, qpn=7, psn=0, mtu=3, rd_atomic=1) | bad
        with pytest.raises(ValueError):
            QpInfo(**fields)  # type: ignore[arg-type]
    corrupt = bytearray(raw)
    corrupt[12] = 9  # mtu 9
    with pytest.raises(ValueError, match="mtu"):
        QpInfo.decode(bytes(corrupt))


def test_descriptor_round_trips_and_rejects_malformed_input():
    desc = RdmaDescriptor(rkey=0xDEADBEEF, base=0x7F00_0000_0000, offset=4096, length=256 * MiB)
    raw = desc.encode()
    assert len(raw) == 32 and RdmaDescriptor.decode(raw) == desc
    assert desc.remote_addr == 0x7F00_0000_1000
    with pytest.raises(ValueError):
        RdmaDescriptor.decode(raw[:31])
    with pytest.raises(ValueError, match="version"):
        RdmaDescriptor.decode(b"\x07" + raw[1:])
    with pytest.raises(ValueError):
        RdmaDescriptor(rkey=1 << 32, base=0, offset=0, length=1)
    with pytest.raises(ValueError):
        RdmaDescriptor(rkey=1, base=(1 << 64) - 10, offset=5, length=10)


# ---- discovery and the "no RDMA" path -----------------------------------------------------------


def test_discovery_picks_the_active_port_and_the_roce_v2_ipv4_gid(fabric):
    fabric.devices.insert(0, SimpleNamespace(name=b"mlx5_0"))  # sorts first, but its ports are down
    dev = device()
    assert (dev.port.device, dev.port.port, dev.port.gid_index) == ("rxe0", 1, 3)
    assert dev.port.ethernet and dev.port.gid == bytes.fromhex(ROCE_GIDS[3][0]) and dev.port.rd_atomic == 16


def test_discovery_on_infiniband_uses_gid_zero_and_the_lid(fabric):
    fabric.ports[("rxe0", 1)].link_layer = E.IBV_LINK_LAYER_INFINIBAND
    fabric.ports[("rxe0", 1)].lid = 0x42
    ctx, choice = discover(make_verbs(fabric), spec="")
    assert (choice.gid_index, choice.lid, choice.ethernet) == (0, 0x42, False)


def test_discovery_honours_an_explicit_device_port_and_gid(fabric):
    _, choice = discover(make_verbs(fabric), spec="rxe0:1:1")
    assert choice.gid_index == 1
    with pytest.raises(RdmaUnavailable, match="no RDMA devices named mlx5_9"):
        discover(make_verbs(fabric), spec="mlx5_9")


@pytest.mark.parametrize(
    "breakage, reason",
    [
        ("list_error", "no RDMA devices"),
        ("empty", "no RDMA devices"),
        ("enodev", "no device"),
        ("port_down", "port not active"),
        ("no_gid", "no usable GID"),
        ("no_reads", "no outstanding RDMA READs"),
    ],
)
def test_no_usable_device_is_rdma_unavailable(fabric, breakage, reason):
    if breakage == "list_error":
        fabric.list_error = FakeVerbsError("Failed to get devices list", errno.ENOSYS)
    elif breakage == "empty":
        fabric.devices.clear()
    elif breakage == "enodev":
        fabric.open_error = FakeVerbsError("Errno: 19, No such device", errno.ENODEV)
    elif breakage == "port_down":
        fabric.ports[("rxe0", 1)].state = E.IBV_PORT_DOWN
    elif breakage == "no_gid":
        fabric.gids[("rxe0", 1)] = [("00" * 16, True)]
    elif breakage == "no_reads":
        fabric.rd_atom = 0
    with pytest.raises(RdmaUnavailable, match=reason):
        device()
    with pytest.raises(RdmaUnavailable, match=reason):  # the verdict is cached
        device()


def test_no_device_means_tcp_with_one_log_line(no_rdma, caplog):
    caplog.set_level(logging.INFO, "dsuf.kvcache")
    arena = memoryview(bytearray(MiB))
    arena[:5] = b"hello"

    @contextlib.contextmanager
    def lookup(key, epoch):
        yield arena[:5]

    async def main():
        servers = [KvTransferServer(lookup, SECRET, arena=arena) for _ in range(2)]
        for s in servers:
            await s.start()
            assert s.transports == ["tcp"]
        fetcher = KvFetcher(SECRET, arena=arena)
        dst = await fetcher.fetch(servers[0].address, "ab", 1, lambda n: arena[1000 : 1000 + n])
        assert dst == b"hello" and fetcher.transports == ["tcp"]
        await fetcher.close()
        for s in servers:
            await s.stop()

    run(main())
    lines = [r.getMessage() for r in caplog.records if "RDMA unavailable" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "use TCP" in lines[0], lines


def test_rdma_required_but_absent_is_an_error(no_rdma):
    arena = memoryview(bytearray(4096))

    async def main():
        server = KvTransferServer(lambda k, e: contextlib.nullcontext(arena), SECRET, arena=arena, rdma=True)
        with pytest.raises(RuntimeError, match="RDMA required but unavailable"):
            await server.start()
        fetcher = KvFetcher(SECRET, arena=arena, rdma=True)
        with pytest.raises(TransferError, match="RDMA required"):
            await fetcher.fetch("127.0.0.1:1", "ab", 1, lambda n: arena[:n])

    run(main())
    with pytest.raises(ValueError):
        KvTransferServer(lambda k, e: contextlib.nullcontext(arena), SECRET, rdma=True)
    with pytest.raises(ValueError):
        KvFetcher(SECRET, rdma=True)


def test_rdma_false_never_touches_verbs(monkeypatch):
    def explode():
        raise AssertionError("verbs loaded although rdma=False")

    monkeypatch.setattr(rdma, "load_verbs", explode)
    RdmaDevice.reset_shared()
    arena = memoryview(bytearray(4096))

    async def main():
        server = KvTransferServer(lambda k, e: contextlib.nullcontext(arena[:10]), SECRET, arena=arena, rdma=False)
        await server.start()
        fetcher = KvFetcher(SECRET, arena=arena, rdma=False)
        assert len(await fetcher.fetch(server.address, "ab", 1, lambda n: memoryview(bytearray(n)))) == 10
        await fetcher.close()
        await server.stop()

    run(main())
    RdmaDevice.reset_shared()


# ---- memory registration ------------------------------------------------------------------------


def test_arena_is_registered_once_and_descriptors_are_bounds_checked(fabric):
    big = bytearray(10_000)
    arena = memoryview(big)[1000:9000]
    dev = device()
    a = dev.register(arena)
    b = dev.register(memoryview(big)[1000:9000])  # the same memory, another view
    assert a is b and fabric.mr_registrations == 1
    assert fabric.mrs[a.rkey].access == E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_READ
    desc = a.describe(arena[100:600])
    assert desc == RdmaDescriptor(rkey=a.rkey, base=a.base, offset=100, length=500)
    assert a.describe(arena.toreadonly()[100:600]) == desc  # owners may hand out read-only views
    assert a.local_addr(arena[7000:8000]) == a.base + 7000
    for outside in (memoryview(big)[500:1500], memoryview(big)[8500:9500], memoryview(bytearray(100)), arena[:0]):
        assert a.describe(outside) is None and a.local_addr(outside) is None
    for offset, length in ((-1, 10), (0, 0), (7990, 11), (8000, 1)):
        with pytest.raises(ValueError, match="not inside"):
            a.descriptor(offset, length)
    a.release()
    assert fabric.mrs  # still registered: one user left
    b.release()
    assert not fabric.mrs
    with pytest.raises(ValueError, match="writable"):
        dev.register(memoryview(bytes(100)))


# ---- queue pairs --------------------------------------------------------------------------------


def test_queue_pairs_walk_reset_init_rtr_rts_with_the_required_masks(fabric):
    dev = device()
    owner_qp = dev.create_qp(responder=True)
    reader = dev.create_qp(responder=False)
    remote_info = QpInfo(**{**owner_qp.info.__dict__, "mtu": E.IBV_MTU_512, "rd_atomic": 4})
    owner_qp.connect(reader.info)
    reader.connect(remote_info)
    for qp in (owner_qp, reader):
        steps = [(f, t) for qpn, f, t, _ in fabric.transitions if qpn == qp.info.qpn]
        assert steps == [(0, 1), (1, 2), (2, 3)]
        assert qp.state == "rts"
    fake_owner, fake_reader = fabric.qps[owner_qp.info.qpn], fabric.qps[reader.info.qpn]
    assert fake_owner.attrs["qp_access_flags"] & E.IBV_ACCESS_REMOTE_READ
    assert not fake_reader.attrs["qp_access_flags"] & E.IBV_ACCESS_REMOTE_READ  # nobody reads the fetcher
    assert fake_reader.attrs["path_mtu"] == E.IBV_MTU_512  # the smaller of both ports
    assert fake_reader.attrs["max_rd_atomic"] == 4  # bounded by the peer's device
    ah = fake_reader.attrs["ah_attr"]
    assert ah.is_global == 1 and ah.gr.sgid_index == 3 and str(ah.gr.dgid) == rdma.gid_text(remote_info.gid)  # RoCE: by GID
    with pytest.raises(RdmaError, match="not reset"):
        reader.connect(remote_info)
    owner_qp.close()
    reader.close()
    assert not fabric.qps


def test_a_refused_transition_is_an_rdma_error(fabric):
    qp = device().create_qp(responder=False)
    qp.info = QpInfo(**{**qp.info.__dict__})
    qp.state = "reset"
    fabric.qps[qp.info.qpn].state = E.IBV_QPS_RTS  # the device disagrees about where we are
    with pytest.raises(RdmaError, match="moving the queue pair to INIT failed"):
        qp.connect(qp.info)
    qp.close()


def connected_pair(dev: RdmaDevice):
    owner_qp, reader = dev.create_qp(responder=True), dev.create_qp(responder=False)
    owner_qp.connect(reader.info)
    reader.connect(owner_qp.info)
    return owner_qp, reader


def test_rdma_read_moves_the_bytes_in_bounded_work_requests(fabric, monkeypatch):
    monkeypatch.setattr(rdma, "WR_MAX_BYTES", MiB)
    dev = device()
    src = memoryview(bytearray(np.random.default_rng(1).bytes(24 * MiB + 5)))
    dst = memoryview(bytearray(len(src) + 64))
    smr, dmr = dev.register(src), dev.register(dst)
    owner_qp, reader = connected_pair(dev)
    reader.depth = 4  # keep several READs in flight, never more than the queue holds
    desc = smr.describe(src)
    run(reader.read_into(desc, dmr.local_addr(dst[32:-32]), dmr.lkey, io_timeout=2))
    assert dst[32:-32] == src and dst[:32] == bytes(32) and dst[-32:] == bytes(32)
    assert fabric.reads == [MiB] * 24 + [5]
    assert reader.outstanding == 0 and reader.state == "rts"


def test_wc_status_maps_to_one_line_transfer_errors():
    e = Enums(types.SimpleNamespace(**IBV))
    err = wc_error(e, E.IBV_WC_REM_ACCESS_ERR, 0x88)
    assert isinstance(err, TransferError) and isinstance(err, RdmaError)
    assert str(err) == "RDMA READ failed: IBV_WC_REM_ACCESS_ERR, the owner's memory region refused the read (stale rkey or range) (status 10, vendor error 0x88)"
    assert "IBV_WC_LOC_LEN_ERR" in str(wc_error(e, 1))  # not the opcode IBV_WC_RDMA_WRITE, also 1
    assert "owner stopped answering" in str(wc_error(e, E.IBV_WC_RETRY_EXC_ERR))
    assert "IBV_WC_77" in str(wc_error(e, 77))


def test_error_completion_raises_and_leaves_nothing_outstanding(fabric):
    dev = device()
    src, dst = memoryview(bytearray(b"s" * 4096)), memoryview(bytearray(4096))
    smr, dmr = dev.register(src), dev.register(dst)
    _, reader = connected_pair(dev)
    fabric.fail_status = E.IBV_WC_RETRY_EXC_ERR
    with pytest.raises(RdmaError, match="IBV_WC_RETRY_EXC_ERR"):
        run(reader.read_into(smr.describe(src), dmr.local_addr(dst), dmr.lkey, io_timeout=2))
    assert reader.state == "error" and reader.outstanding == 0
    with pytest.raises(RdmaError, match="not connected"):
        run(reader.read_into(smr.describe(src), dmr.local_addr(dst), dmr.lkey, io_timeout=2))


def test_wrong_rkey_is_a_remote_access_error(fabric):
    dev = device()
    src, dst = memoryview(bytearray(4096)), memoryview(bytearray(4096))
    smr, dmr = dev.register(src), dev.register(dst)
    _, reader = connected_pair(dev)
    stale = RdmaDescriptor(rkey=smr.rkey + 1, base=smr.base, offset=0, length=4096)
    with pytest.raises(RdmaError, match="REM_ACCESS_ERR"):
        run(reader.read_into(stale, dmr.local_addr(dst), dmr.lkey, io_timeout=2))


def test_stalled_read_times_out_and_is_drained_before_returning(fabric):
    dev = device()
    src, dst = memoryview(bytearray(3 * MiB)), memoryview(bytearray(3 * MiB))
    smr, dmr = dev.register(src), dev.register(dst)
    _, reader = connected_pair(dev)
    fabric.stall = True
    began = time.monotonic()
    with pytest.raises(RdmaError, match="no progress within 0.15s"):
        run(reader.read_into(smr.describe(src), dmr.local_addr(dst), dmr.lkey, io_timeout=0.15))
    assert 0.14 < time.monotonic() - began < 1.0
    fake = fabric.qps[reader.info.qpn]
    assert fake.state == E.IBV_QPS_ERR and fake.pending == []  # every posted READ flushed
    assert reader.outstanding == 0 and reader.qp is not None  # drained: the QP need not be destroyed


def test_read_that_never_flushes_destroys_the_queue_pair(fabric, monkeypatch):
    monkeypatch.setattr(rdma, "DRAIN_SECONDS", 0.05)
    dev = device()
    src, dst = memoryview(bytearray(4096)), memoryview(bytearray(4096))
    smr, dmr = dev.register(src), dev.register(dst)
    _, reader = connected_pair(dev)
    fabric.stall = fabric.no_flush = True
    qpn = reader.info.qpn
    with pytest.raises(RdmaError, match="no progress"):
        run(reader.read_into(smr.describe(src), dmr.local_addr(dst), dmr.lkey, io_timeout=0.05))
    assert reader.qp is None and qpn not in fabric.qps  # destroyed: no DMA can land later


def test_cancelled_read_is_drained_too(fabric):
    dev = device()
    src, dst = memoryview(bytearray(4096)), memoryview(bytearray(4096))
    smr, dmr = dev.register(src), dev.register(dst)
    _, reader = connected_pair(dev)
    fabric.stall = True

    async def main():
        task = asyncio.create_task(reader.read_into(smr.describe(src), dmr.local_addr(dst), dmr.lkey, io_timeout=5))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert reader.state == "error" and reader.outstanding == 0


# ---- end to end: the transport over (fake) RDMA -------------------------------------------------


class Owner:
    """Blobs inside a registered arena, a recording lookup, a server on the running loop."""

    def __init__(self, arena_bytes: int = 32 * MiB) -> None:
        self.arena = memoryview(bytearray(arena_bytes))
        self.blobs: dict[str, memoryview] = {}
        self.calls: list[str] = []
        self.refuse_after: int | None = None
        self.open = 0
        self.at = 0

    def add(self, key: str, data: bytes, *, outside: bool = False) -> memoryview:
        if outside:
            view = memoryview(bytearray(data))
        else:
            view = self.arena[self.at : self.at + len(data)]
            view[:] = data
            self.at += len(data) + 4096
        self.blobs[key] = view.toreadonly()
        return view

    @contextlib.contextmanager
    def lookup(self, key: str, epoch: int):
        self.calls.append(key)
        if self.refuse_after is not None and len(self.calls) > self.refuse_after:
            raise ExportRefused("busy")
        if key not in self.blobs:
            raise ExportRefused(f"unknown key {key}")
        self.open += 1
        try:
            yield self.blobs[key]
        finally:
            self.open -= 1


async def serve(owner: Owner, **kw) -> KvTransferServer:
    server = KvTransferServer(owner.lookup, SECRET, arena=owner.arena, **kw)
    await server.start()
    return server


async def settle(cond, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert cond()


def test_fetch_goes_by_rdma_read_and_reuses_the_queue_pair(fabric):
    owner = Owner()
    blobs = {f"{i:x}": np.random.default_rng(i).bytes(n) for i, n in enumerate((1, 4096, 5 * MiB + 3))}
    for key, data in blobs.items():
        owner.add(key, data)
    local = memoryview(bytearray(8 * MiB))

    async def main():
        server = await serve(owner)
        assert server.transports == ["tcp", "rdma"]
        fetcher = KvFetcher(SECRET, arena=local)
        for key, data in blobs.items():
            dst = await fetcher.fetch(server.address, key, 1, lambda n: local[100 : 100 + n])
            assert dst == data
        assert fetcher.transports == ["tcp", "rdma"]
        assert sum(fabric.reads) == sum(len(d) for d in blobs.values())  # every byte came by READ
        assert fabric.qps_created == 2  # one QP each side, for the pooled connection
        assert fabric.mr_registrations == 2  # one per arena
        await settle(lambda: owner.open == 0)
        await fetcher.close()
        await settle(lambda: not fabric.qps)  # the owner destroys its QP with the connection
        await server.stop()
        assert not fabric.mrs

    run(main())


def test_blob_outside_the_arena_or_destination_outside_ours_goes_by_tcp(fabric):
    owner = Owner()
    owner.add("a1", b"inside" * 1000)
    owner.add("a2", b"outside" * 1000, outside=True)
    local = memoryview(bytearray(MiB))

    async def main():
        server = await serve(owner)
        fetcher = KvFetcher(SECRET, arena=local)
        assert await fetcher.fetch(server.address, "a2", 1, lambda n: local[:n]) == b"outside" * 1000
        assert fabric.reads == []
        assert await fetcher.fetch(server.address, "a1", 1, lambda n: memoryview(bytearray(n))) == b"inside" * 1000
        assert fabric.reads == []
        assert await fetcher.fetch(server.address, "a1", 1, lambda n: local[:n]) == b"inside" * 1000
        assert fabric.reads == [6000]
        await fetcher.close()
        await server.stop()

    run(main())


def test_one_arena_shared_by_owner_and_fetcher_is_registered_once(fabric):
    owner = Owner(4 * MiB)
    owner.add("ab", b"own bytes" * 100)

    async def main():
        server = await serve(owner)
        fetcher = KvFetcher(SECRET, arena=owner.arena)  # as `dsuf serve` does: one host arena
        dst = await fetcher.fetch(server.address, "ab", 1, lambda n: owner.arena[2 * MiB : 2 * MiB + n])
        assert dst == b"own bytes" * 100 and fabric.reads == [900]
        assert fabric.mr_registrations == 1
        await fetcher.close()
        await server.stop()

    run(main())


def test_failed_rdma_falls_back_to_tcp_once(fabric, caplog):
    caplog.set_level(logging.INFO, "dsuf.kvcache.transport")
    owner = Owner()
    data = np.random.default_rng(5).bytes(MiB)
    owner.add("ab", data)
    local = memoryview(bytearray(2 * MiB))

    async def main():
        server = await serve(owner)
        fetcher = KvFetcher(SECRET, arena=local)
        fabric.fail_status, fabric.fail_reads = E.IBV_WC_REM_ACCESS_ERR, 1
        assert await fetcher.fetch(server.address, "ab", 1, lambda n: local[:n]) == data
        assert owner.calls == ["ab", "ab"]  # the RDMA attempt, then one TCP retry
        assert fabric.reads == []  # the bytes came by TCP
        retries = [r.getMessage() for r in caplog.records if "retrying once over TCP" in r.getMessage()]
        assert len(retries) == 1 and "IBV_WC_REM_ACCESS_ERR" in retries[0]
        # For a while that owner is fetched from over TCP (the pooled retry connection) ...
        fabric.fail_status = None
        assert await fetcher.fetch(server.address, "ab", 1, lambda n: local[:n]) == data
        assert fabric.reads == [] and owner.calls == ["ab"] * 3
        # ... and after the back-off by RDMA again, on a fresh connection
        fetcher._rdma_backoff[server.address] = 0.0
        local[:] = bytes(len(local))
        assert await fetcher.fetch(server.address, "ab", 1, lambda n: local[:n]) == data
        assert fabric.reads == [MiB]
        await settle(lambda: owner.open == 0)
        await fetcher.close()
        await server.stop()

    run(main())


def test_rdma_and_the_tcp_retry_both_failing_is_one_transfer_error(fabric):
    owner = Owner()
    owner.add("ab", b"z" * 50_000)
    local = memoryview(bytearray(MiB))

    async def main():
        server = await serve(owner)
        fetcher = KvFetcher(SECRET, arena=local)
        fabric.fail_status = E.IBV_WC_RETRY_EXC_ERR
        owner.refuse_after = 1  # the owner says "busy" to the retry
        with pytest.raises(ExportRefused, match="busy"):
            await fetcher.fetch(server.address, "ab", 1, lambda n: local[:n])
        assert owner.calls == ["ab", "ab"]  # exactly one retry, no more
        await settle(lambda: owner.open == 0)
        await fetcher.close()
        await server.stop()

    run(main())


def test_stalled_rdma_read_times_out_then_tcp_retry_fills_the_same_buffer(fabric):
    owner = Owner()
    data = np.random.default_rng(9).bytes(300_000)
    owner.add("ab", data)
    local = memoryview(bytearray(MiB))

    async def main():
        server = await serve(owner)
        fetcher = KvFetcher(SECRET, arena=local, io_timeout=0.2)
        fabric.stall = True
        handed: list[memoryview] = []

        def alloc(n: int) -> memoryview:
            handed.append(local[4096 : 4096 + n])
            return handed[-1]

        dst = await fetcher.fetch(server.address, "ab", 1, alloc)
        assert len(handed) == 1 and dst.obj is local.obj and dst == data  # alloc called once
        assert not any(qp.pending for qp in fabric.qps.values())  # the stalled READs were flushed
        await fetcher.close()
        await server.stop()

    run(main())


def test_long_rdma_read_renews_the_lease(fabric, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "dsuf.kvcache.transport")
    monkeypatch.setattr(rdma, "WR_MAX_BYTES", 64 << 10)
    owner = Owner()
    owner.add("ab", b"r" * (640 << 10))  # 10 READs
    local = memoryview(bytearray(MiB))

    async def main():
        server = await serve(owner, lease_seconds=0.2)
        fetcher = KvFetcher(SECRET, arena=local)
        fabric.completion_delay = 0.06
        # One READ in flight at a time: about 0.6 s in all, three lease periods.
        orig = rdma.RcQueuePair.__init__

        def shallow(self, device, *, responder):
            orig(self, device, responder=responder)
            self.depth = 1

        monkeypatch.setattr(rdma.RcQueuePair, "__init__", shallow)
        began = time.monotonic()
        assert await fetcher.fetch(server.address, "ab", 1, lambda n: local[:n]) == b"r" * (640 << 10)
        assert time.monotonic() - began > 0.5
        await settle(lambda: owner.open == 0)
        await fetcher.close()
        await server.stop()

    run(main())
    assert not [r for r in caplog.records if "expired" in r.getMessage()]


def test_garbage_qp_info_is_a_protocol_error_not_a_crash(fabric):
    owner = Owner()
    owner.add("ab", b"fine")

    async def main():
        server = await serve(owner)
        loop = asyncio.get_running_loop()
        host, port = tr.split_addr(server.address)
        reader, writer = await asyncio.open_connection(host, port)
        nonce = b"n" * 32
        writer.write(tr._frame(tr.Hello(version=1, nonce=nonce)))
        (n,) = tr._LEN.unpack(await reader.readexactly(4))
        challenge = msgspec_decode(await reader.readexactly(n))
        proof = tr._mac(SECRET, tr._FETCHER_LABEL, nonce, challenge.nonce)
        writer.write(tr._frame(tr.Proof(proof=proof)) + tr._frame(tr.Acquire(key="ab", epoch=1, offer=["tcp", "rdma"], qp=b"\x01" * 32)))
        (n,) = tr._LEN.unpack(await reader.readexactly(4))
        reply = msgspec_decode(await reader.readexactly(n))
        assert isinstance(reply, tr.Refused) and reply.kind == "protocol" and "bad QP info" in reply.reason
        assert await reader.read() == b""
        writer.close()
        await settle(lambda: owner.open == 0)
        fetcher = KvFetcher(SECRET, arena=memoryview(bytearray(4096)))
        assert await fetcher.fetch(server.address, "ab", 1, lambda n: memoryview(bytearray(n))) == b"fine"
        await fetcher.close()
        await server.stop()
        del loop

    run(main())


def msgspec_decode(body: bytes):
    import msgspec

    return msgspec.msgpack.Decoder(tr.Challenge | tr.Grant | tr.Refused).decode(body)


def test_real_pyverbs_accepts_the_objects_we_build():
    """Where pyverbs is importable: connect() and read_into() build their QPAttr/AHAttr/GID/SGE/
    SendWR objects with the real classes (only the device-bound QP and CQ are stand-ins)."""
    pytest.importorskip("pyverbs")
    verbs = rdma.load_verbs()
    port = rdma.PortChoice(device="x", port=1, gid_index=3, gid=bytes.fromhex(ROCE_GIDS[3][0]), lid=0, mtu=5,
                           ethernet=True, rd_atomic=16, max_msg=1 << 31, max_wr=1024)  # fmt: skip
    fake_dev = SimpleNamespace(verbs=verbs, e=verbs.e, port=port)
    modified: list[tuple[object, int]] = []
    posted: list[object] = []
    qp = object.__new__(rdma.RcQueuePair)
    qp.device, qp.responder, qp.depth, qp.outstanding, qp.state = fake_dev, True, 4, 0, "reset"
    qp.qp = SimpleNamespace(modify=lambda attr, mask: modified.append((attr, mask)), post_send=posted.append)
    qp.cq = SimpleNamespace(poll=lambda n: (1, [SimpleNamespace(status=verbs.e.IBV_WC_SUCCESS, vendor_err=0)]))
    qp.info = QpInfo(lid=0, gid=port.gid, gid_index=3, qpn=0x99, psn=5, mtu=5, rd_atomic=16)
    qp.connect(QpInfo(lid=0, gid=bytes(range(16)), gid_index=1, qpn=0x77, psn=9, mtu=3, rd_atomic=8))
    rtr, rts = modified[1][0], modified[2][0]
    assert (rtr.dest_qp_num, rtr.rq_psn, rtr.path_mtu, rtr.max_dest_rd_atomic) == (0x77, 9, 3, 16)
    assert (rts.sq_psn, rts.max_rd_atomic, rts.retry_cnt) == (5, 8, 7)
    assert str(rtr.ah_attr.dgid) == rdma.gid_text(bytes(range(16))) and rtr.ah_attr.is_global == 1
    desc = RdmaDescriptor(rkey=0x1234, base=0x10000, offset=0, length=3 * MiB)
    run(qp.read_into(desc, 0x20000, 0x55, io_timeout=1))
    assert len(posted) == 1


def test_closing_the_fetcher_mid_fetch_keeps_the_arena_registered_until_it_ends(fabric):
    owner = Owner()
    owner.add("ab", b"q" * 100_000)
    local = memoryview(bytearray(MiB))

    async def main():
        server = await serve(owner)
        fetcher = KvFetcher(SECRET, arena=local)
        fabric.completion_delay = 0.1
        task = asyncio.create_task(fetcher.fetch(server.address, "ab", 1, lambda n: local[:n]))
        await settle(lambda: fabric.reads)  # the READ is posted, its completion not yet seen
        await fetcher.close()
        assert len(fabric.mrs) == 4  # both arenas (lkey and rkey each): still registered
        assert await task == b"q" * 100_000
        assert len(fabric.mrs) == 2  # ours went with the last fetch; the owner's stays
        with pytest.raises(TransferError, match="closed"):
            await fetcher.fetch(server.address, "ab", 1, lambda n: local[:n])
        await server.stop()
        assert not fabric.mrs

    run(main())
