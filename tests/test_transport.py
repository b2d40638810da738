"""The KV-snapshot transport over TCP on loopback: real sockets, a real owner, fault injection.

The owner runs in a thread with its own event loop (so a fetcher that blocks its own loop, as a
stalling `alloc` does, cannot stall the owner too), or, for SIGKILL/SIGSTOP, in a subprocess:
this file doubles as that subprocess (`python tests/test_transport.py owner SIZE`). Each test runs
its fetches in `asyncio.run` under a deadline, so a hang fails instead of blocking the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import msgspec
import numpy as np
import pytest

from dsuf.kvcache import transport as tr
from dsuf.kvcache.transport import AuthFailed, ExportRefused, KvFetcher, KvTransferServer, TransferError

SECRET = b"cluster-secret-for-tests"
T = TypeVar("T")
MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


def run(coro: Awaitable[T], timeout: float = 20.0) -> T:
    async def guarded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(guarded())


def rand_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def buffer_alloc(record: list[int] | None = None):
    """An alloc that hands out fresh writable buffers (and records the sizes asked for)."""

    def alloc(n: int) -> memoryview:
        if record is not None:
            record.append(n)
        return memoryview(bytearray(n))

    return alloc


class ThreadedOwner:
    """A KvTransferServer on its own loop in a thread, with a lookup that records every call and
    every lease's enter/exit (with timestamps)."""

    def __init__(self, secret: bytes = SECRET, *, lease_seconds: float = 10.0, port: int = 0) -> None:
        self.blobs: dict[str, tuple[int, memoryview]] = {}
        self.calls: list[tuple[str, int]] = []
        self.events: list[tuple[str, str, float]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = KvTransferServer(self.lookup, secret, port=port, lease_seconds=lease_seconds)
        self.call(self.server.start())
        self.addr = self.server.address

    def call(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)  # type: ignore[arg-type]

    def add(self, key: str, data: bytes, epoch: int = 1) -> memoryview:
        view = memoryview(bytearray(data))
        self.blobs[key] = (epoch, view)
        return view

    @contextlib.contextmanager
    def lookup(self, key: str, epoch: int) -> Iterator[memoryview]:
        self.calls.append((key, epoch))
        if key not in self.blobs:
            raise ExportRefused(f"unknown key {key}")
        held, view = self.blobs[key]
        if epoch != held:
            raise ExportRefused(f"stale epoch {epoch}, this owner holds epoch {held}")
        self.events.append(("enter", key, time.monotonic()))
        try:
            yield view
        finally:
            self.events.append(("exit", key, time.monotonic()))

    def open_leases(self) -> int:
        return sum(1 if e == "enter" else -1 for e, _, _ in self.events)

    def wait_released(self, timeout: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        while self.open_leases() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert self.open_leases() == 0, self.events

    def close(self) -> None:
        if self.loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def owner() -> Iterator[ThreadedOwner]:
    o = ThreadedOwner()
    yield o
    o.close()


# ---- a raw protocol client, for what a well-behaved KvFetcher never does ------------------------

_from_owner = msgspec.msgpack.Decoder(tr.Challenge | tr.Grant | tr.Refused)


def raw_connect(addr: str) -> socket.socket:
    host, port = tr.split_addr(addr)
    sock = socket.create_connection((host, port), timeout=3)
    return sock


def raw_send(sock: socket.socket, *msgs: msgspec.Struct) -> None:
    sock.sendall(b"".join(tr._frame(m) for m in msgs))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError(f"EOF after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def raw_recv(sock: socket.socket):
    (n,) = tr._LEN.unpack(recv_exact(sock, 4))
    return _from_owner.decode(recv_exact(sock, n))


def read_to_eof(sock: socket.socket) -> bytes:
    out = bytearray()
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 20):
            out += chunk
    return bytes(out)


def raw_login(sock: socket.socket, secret: bytes = SECRET, *, forge: bool = False) -> None:
    """Handshake as a fetcher; `forge` sends a proof made without the owner's nonce check."""
    nonce = os.urandom(32)
    raw_send(sock, tr.Hello(version=1, nonce=nonce))
    challenge = raw_recv(sock)
    assert isinstance(challenge, tr.Challenge)
    proof = os.urandom(32) if forge else tr._mac(secret, tr._FETCHER_LABEL, nonce, challenge.nonce)
    raw_send(sock, tr.Proof(proof=proof))


# ---- round trips --------------------------------------------------------------------------------


def test_round_trip_is_byte_exact_for_every_size(owner):
    sizes = [0, 1, 1000, 3 * MiB + 7, 80 * MiB]
    for i, n in enumerate(sizes):
        owner.add(f"{i:x}a", rand_bytes(n, seed=i))
    asked: list[int] = []

    async def main():
        fetcher = KvFetcher(SECRET)
        try:
            for i, n in enumerate(sizes):
                dst = await fetcher.fetch(owner.addr, f"{i:x}a", 1, buffer_alloc(asked))
                assert isinstance(dst, memoryview) and len(dst) == n and not dst.readonly
                assert dst == owner.blobs[f"{i:x}a"][1], f"bytes differ for size {n}"
        finally:
            await fetcher.close()

    run(main())
    assert asked == sizes  # alloc is asked for exactly the blob's size, once per fetch
    owner.wait_released()


def test_destination_is_the_view_alloc_returned(owner):
    owner.add("ab", rand_bytes(5000))
    arena = bytearray(10000)

    async def main():
        fetcher = KvFetcher(SECRET)
        dst = await fetcher.fetch(owner.addr, "ab", 1, lambda n: memoryview(arena)[100 : 100 + n])
        await fetcher.close()
        return dst

    dst = run(main())
    assert dst.obj is arena and bytes(arena[100:5100]) == owner.blobs["ab"][1]
    assert arena[:100] == bytes(100) and arena[5100:] == bytes(4900)  # nothing written outside


def test_empty_secret_is_rejected_at_construction():
    for secret in (b"", None, "text"):
        with pytest.raises(ValueError):
            KvFetcher(secret)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            KvTransferServer(lambda k, e: contextlib.nullcontext(memoryview(b"")), secret)  # type: ignore[arg-type]


# ---- authentication -----------------------------------------------------------------------------


def test_fetcher_with_wrong_secret_gets_auth_failed_and_owner_never_looks_up(owner):
    owner.add("ab", b"secret bytes")

    async def main():
        fetcher = KvFetcher(b"not-the-cluster-secret")
        with pytest.raises(AuthFailed, match="secret"):
            await fetcher.fetch(owner.addr, "ab", 1, buffer_alloc())
        await fetcher.close()

    run(main())
    assert owner.calls == [] and owner.events == []


def test_owner_with_wrong_secret_is_not_trusted_and_never_sees_the_request():
    impostor = ThreadedOwner(b"impostor-secret")
    impostor.add("ab", b"bytes")
    try:

        async def main():
            fetcher = KvFetcher(SECRET)
            with pytest.raises(AuthFailed, match="secret mismatch"):
                await fetcher.fetch(impostor.addr, "ab", 1, buffer_alloc())
            await fetcher.close()

        run(main())
        assert impostor.calls == []  # the acquire (key, epoch) was never sent
    finally:
        impostor.close()


def test_forged_proof_is_refused_and_no_blob_byte_is_sent(owner):
    owner.add("ab", b"\x55" * 4096)
    with raw_connect(owner.addr) as sock:
        raw_login(sock, forge=True)
        # Pipeline an acquire and a pull as if authenticated: the owner must answer neither.
        raw_send(sock, tr.Acquire(key="ab", epoch=1, offer=["tcp"]), tr.Pull(lease=1, offset=0, length=4096))
        reply = raw_recv(sock)
        assert isinstance(reply, tr.Refused) and reply.kind == "auth"
        assert read_to_eof(sock) == b""  # then EOF: nothing else, in particular no blob bytes
    assert owner.calls == []


def test_fetcher_sees_owner_refusing_its_proof_as_auth_failed(owner):
    """The owner's side of the check, seen through a real KvFetcher with a forged proof."""
    owner.add("ab", b"x")

    async def main():
        fetcher = KvFetcher(SECRET)
        real_mac = tr._mac

        def forge(secret, label, nf, no):  # our proof goes wrong, the owner's still verifies
            return os.urandom(32) if label == tr._FETCHER_LABEL else real_mac(secret, label, nf, no)

        tr._mac = forge
        try:
            with pytest.raises(AuthFailed, match="refused authentication"):
                await fetcher.fetch(owner.addr, "ab", 1, buffer_alloc())
        finally:
            tr._mac = real_mac
            await fetcher.close()

    run(main())
    assert owner.calls == []


# ---- refusals -----------------------------------------------------------------------------------


def test_stale_epoch_and_unknown_key_are_refused_with_the_reason(owner):
    owner.add("ab", b"payload", epoch=4)

    async def main():
        fetcher = KvFetcher(SECRET)
        with pytest.raises(ExportRefused, match="stale epoch 3, this owner holds epoch 4"):
            await fetcher.fetch(owner.addr, "ab", 3, buffer_alloc())
        with pytest.raises(ExportRefused, match="unknown key cd"):
            await fetcher.fetch(owner.addr, "cd", 4, buffer_alloc())
        # the connection stays usable after a refusal
        assert await fetcher.fetch(owner.addr, "ab", 4, buffer_alloc()) == b"payload"
        await fetcher.close()

    run(main())
    assert owner.calls == [("ab", 3), ("cd", 4), ("ab", 4)]
    owner.wait_released()


def test_lookup_crashing_is_a_refusal_not_a_dead_owner(owner):
    owner.add("ab", b"fine")

    def broken(key, epoch):
        if key == "ee":
            raise RuntimeError("disk on fire\nsecond line")
        return ThreadedOwner.lookup(owner, key, epoch)

    owner.server._lookup = broken

    async def main():
        fetcher = KvFetcher(SECRET)
        with pytest.raises(ExportRefused, match=r"owner error \(RuntimeError\)$"):
            await fetcher.fetch(owner.addr, "ee", 1, buffer_alloc())
        assert await fetcher.fetch(owner.addr, "ab", 1, buffer_alloc()) == b"fine"
        await fetcher.close()

    run(main())


# ---- leases -------------------------------------------------------------------------------------


def test_read_lease_is_held_during_the_transfer_and_released_after(owner):
    owner.add("ab", rand_bytes(2 * MiB))
    seen: list[int] = []

    def alloc(n: int) -> memoryview:
        seen.append(owner.open_leases())  # the blob is pinned before a byte moves
        return memoryview(bytearray(n))

    async def main():
        fetcher = KvFetcher(SECRET)
        for _ in range(3):
            await fetcher.fetch(owner.addr, "ab", 1, alloc)
        await fetcher.close()

    run(main())
    assert seen == [1, 1, 1]
    owner.wait_released()
    assert [e for e, _, _ in owner.events] == ["enter", "exit"] * 3


def test_alloc_refusing_propagates_and_releases_the_lease(owner):
    owner.add("ab", b"x" * 100)

    class NoRoom(TransferError):
        pass

    def alloc(n: int) -> memoryview:
        raise NoRoom(f"no room for {n} bytes")

    async def main():
        fetcher = KvFetcher(SECRET)
        with pytest.raises(NoRoom, match="no room for 100 bytes"):
            await fetcher.fetch(owner.addr, "ab", 1, alloc)
        assert await fetcher.fetch(owner.addr, "ab", 1, buffer_alloc()) == b"x" * 100
        await fetcher.close()

    run(main())
    owner.wait_released()


def test_alloc_returning_the_wrong_buffer_is_a_transfer_error(owner):
    owner.add("ab", b"x" * 100)

    async def main():
        fetcher = KvFetcher(SECRET)
        with pytest.raises(TransferError, match=r"alloc\(100\) returned 99 bytes"):
            await fetcher.fetch(owner.addr, "ab", 1, lambda n: memoryview(bytearray(n - 1)))
        with pytest.raises(TransferError, match="read-only"):
            await fetcher.fetch(owner.addr, "ab", 1, lambda n: memoryview(bytes(n)))
        await fetcher.close()

    run(main())
    owner.wait_released()


def test_lease_expires_when_the_fetcher_stalls_before_pulling(caplog):
    caplog.set_level(logging.WARNING, "dsuf.kvcache.transport")
    owner = ThreadedOwner(lease_seconds=0.2)
    owner.add("ab", rand_bytes(MiB))
    try:
        stalled: dict[str, float] = {}

        def slow_alloc(n: int) -> memoryview:
            stalled["start"] = time.monotonic()
            time.sleep(0.6)  # blocks this loop; the owner runs on its own
            stalled["end"] = time.monotonic()
            return memoryview(bytearray(n))

        async def main():
            fetcher = KvFetcher(SECRET)
            with pytest.raises(TransferError):
                await fetcher.fetch(owner.addr, "ab", 1, slow_alloc)
            await fetcher.close()

        run(main())
        exits = [t for e, _, t in owner.events if e == "exit"]
        assert len(exits) == 1 and stalled["start"] < exits[0] < stalled["end"]  # closed while stalled
        assert exits[0] - stalled["start"] < 0.5
        assert any("expired" in r.getMessage() for r in caplog.records)
    finally:
        owner.close()


def test_lease_expires_when_the_fetcher_stops_reading_mid_stream():
    owner = ThreadedOwner(lease_seconds=0.25)
    owner.add("ab", b"\x07" * (64 * MiB))
    try:
        with raw_connect(owner.addr) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            raw_login(sock)
            raw_send(sock, tr.Acquire(key="ab", epoch=1, offer=["tcp"]))
            grant = raw_recv(sock)
            assert isinstance(grant, tr.Grant) and grant.total_bytes == 64 * MiB and grant.path == "tcp"
            raw_send(sock, tr.Pull(lease=grant.lease, offset=0, length=grant.total_bytes))
            assert recv_exact(sock, MiB) == b"\x07" * MiB
            stop = time.monotonic()
            owner.wait_released(timeout=3)  # we read nothing more: the owner gives the lease up
            assert time.monotonic() - stop < 2
            rest = read_to_eof(sock)  # and closes the connection: EOF before the end of the blob
            assert MiB + len(rest) < 64 * MiB
    finally:
        owner.close()


# ---- owner faults (subprocess owner) ------------------------------------------------------------


class ProcessOwner:
    """This file run as `owner SIZE`: one blob "ab" of SIZE bytes 0xAB at epoch 1."""

    def __init__(self, size: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "owner", str(size)], cwd=REPO, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert line, "owner subprocess did not start"
        self.addr = line

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
        self.proc.wait(5)


@pytest.fixture
def process_owner():
    owners: list[ProcessOwner] = []

    def start(size: int) -> ProcessOwner:
        owners.append(ProcessOwner(size))
        return owners[-1]

    yield start
    for o in owners:
        o.close()


async def fetch_and_signal(addr: str, size: int, sig: int, pid: int, io_timeout: float) -> tuple[BaseException | None, memoryview, float]:
    """Fetch "ab"; as soon as the first bytes have landed, send `sig` to the owner. Returns the
    fetch's exception (or None), the destination, and seconds from the signal to the fetch's end."""
    holder: dict[str, memoryview] = {}

    def alloc(n: int) -> memoryview:
        holder["dst"] = memoryview(bytearray(n))
        return holder["dst"]

    fetcher = KvFetcher(SECRET, io_timeout=io_timeout)
    task = asyncio.create_task(fetcher.fetch(addr, "ab", 1, alloc))
    while "dst" not in holder or holder["dst"][0] != 0xAB:
        assert not task.done(), task
        await asyncio.sleep(0)
    os.kill(pid, sig)
    signalled = time.monotonic()
    try:
        await task
        error = None
    except BaseException as e:
        error = e
    took = time.monotonic() - signalled
    await fetcher.close()
    return error, holder["dst"], took


def test_owner_killed_mid_transfer_is_a_transfer_error(process_owner):
    size = 160 * MiB
    o = process_owner(size)
    error, dst, _ = run(fetch_and_signal(o.addr, size, signal.SIGKILL, o.proc.pid, io_timeout=5))
    assert isinstance(error, TransferError) and ("closed the connection" in str(error) or "reset" in str(error)), error
    assert "\n" not in str(error)
    assert dst[0] == 0xAB and dst[-1] == 0  # it really was mid-stream; the fetch returned nothing


def test_owner_stopped_mid_transfer_times_out_within_io_timeout(process_owner):
    size = 160 * MiB
    o = process_owner(size)
    error, dst, took = run(fetch_and_signal(o.addr, size, signal.SIGSTOP, o.proc.pid, io_timeout=0.5))
    assert isinstance(error, TransferError) and "no progress within 0.5s" in str(error), error
    assert 0.3 < took < 1.5
    assert dst[-1] == 0


def test_owner_stopped_before_answering_times_out(process_owner):
    o = process_owner(1000)
    o.signal(signal.SIGSTOP)  # the kernel still accepts the connection; nobody answers

    async def main():
        fetcher = KvFetcher(SECRET, io_timeout=0.3)
        began = time.monotonic()
        with pytest.raises(TransferError, match="no progress"):
            await fetcher.fetch(o.addr, "ab", 1, buffer_alloc())
        await fetcher.close()
        return time.monotonic() - began

    assert run(main()) < 1.0
    o.signal(signal.SIGCONT)


def test_nobody_listening_is_a_quick_transfer_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = "127.0.0.1:%d" % s.getsockname()[1]  # bound, never listening: refused

    async def main():
        fetcher = KvFetcher(SECRET)
        with pytest.raises(TransferError, match="could not connect"):
            await fetcher.fetch(addr, "ab", 1, buffer_alloc())
        for bad in ("no-port", "host:", "host:99999"):
            with pytest.raises(TransferError, match="bad owner address"):
                await fetcher.fetch(bad, "ab", 1, buffer_alloc())
        with pytest.raises(TransferError, match="bad key"):
            await fetcher.fetch(addr, "", 1, buffer_alloc())
        with pytest.raises(TransferError, match="bad epoch"):
            await fetcher.fetch(addr, "ab", -1, buffer_alloc())
        await fetcher.close()

    run(main())


# ---- robustness ---------------------------------------------------------------------------------

GARBAGE = [
    b"",  # connect and hang up
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # length prefix of ~1.1 GB
    b"\xff\xff\xff\xff" + b"x" * 100,
    b"\x00\x00\x00\x00",  # empty frame
    b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1",  # not msgpack
    b"\x00\x00\x00\x03\x93\x01\x02",  # msgpack, not a message
    tr._frame(tr.Acquire(key="ab", epoch=1, offer=["tcp"])),  # acquire before authentication
    tr._frame(tr.Hello(version=99, nonce=b"n" * 32)),  # a future protocol version
    tr._frame(tr.Hello(version=1, nonce=b"n" * 32)) + os.urandom(5000),  # then noise
    os.urandom(100_000),
]


def test_garbage_does_not_kill_the_owner(owner, caplog):
    caplog.set_level(logging.INFO, "dsuf.kvcache.transport")
    owner.add("ab", rand_bytes(100_000))
    for junk in GARBAGE:
        with raw_connect(owner.addr) as sock:
            with contextlib.suppress(OSError):
                sock.sendall(junk)
                sock.shutdown(socket.SHUT_WR)
                read_to_eof(sock)  # the owner closes its end
    # garbage after a good login: an unknown lease, a pull out of range, a frame of junk
    for after in (
        [tr.Release(lease=77)],
        [tr.Acquire(key="ab", epoch=1, offer=["tcp"]), tr.Pull(lease=1, offset=99_999, length=2)],
        [tr.Acquire(key="ab", epoch=1, offer=["tcp"]), tr.Acquire(key="ab", epoch=1, offer=["tcp"])],
    ):
        with raw_connect(owner.addr) as sock:
            raw_login(sock)
            raw_send(sock, *after)
            read_to_eof(sock)
    owner.wait_released()
    assert owner.open_leases() == 0
    protocol_lines = [r.getMessage() for r in caplog.records if "protocol error" in r.getMessage()]
    assert len(protocol_lines) >= 8 and all("\n" not in line for line in protocol_lines)

    async def main():
        fetcher = KvFetcher(SECRET)
        dst = await fetcher.fetch(owner.addr, "ab", 1, buffer_alloc())
        await fetcher.close()
        return dst

    assert run(main()) == owner.blobs["ab"][1]


def test_concurrent_fetches_from_several_clients(owner):
    keys = [f"{i:02x}" for i in range(12)]
    for i, key in enumerate(keys):
        owner.add(key, rand_bytes(MiB + 997 * i, seed=i))

    async def main():
        fetchers = [KvFetcher(SECRET) for _ in range(3)]
        jobs = [fetchers[i % 3].fetch(owner.addr, key, 1, buffer_alloc()) for i, key in enumerate(keys * 2)]
        results = await asyncio.gather(*jobs)
        for f in fetchers:
            await f.close()
        return results

    results = run(main())
    for key, dst in zip(keys * 2, results, strict=True):
        assert dst == owner.blobs[key][1]
    owner.wait_released()


def test_pooled_connection_to_a_restarted_owner_is_replaced(owner):
    owner.add("ab", b"first")
    port = int(owner.addr.rsplit(":", 1)[1])

    async def main():
        fetcher = KvFetcher(SECRET)
        assert await fetcher.fetch(owner.addr, "ab", 1, buffer_alloc()) == b"first"
        owner.close()  # drops the pooled connection's other end
        second = ThreadedOwner(port=port)
        try:
            second.add("ab", b"second")
            await asyncio.sleep(0.05)
            assert await fetcher.fetch(second.addr, "ab", 1, buffer_alloc()) == b"second"
        finally:
            second.close()
            await fetcher.close()

    run(main())


def test_a_closed_fetcher_refuses_to_fetch(owner):
    async def main():
        fetcher = KvFetcher(SECRET)
        await fetcher.close()
        with pytest.raises(TransferError, match="closed"):
            await fetcher.fetch(owner.addr, "ab", 1, buffer_alloc())

    run(main())


def test_server_properties():
    server = KvTransferServer(lambda k, e: contextlib.nullcontext(memoryview(b"")), SECRET, rdma=False)
    with pytest.raises(RuntimeError):
        _ = server.address

    async def main():
        await server.start()
        try:
            host, port = tr.split_addr(server.address)
            assert host == "127.0.0.1" and port > 0
            assert server.transports == ["tcp"]
        finally:
            await server.stop()

    run(main())


# ---- the subprocess owner -----------------------------------------------------------------------


def _owner_main(size: int) -> None:
    import uvloop

    blob = memoryview(b"\xab" * size)

    @contextlib.contextmanager
    def lookup(key: str, epoch: int):
        if key != "ab":
            raise ExportRefused("unknown key")
        yield blob

    async def main() -> None:
        server = KvTransferServer(lookup, SECRET, rdma=False)
        await server.start()
        print(server.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    uvloop.run(main())


if __name__ == "__main__" and sys.argv[1:2] == ["owner"]:
    _owner_main(int(sys.argv[2]))
