"""Moving a conversation's KV-cache snapshot from the server that owns it to one that needs it.

The owner runs a `KvTransferServer`; a fetcher uses a `KvFetcher` (kv_sharing.md §4.4). The
control channel is always TCP. The bytes then travel over the same TCP connection, or by RDMA
READ (`dsuf.kvcache.rdma`) when both sides have a device and the blob lies in the owner's
registered arena. The transport moves opaque bytes: the caller verifies the snapshot's header and
CRC after the fetch, and any `TransferError` means "recompute".

Wire protocol, version 1
------------------------

Every control message is one frame::

    u32 N (big-endian) ‖ N bytes of msgpack, 1 ≤ N ≤ 16384

The msgpack value is a map whose field ``"t"`` names the message; the other fields are listed
below (``bytes`` are msgpack bin, ``int`` are unsigned). A frame that is too long, does not
decode, or names a message the receiver does not expect at that point ends the connection (the
owner logs one line and, where it can, answers ``refused`` of kind ``protocol`` first).

==============  =========  ==============================================================
``t``           direction  fields
==============  =========  ==============================================================
``hello``       F → O      ``version`` (1), ``nonce`` (32 random bytes, N_f)
``challenge``   O → F      ``version`` (1), ``nonce`` (32 random bytes, N_o), ``proof``
``proof``       F → O      ``proof``
``acquire``     F → O      ``key`` (hex, ≤ 128 chars), ``epoch``, ``offer`` (list of
                           ``"tcp"``/``"rdma"``), ``qp`` (bin: the fetcher's RDMA QP info,
                           `rdma.QpInfo`; only while its QP is not yet connected) or nil
``grant``       O → F      ``lease`` (id), ``total_bytes``, ``path`` (``"tcp"``/``"rdma"``),
                           ``lease_ms``, ``qp`` (bin: the owner's QP info, when it just
                           connected a QP for this connection) or nil, ``desc`` (bin:
                           `rdma.RdmaDescriptor`, when ``path`` is ``"rdma"``) or nil
``refused``     either     ``kind`` (``"refused"``, ``"auth"`` or ``"protocol"``),
                           ``reason`` (one line)
``pull``        F → O      ``lease``, ``offset``, ``length``; the owner answers with exactly
                           ``length`` raw bytes, blob[offset : offset + length], unframed
``renew``       F → O      ``lease``; no answer (extends the lease, used during RDMA reads)
``release``     F → O      ``lease``; no answer (ends the lease)
==============  =========  ==============================================================

A connection goes::

    F: hello                     O: challenge       (O proves it knows the secret)
    F: proof, acquire            O: grant | refused  (F proves it; pipelined, one round trip)
    F: pull                      O: <length raw bytes>          (path "tcp")
       or RDMA READs of desc.base + desc.offset … (path "rdma"), renew every lease_ms/2
    F: release
    F: acquire …                 (the connection may be pooled and reused)

Authentication is mutual HMAC-SHA256 challenge-response over both fresh nonces:
``proof = HMAC(secret, label ‖ N_f ‖ N_o)`` with label ``b"dsuf-kv/1 owner\\0"`` for the
owner's proof and ``b"dsuf-kv/1 fetcher\\0"`` for the fetcher's (distinct labels, so neither
proof can be reflected as the other). The secret itself never crosses the wire and proofs are
compared in constant time. The fetcher checks the owner's proof before it sends anything about
the blob; the owner checks the fetcher's proof before it calls `lookup`, and answers a wrong one
with ``refused``/``auth`` and closes. A peer without the secret is never sent a blob byte.

Leases: ``acquire`` makes the owner call ``lookup(key, epoch)`` and keep the returned context
open: that pins the blob (kv_sharing.md §4.2 step 4). The lease ends at ``release``, when the
connection drops, or when the fetcher makes no progress for ``lease_seconds``: progress is
``acquire``, ``pull``, ``renew``, and each few MiB that the owner's socket accepts during a pull.
An expired lease closes the context and the connection. One lease at a time per connection.

Data, TCP path: a single ``pull`` of the whole blob; the owner sends it with `loop.sock_sendall`
from the blob's memoryview and the fetcher receives with `loop.sock_recv_into` straight into the
destination, so neither side copies the bytes in Python. A stream that ends early (owner killed)
is an EOF and a `TransferError`; no destination with partial bytes is ever returned.

Fallback: a failed RDMA transfer is retried once over TCP on a fresh connection, into the same
destination (after the RDMA queue pair was moved to ERROR and drained, so no late DMA can land in
it); if that fails too, `TransferError`. After an RDMA failure the fetcher uses TCP to that owner
for `RDMA_BACKOFF_SECONDS`, so a broken RDMA path does not cost every fetch a timeout. A blob
outside the owner's registered arena, or a destination outside the fetcher's, goes by TCP.

Timeouts: connecting is bounded by `connect_timeout`; every later step by `io_timeout` without
progress (a pull resets it as bytes arrive, an RDMA read as READs complete).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

if TYPE_CHECKING:
    from .rdma import ArenaMR, RcQueuePair, RdmaDevice

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_FRAME = 16384
NONCE_BYTES = 32
MAX_KEY_CHARS = 128
SEND_CHUNK = 4 << 20  # the owner renews the lease after each chunk its socket accepts
POOL_PER_ADDR = 4  # idle connections a fetcher keeps per owner
POOL_IDLE_SECONDS = 60.0  # a pooled connection older than this is closed, not reused
SERVER_IDLE_SECONDS = 300.0  # the owner closes a connection idle this long without a lease
HANDSHAKE_SECONDS = 10.0  # the owner's bound on a peer's authentication
RDMA_BACKOFF_SECONDS = 30.0  # after an RDMA failure, fetch from that owner over TCP this long

_OWNER_LABEL = b"dsuf-kv/1 owner\0"
_FETCHER_LABEL = b"dsuf-kv/1 fetcher\0"
_LEN = struct.Struct(">I")


class TransferError(Exception):
    """A fetch failed (refused, auth, EOF, timeout, owner gone); the caller recomputes."""


class ExportRefused(TransferError):
    """The owner said no: stale epoch, unknown key, busy."""


class AuthFailed(TransferError):
    """Cluster secret mismatch, detected by either side."""


ExportLookup = Callable[[str, int], contextlib.AbstractContextManager[memoryview]]
"""Owner-side `lookup(key, epoch)`: a context manager that pins the blob while open and yields
its bytes; it raises `ExportRefused` itself for a stale epoch or an unknown key."""

# ---- messages -----------------------------------------------------------------------------------

_U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
_Mac = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
_Key = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY_CHARS, pattern="^[0-9a-fA-F]+$")]
_Blob = Annotated[bytes, msgspec.Meta(max_length=256)]
_Line = Annotated[str, msgspec.Meta(max_length=512)]


class Hello(msgspec.Struct, tag_field="t", tag="hello"):
    version: int
    nonce: _Nonce


class Challenge(msgspec.Struct, tag_field="t", tag="challenge"):
    version: int
    nonce: _Nonce
    proof: _Mac


class Proof(msgspec.Struct, tag_field="t", tag="proof"):
    proof: _Mac


class Acquire(msgspec.Struct, tag_field="t", tag="acquire"):
    key: _Key
    epoch: _U63
    offer: Annotated[list[Literal["tcp", "rdma"]], msgspec.Meta(max_length=4)]
    qp: _Blob | None = None


class Grant(msgspec.Struct, tag_field="t", tag="grant"):
    lease: _U63
    total_bytes: _U63
    path: Literal["tcp", "rdma"]
    lease_ms: _U63
    qp: _Blob | None = None
    desc: _Blob | None = None


class Refused(msgspec.Struct, tag_field="t", tag="refused"):
    kind: Literal["refused", "auth", "protocol"]
    reason: _Line


class Pull(msgspec.Struct, tag_field="t", tag="pull"):
    lease: _U63
    offset: _U63
    length: _U63


class Renew(msgspec.Struct, tag_field="t", tag="renew"):
    lease: _U63


class Release(msgspec.Struct, tag_field="t", tag="release"):
    lease: _U63


_encoder = msgspec.msgpack.Encoder()
_to_owner = msgspec.msgpack.Decoder(Hello | Proof | Acquire | Pull | Renew | Release | Refused)
_to_fetcher = msgspec.msgpack.Decoder(Challenge | Grant | Refused)


def _frame(msg: msgspec.Struct) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def _mac(secret: bytes, label: bytes, nonce_f: bytes, nonce_o: bytes) -> bytes:
    return hmac.new(secret, label + nonce_f + nonce_o, hashlib.sha256).digest()


def _one_line(text: object, limit: int = 200) -> str:
    """Text from the network or an exception, safe for a one-line message."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes | bytearray) or not secret:
        raise ValueError("the cluster secret must be non-empty bytes")
    return bytes(secret)


def _byte_view(buf: Any) -> memoryview:
    view = memoryview(buf)
    if not view.contiguous:
        raise ValueError("buffer is not contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def split_addr(addr: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(f"bad owner address {addr!r} (want host:port)")
    return host.strip("[]"), int(port)


class _ProtocolError(Exception):
    """The peer broke the protocol; end the connection (one log line)."""


class _Eof(Exception):
    """The peer closed the connection."""


class _Conn:
    """A non-blocking TCP socket with the frame codec, driven through the running loop's sock_*
    methods (uvloop or asyncio). Every read runs under a deadline set by the caller."""

    def __init__(self, sock: socket.socket, peer: str, decoder: msgspec.msgpack.Decoder) -> None:
        self.sock = sock
        self.peer = peer
        self.loop = asyncio.get_running_loop()
        self._decoder = decoder
        self._head = bytearray(4)
        self.closed = False

    async def send(self, *msgs: msgspec.Struct) -> None:
        await self.loop.sock_sendall(self.sock, b"".join(_frame(m) for m in msgs))

    async def recv_exact(self, view: memoryview) -> None:
        got, n = 0, len(view)
        while got < n:
            k = await self.loop.sock_recv_into(self.sock, view[got:])
            if not k:
                raise _Eof(f"{got} of {n} bytes")
            got += k

    async def recv_msg(self) -> Any:
        await self.recv_exact(memoryview(self._head))
        (n,) = _LEN.unpack(self._head)
        if not 0 < n <= MAX_FRAME:
            raise _ProtocolError(f"frame length {n} outside 1..{MAX_FRAME}")
        body = bytearray(n)
        await self.recv_exact(memoryview(body))
        try:
            return self._decoder.decode(body)
        except msgspec.DecodeError as e:  # includes ValidationError
            raise _ProtocolError(f"undecodable message: {_one_line(e, 120)}") from None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


# ---- owner --------------------------------------------------------------------------------------


class _Lease:
    __slots__ = ("id", "key", "epoch", "cm", "view", "deadline")

    def __init__(self, lease_id: int, key: str, epoch: int, cm: contextlib.AbstractContextManager[Any], view: memoryview, deadline: float) -> None:
        self.id, self.key, self.epoch, self.cm, self.view, self.deadline = lease_id, key, epoch, cm, view, deadline


class KvTransferServer:
    """The owner's end: serves `acquire`/`pull`/`release` for blobs that `lookup` pins.

    `arena` is the shared-memory arena that owned blobs live in; with it, and an RDMA device
    (`rdma` None = use one if present, False = never, True = required), the arena is registered
    once at `start` and blobs inside it are offered by RDMA READ. Every connection is its own task
    on the running loop; nothing blocks the loop (sends are `sock_sendall` from the blob's view)."""

    def __init__(
        self,
        lookup: ExportLookup,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        lease_seconds: float = 10.0,
        arena: memoryview | None = None,
        rdma: bool | None = None,
    ) -> None:
        self._secret = _check_secret(secret)
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        if rdma is True and arena is None:
            raise ValueError("rdma=True needs the arena to register")
        self._lookup = lookup
        self._host, self._port = host, port
        self.lease_seconds = float(lease_seconds)
        self._arena = arena
        self._rdma_mode = rdma
        self._listener: socket.socket | None = None
        self._address: str | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._device: RdmaDevice | None = None
        self._mr: ArenaMR | None = None
        self._next_lease = 0

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind, register the arena for RDMA if wanted and possible, and start accepting."""
        if self._accept_task is not None:
            raise RuntimeError("server already started")
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, sockaddr = infos[0]
        lsock = socket.socket(family, kind, proto)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind(sockaddr)
            lsock.listen(256)
            lsock.setblocking(False)
        except OSError:
            lsock.close()
            raise
        host, port = lsock.getsockname()[:2]
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._listener = lsock
        if self._rdma_mode is not False and self._arena is not None:
            await self._start_rdma()
        self._accept_task = asyncio.create_task(self._accept_loop(lsock), name=f"kv-transfer-accept {self._address}")

    async def _start_rdma(self) -> None:
        from . import rdma

        try:
            self._device = await asyncio.to_thread(rdma.RdmaDevice.shared)
            self._mr = await asyncio.to_thread(self._device.register, self._arena)
        except rdma.RdmaUnavailable as e:
            self._device = self._mr = None
            if self._rdma_mode:
                self._listener.close()  # type: ignore[union-attr]
                self._listener = None
                raise RuntimeError(f"RDMA required but unavailable: {e}") from None
            rdma.note_unavailable(str(e))

    async def stop(self) -> None:
        """Stop accepting, drop every connection (closing their leases), deregister the arena."""
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
            self._accept_task = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        tasks = list(self._conns)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._mr is not None:
            self._mr.release()
            self._mr = None

    @property
    def address(self) -> str:
        """"host:port" actually bound (valid after `start`)."""
        if self._address is None:
            raise RuntimeError("server not started")
        return self._address

    @property
    def transports(self) -> list[str]:
        return ["tcp", "rdma"] if self._mr is not None else ["tcp"]

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(lsock)
            except OSError as e:  # EMFILE and friends: wait a little instead of spinning
                log.warning("kv transfer: accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            task = asyncio.create_task(self._serve(sock, peer), name=f"kv-transfer {peer}")
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    # ---- one connection -------------------------------------------------------------------------
    async def _serve(self, sock: socket.socket, peer: str) -> None:
        conn = _Conn(sock, peer, _to_owner)
        state = _ConnState()
        try:
            async with asyncio.timeout(HANDSHAKE_SECONDS):
                if not await self._authenticate(conn):
                    return
            await self._requests(conn, state)
        except _ProtocolError as e:
            log.warning("kv transfer: %s: protocol error: %s; closing", peer, e)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await conn.send(Refused(kind="protocol", reason=_one_line(e)))
        except _Eof:
            log.debug("kv transfer: %s closed the connection", peer)
        except TimeoutError:
            log.info("kv transfer: %s did not complete authentication in %.0fs; closing", peer, HANDSHAKE_SECONDS)
        except OSError as e:
            log.info("kv transfer: %s: connection error: %s", peer, _one_line(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never let one connection take the server down
            log.error("kv transfer: %s: unexpected %s: %s; closing", peer, type(e).__name__, _one_line(e))
        finally:
            state.close(peer)
            conn.close()

    async def _authenticate(self, conn: _Conn) -> bool:
        hello = await conn.recv_msg()
        if not isinstance(hello, Hello):
            raise _ProtocolError(f"expected hello, got {type(hello).__name__.lower()}")
        if hello.version != PROTOCOL_VERSION:
            raise _ProtocolError(f"unsupported protocol version {hello.version} (this owner speaks {PROTOCOL_VERSION})")
        nonce_o = secrets.token_bytes(NONCE_BYTES)
        await conn.send(Challenge(version=PROTOCOL_VERSION, nonce=nonce_o, proof=_mac(self._secret, _OWNER_LABEL, hello.nonce, nonce_o)))
        proof = await conn.recv_msg()
        if isinstance(proof, Refused):
            log.warning("kv transfer: %s rejected this owner's proof (cluster secret mismatch?)", conn.peer)
            return False
        if not isinstance(proof, Proof):
            raise _ProtocolError(f"expected proof, got {type(proof).__name__.lower()}")
        if not hmac.compare_digest(proof.proof, _mac(self._secret, _FETCHER_LABEL, hello.nonce, nonce_o)):
            log.warning("kv transfer: %s failed authentication (cluster secret mismatch); closing", conn.peer)
            await conn.send(Refused(kind="auth", reason="authentication failed (cluster secret mismatch)"))
            return False
        return True

    async def _requests(self, conn: _Conn, state: _ConnState) -> None:
        loop = conn.loop
        while True:
            lease = state.lease
            deadline = lease.deadline if lease is not None else loop.time() + SERVER_IDLE_SECONDS
            try:
                async with asyncio.timeout_at(deadline):
                    msg = await conn.recv_msg()
            except TimeoutError:
                if lease is None:
                    log.debug("kv transfer: %s idle for %.0fs; closing", conn.peer, SERVER_IDLE_SECONDS)
                else:
                    self._expired(conn, lease)
                return
            if isinstance(msg, Acquire):
                if lease is not None:
                    raise _ProtocolError("acquire while a lease is open")
                await self._acquire(conn, state, msg)
                continue
            if isinstance(msg, Refused):
                log.info("kv transfer: %s gave up: %s", conn.peer, _one_line(msg.reason))
                return
            if not isinstance(msg, Pull | Renew | Release):
                raise _ProtocolError(f"unexpected {type(msg).__name__.lower()}")
            if lease is None or msg.lease != lease.id:
                raise _ProtocolError(f"{type(msg).__name__.lower()} of lease {msg.lease}, which is not open")
            if isinstance(msg, Release):
                state.end_lease(conn.peer)
            elif isinstance(msg, Renew):
                lease.deadline = loop.time() + self.lease_seconds
            elif not await self._send_range(conn, lease, msg.offset, msg.length):
                return

    async def _acquire(self, conn: _Conn, state: _ConnState, msg: Acquire) -> None:
        try:
            cm = self._lookup(msg.key, msg.epoch)
            blob = cm.__enter__()
        except ExportRefused as e:
            await conn.send(Refused(kind="refused", reason=_one_line(e) or "refused"))
            return
        except Exception as e:
            log.warning("kv transfer: lookup(%s, %d) failed: %s: %s", msg.key, msg.epoch, type(e).__name__, _one_line(e))
            await conn.send(Refused(kind="refused", reason=f"owner error ({type(e).__name__})"))
            return
        try:
            view = _byte_view(blob)
        except (TypeError, ValueError) as e:
            cm.__exit__(None, None, None)
            log.error("kv transfer: lookup(%s) yielded an unusable buffer: %s", msg.key, e)
            await conn.send(Refused(kind="refused", reason="owner error (unusable buffer)"))
            return
        self._next_lease += 1
        lease = _Lease(self._next_lease, msg.key, msg.epoch, cm, view, conn.loop.time() + self.lease_seconds)
        state.lease = lease
        qp_info, desc = self._rdma_grant(conn, state, msg, view)
        await conn.send(
            Grant(
                lease=lease.id,
                total_bytes=len(view),
                path="rdma" if desc is not None else "tcp",
                lease_ms=int(self.lease_seconds * 1000),
                qp=qp_info,
                desc=desc,
            )
        )

    def _rdma_grant(self, conn: _Conn, state: _ConnState, msg: Acquire, view: memoryview) -> tuple[bytes | None, bytes | None]:
        """(our QP info if we just connected one, descriptor if this blob goes by RDMA)."""
        if self._mr is None or self._device is None or "rdma" not in msg.offer:
            return None, None
        from . import rdma

        qp_info = None
        if state.qp is None and msg.qp is not None and not state.rdma_failed:
            try:
                remote = rdma.QpInfo.decode(msg.qp)
            except ValueError as e:
                raise _ProtocolError(f"bad QP info: {e}") from None
            try:
                qp = self._device.create_qp(responder=True)
                try:
                    qp.connect(remote)
                except BaseException:
                    qp.close()
                    raise
            except rdma.RdmaError as e:
                log.warning("kv transfer: %s: RDMA connect failed (%s); serving it over TCP", conn.peer, e)
                state.rdma_failed = True
                return None, None
            state.qp = qp
            qp_info = qp.info.encode()
        if state.qp is None or not len(view):
            return qp_info, None
        desc = self._mr.describe(view)
        return qp_info, desc.encode() if desc is not None else None

    async def _send_range(self, conn: _Conn, lease: _Lease, offset: int, length: int) -> bool:
        """Stream blob[offset:offset+length]; False if the lease expired meanwhile."""
        if offset + length > len(lease.view):
            raise _ProtocolError(f"pull of [{offset}, {offset + length}) beyond the {len(lease.view)}-byte blob")
        loop = conn.loop
        lease.deadline = loop.time() + self.lease_seconds
        end = offset + length
        while offset < end:
            n = min(SEND_CHUNK, end - offset)
            try:
                async with asyncio.timeout_at(lease.deadline):
                    await loop.sock_sendall(conn.sock, lease.view[offset : offset + n])
            except TimeoutError:
                self._expired(conn, lease)
                return False
            offset += n
            lease.deadline = loop.time() + self.lease_seconds
        return True

    def _expired(self, conn: _Conn, lease: _Lease) -> None:
        log.warning(
            "kv transfer: lease on %s@%d for %s expired (no progress for %.3gs); dropping the connection",
            lease.key, lease.epoch, conn.peer, self.lease_seconds,
        )  # fmt: skip


class _ConnState:
    """What one owner-side connection holds: at most one lease and its RDMA queue pair."""

    def __init__(self) -> None:
        self.lease: _Lease | None = None
        self.qp: RcQueuePair | None = None
        self.rdma_failed = False

    def end_lease(self, peer: str) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.view = memoryview(b"")  # drop our reference before the owner may reuse the bytes
            try:
                lease.cm.__exit__(None, None, None)
            except Exception as e:
                log.error("kv transfer: %s: closing the lease on %s raised %s: %s", peer, lease.key, type(e).__name__, _one_line(e))

    def close(self, peer: str) -> None:
        # The QP goes first: once the lease ends the owner may reuse the bytes, and a late READ
        # from this peer must then fail instead of reading them.
        if self.qp is not None:
            self.qp.close()
            self.qp = None
        self.end_lease(peer)


# ---- fetcher ------------------------------------------------------------------------------------


_EMPTY = memoryview(b"")


class _InStep(Exception):
    """A fetch failed but the connection is still in step with the owner (no lease open)."""

    def __init__(self, chan: _Channel, error: TransferError) -> None:
        super().__init__(str(error))
        self.chan, self.error = chan, error


class _Channel:
    """One authenticated control connection from a fetcher to an owner, maybe with an RDMA QP."""

    def __init__(self, conn: _Conn, addr: str, qp: RcQueuePair | None, wants_rdma: bool) -> None:
        self.conn = conn
        self.addr = addr
        self.qp = qp  # our QP; offered (its info sent) until the owner connects its side
        self.wants_rdma = wants_rdma  # made for RDMA (False: a TCP-only connection)
        self.qp_ready = False
        self.pending = b""  # our proof, sent with the first acquire (saves a round trip)
        self.idle_since = 0.0
        self.dst = _EMPTY  # the destination of the fetch in progress

    def usable(self) -> bool:
        """Whether a pooled connection still looks alive: the owner never speaks unasked, so
        readable bytes or EOF mean it closed (restart, idle timeout)."""
        if self.conn.closed or time.monotonic() - self.idle_since > POOL_IDLE_SECONDS:
            return False
        try:
            self.conn.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False

    def close(self) -> None:
        if self.qp is not None:
            self.qp.close()
            self.qp = None
        self.conn.close()


class KvFetcher:
    """The fetcher's end: `fetch` pulls one blob from its owner into a buffer from `alloc`.

    Connections are pooled per owner address (a few idle ones each, dropped after a minute) and
    carry their RDMA queue pair when RDMA is in use. With `rdma` None RDMA is used when a device
    is present and `arena` (the buffer `alloc` hands out views of) is given; False forces TCP;
    True requires RDMA (a fetch without it raises TransferError)."""

    def __init__(
        self,
        secret: bytes,
        *,
        connect_timeout: float = 1.0,
        io_timeout: float = 2.0,
        rdma: bool | None = None,
        arena: memoryview | None = None,
    ) -> None:
        self._secret = _check_secret(secret)
        if connect_timeout <= 0 or io_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if rdma is True and arena is None:
            raise ValueError("rdma=True needs the arena that destinations are allocated in")
        self.connect_timeout = float(connect_timeout)
        self.io_timeout = float(io_timeout)
        self._rdma_mode = rdma
        self._arena = arena
        self._rdma_state: Literal["unknown", "on", "off"] = "off" if rdma is False or arena is None else "unknown"
        self._rdma_lock: asyncio.Lock | None = None
        self._device: RdmaDevice | None = None
        self._mr: ArenaMR | None = None
        self._pool: dict[str, list[_Channel]] = {}
        self._rdma_backoff: dict[str, float] = {}  # owner -> monotonic time until which we use TCP
        self._inflight = 0
        self._closed = False

    @property
    def transports(self) -> list[str]:
        """What this fetcher can use now (RDMA is probed at the first fetch)."""
        return ["tcp", "rdma"] if self._rdma_state == "on" else ["tcp"]

    async def close(self) -> None:
        """Close pooled connections and deregister the arena (once in-flight fetches, which
        finish alone, are done). Later fetches raise TransferError."""
        self._closed = True
        for chans in self._pool.values():
            for chan in chans:
                chan.close()
        self._pool.clear()
        self._release_arena()

    def _release_arena(self) -> None:
        if self._closed and not self._inflight and self._mr is not None:
            self._mr.release()
            self._mr = None
            self._rdma_state = "off"

    async def fetch(self, addr: str, key: str, epoch: int, alloc: Callable[[int], memoryview]) -> memoryview:
        """Pull blob `key` at `epoch` from the owner at `addr` into `alloc(size)` and return it.

        Raises TransferError (ExportRefused, AuthFailed) on anything; `alloc`'s own TransferError
        propagates. A destination is returned only when every byte arrived."""
        if self._closed:
            raise TransferError("fetcher is closed")
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            raise TransferError(f"bad key {key!r}")
        if not isinstance(epoch, int) or not 0 <= epoch < 2**63:
            raise TransferError(f"bad epoch {epoch!r}")
        self._inflight += 1
        try:
            return await self._fetch(addr, key, epoch, alloc)
        finally:
            self._inflight -= 1
            self._release_arena()

    async def _fetch(self, addr: str, key: str, epoch: int, alloc: Callable[[int], memoryview]) -> memoryview:
        use_rdma = await self._rdma_ready() and self._rdma_backoff.get(addr, 0.0) <= time.monotonic()
        chan: _Channel | None = await self._checkout(addr, use_rdma)
        try:
            grant = await self._start(chan, key, epoch, alloc)
            dst = chan.dst
            if grant.path == "rdma" and chan.qp_ready and len(dst):
                local = self._mr.local_addr(dst) if self._mr is not None else None
                if local is not None:
                    from .rdma import RdmaError

                    try:
                        await self._read_rdma(chan, grant, dst, local)
                    except RdmaError as e:
                        chan.close()
                        chan = None
                        self._rdma_backoff[addr] = time.monotonic() + RDMA_BACKOFF_SECONDS
                        log.info(
                            "kv transfer: RDMA fetch of %s from %s failed (%s); retrying once over TCP, "
                            "and using TCP to that owner for %.0fs", key, addr, e, RDMA_BACKOFF_SECONDS,
                        )  # fmt: skip
                        await self._retry_tcp(addr, key, epoch, dst)
                        return dst
                else:
                    await self._pull(chan, grant, dst)
            elif len(dst):
                await self._pull(chan, grant, dst)
            await self._finish(chan, grant)
            chan = None
            return dst
        except _InStep as e:  # refused, or alloc said no: the connection is still usable
            self._checkin(e.chan)
            chan = None
            raise e.error from None
        except TransferError:
            raise
        except (TimeoutError, OSError, _Eof, _ProtocolError) as e:
            raise self._wrap(addr, e) from None
        finally:
            if chan is not None:
                chan.close()

    # ---- steps ----------------------------------------------------------------------------------
    def _wrap(self, addr: str, e: BaseException) -> TransferError:
        if isinstance(e, TimeoutError):
            return TransferError(f"owner {addr} made no progress within {self.io_timeout:g}s")
        if isinstance(e, _Eof):
            return TransferError(f"owner {addr} closed the connection ({e})")
        if isinstance(e, _ProtocolError):
            return TransferError(f"owner {addr} broke the protocol: {e}")
        return TransferError(f"connection to owner {addr} failed: {_one_line(e)}")

    async def _io(self, aw: Awaitable[Any]) -> Any:
        async with asyncio.timeout(self.io_timeout):
            return await aw

    async def _checkout(self, addr: str, use_rdma: bool) -> _Channel:
        pool = self._pool.get(addr)
        while pool:
            chan = pool.pop()
            if chan.usable() and (chan.wants_rdma or not use_rdma):
                return chan
            chan.close()  # dead, or TCP-only while we want RDMA again
        return await self._connect(addr, use_rdma)

    def _checkin(self, chan: _Channel) -> None:
        pool = self._pool.setdefault(chan.addr, [])
        if self._closed or len(pool) >= POOL_PER_ADDR:
            chan.close()
            return
        chan.idle_since = time.monotonic()
        pool.append(chan)

    async def _connect(self, addr: str, use_rdma: bool) -> _Channel:
        host, port = split_addr(addr)
        loop = asyncio.get_running_loop()
        sock = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                family, kind, proto, _, sockaddr = infos[0]
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                await loop.sock_connect(sock, sockaddr)
        except TimeoutError:
            if sock is not None:
                sock.close()
            raise TransferError(f"could not connect to owner {addr} within {self.connect_timeout:g}s") from None
        except OSError as e:
            if sock is not None:
                sock.close()
            raise TransferError(f"could not connect to owner {addr}: {_one_line(e)}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, addr, _to_fetcher)
        qp = None
        try:
            nonce_f = secrets.token_bytes(NONCE_BYTES)
            await self._io(conn.send(Hello(version=PROTOCOL_VERSION, nonce=nonce_f)))
            msg = await self._io(conn.recv_msg())
            if isinstance(msg, Refused):
                raise self._refusal(addr, msg)
            if not isinstance(msg, Challenge) or msg.version != PROTOCOL_VERSION:
                raise TransferError(f"owner {addr} answered hello with an unexpected message")
            if not hmac.compare_digest(msg.proof, _mac(self._secret, _OWNER_LABEL, nonce_f, msg.nonce)):
                with contextlib.suppress(Exception):
                    await self._io(conn.send(Refused(kind="auth", reason="owner proof did not verify")))
                raise AuthFailed(f"owner {addr} failed authentication (cluster secret mismatch)")
            if use_rdma and self._device is not None:
                from .rdma import RdmaError

                try:
                    qp = self._device.create_qp(responder=False)
                except RdmaError as e:
                    log.info("kv transfer: could not create an RDMA queue pair (%s); using TCP to %s", e, addr)
            chan = _Channel(conn, addr, qp, use_rdma)
            chan.pending = _frame(Proof(proof=_mac(self._secret, _FETCHER_LABEL, nonce_f, msg.nonce)))
            return chan
        except BaseException as e:
            if qp is not None:
                qp.close()
            conn.close()
            if isinstance(e, TimeoutError | OSError | _Eof | _ProtocolError):
                raise self._wrap(addr, e) from None
            raise

    def _refusal(self, addr: str, msg: Refused) -> TransferError:
        reason = _one_line(msg.reason)
        if msg.kind == "auth":
            return AuthFailed(f"owner {addr} refused authentication: {reason}")
        if msg.kind == "refused":
            return ExportRefused(f"owner {addr} refused: {reason}")
        return TransferError(f"owner {addr} reported a protocol error: {reason}")

    async def _acquire(self, chan: _Channel, key: str, epoch: int, *, tcp_only: bool = False) -> Grant:
        offer: list[Literal["tcp", "rdma"]] = ["tcp"] if tcp_only or chan.qp is None else ["tcp", "rdma"]
        qp_info = chan.qp.info.encode() if "rdma" in offer and not chan.qp_ready else None  # type: ignore[union-attr]
        frame = chan.pending + _frame(Acquire(key=key, epoch=epoch, offer=offer, qp=qp_info))
        chan.pending = b""
        await self._io(chan.conn.loop.sock_sendall(chan.conn.sock, frame))
        msg = await self._io(chan.conn.recv_msg())
        if isinstance(msg, Refused):
            if msg.kind == "refused":  # the connection stays in step: keep it for the next fetch
                raise _InStep(chan, self._refusal(chan.addr, msg))
            raise self._refusal(chan.addr, msg)
        if not isinstance(msg, Grant):
            raise TransferError(f"owner {chan.addr} answered acquire with an unexpected message")
        if qp_info is not None:
            self._connect_qp(chan, msg)
        if msg.path == "rdma" and (msg.desc is None or not chan.qp_ready):
            raise TransferError(f"owner {chan.addr} granted RDMA without a usable descriptor")
        return msg

    def _connect_qp(self, chan: _Channel, grant: Grant) -> None:
        """Bring our QP up against the owner's, or give RDMA up on this connection."""
        from .rdma import QpInfo, RdmaError

        if grant.qp is None:  # the owner will not do RDMA with us on this connection
            chan.qp.close()  # type: ignore[union-attr]
            chan.qp = None
            return
        try:
            chan.qp.connect(QpInfo.decode(grant.qp))  # type: ignore[union-attr]
            chan.qp_ready = True
        except (RdmaError, ValueError) as e:
            log.info("kv transfer: RDMA connect to %s failed (%s); using TCP on this connection", chan.addr, e)
            chan.qp.close()  # type: ignore[union-attr]
            chan.qp = None
            if grant.path == "rdma":  # pull the granted blob over TCP instead
                grant.path = "tcp"

    async def _start(self, chan: _Channel, key: str, epoch: int, alloc: Callable[[int], memoryview], *, tcp_only: bool = False) -> Grant:
        """Acquire and allocate; the destination is left in `chan.dst`."""
        grant = await self._acquire(chan, key, epoch, tcp_only=tcp_only)
        size = grant.total_bytes
        try:
            dst = alloc(size)
        except TransferError as e:
            await self._io(chan.conn.send(Release(lease=grant.lease)))
            raise _InStep(chan, e) from None
        try:
            view = _byte_view(dst)
        except (TypeError, ValueError) as e:
            raise TransferError(f"alloc returned an unusable buffer: {e}") from None
        if len(view) != size or view.readonly:
            raise TransferError(f"alloc({size}) returned {len(view)} {'read-only ' if view.readonly else ''}bytes")
        chan.dst = view
        return grant

    async def _finish(self, chan: _Channel, grant: Grant) -> None:
        """Release the lease and pool the connection."""
        chan.dst = _EMPTY
        await self._io(chan.conn.send(Release(lease=grant.lease)))
        self._checkin(chan)

    async def _pull(self, chan: _Channel, grant: Grant, dst: memoryview) -> None:
        """Receive the whole blob straight into dst; TimeoutError after io_timeout without bytes."""
        conn = chan.conn
        await self._io(conn.send(Pull(lease=grant.lease, offset=0, length=len(dst))))
        loop, sock, n, got = conn.loop, conn.sock, len(dst), 0
        timeout = self.io_timeout
        async with asyncio.timeout(timeout) as deadline:
            armed = loop.time()
            while got < n:
                k = await loop.sock_recv_into(sock, dst[got:])
                if not k:
                    raise _Eof(f"after {got} of {n} bytes")
                got += k
                now = loop.time()
                if now - armed > timeout / 8:  # push the deadline out without a timer per recv
                    deadline.reschedule(now + timeout)
                    armed = now

    async def _read_rdma(self, chan: _Channel, grant: Grant, dst: memoryview, local: int) -> None:
        from .rdma import RdmaDescriptor, RdmaError

        try:
            desc = RdmaDescriptor.decode(grant.desc)  # type: ignore[arg-type]
        except ValueError as e:
            raise RdmaError(f"bad descriptor: {e}") from None
        if desc.length != len(dst):
            raise RdmaError(f"descriptor covers {desc.length} bytes, grant says {len(dst)}")
        lease = grant.lease

        async def renew() -> None:
            await self._io(chan.conn.send(Renew(lease=lease)))

        await chan.qp.read_into(  # type: ignore[union-attr]
            desc, local, self._mr.lkey, io_timeout=self.io_timeout, renew=renew, renew_every=grant.lease_ms / 2000  # type: ignore[union-attr]
        )

    async def _retry_tcp(self, addr: str, key: str, epoch: int, dst: memoryview) -> None:
        """The one TCP retry after a failed RDMA read: a fresh connection, the same destination."""
        chan: _Channel | None = await self._connect(addr, use_rdma=False)
        try:
            grant = await self._acquire(chan, key, epoch, tcp_only=True)
            if grant.total_bytes != len(dst):
                raise TransferError(f"owner {addr} now has {grant.total_bytes} bytes for {key}, not {len(dst)}")
            if len(dst):
                await self._pull(chan, grant, dst)
            await self._finish(chan, grant)
            chan = None
        except _InStep as e:
            self._checkin(e.chan)
            chan = None
            raise e.error from None
        except (TimeoutError, OSError, _Eof, _ProtocolError) as e:
            raise self._wrap(addr, e) from None
        finally:
            if chan is not None:
                chan.close()

    async def _rdma_ready(self) -> bool:
        """Probe the device and register our arena once (off the loop); False means TCP."""
        if self._rdma_state != "unknown":
            if self._rdma_mode is True and self._rdma_state == "off" and not self._closed:
                raise TransferError("RDMA required but unavailable (see the log)")
            return self._rdma_state == "on"
        if self._rdma_lock is None:
            self._rdma_lock = asyncio.Lock()
        async with self._rdma_lock:
            if self._rdma_state == "unknown":
                from . import rdma

                try:
                    self._device = await asyncio.to_thread(rdma.RdmaDevice.shared)
                    self._mr = await asyncio.to_thread(self._device.register, self._arena)
                    self._rdma_state = "on"
                except rdma.RdmaUnavailable as e:
                    self._rdma_state = "off"
                    if self._rdma_mode is True:
                        log.error("kv transfer: RDMA required but unavailable: %s", e)
                    else:
                        rdma.note_unavailable(str(e))
        return await self._rdma_ready()
