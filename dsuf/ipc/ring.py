"""Front end <-> worker transport: an SPSC byte ring in POSIX shared memory plus an eventfd doorbell.

Messages are msgspec-msgpack encoded (never pickled). The consumer never polls: a worker blocks
in `poll()` on the doorbell, and the asyncio front end registers the doorbell fd with
`loop.add_reader`. The only timed sleep is a producer backing off while the ring is full.

Segment layout (all counters native 8-byte unsigned, i.e. little-endian on the platforms we run on):

    offset   0  magic, capacity          (written once at creation)
    offset  64  head: total bytes ever written   (producer's cache line)
    offset 128  tail: total bytes ever read      (consumer's cache line)
    offset 192  data area, `capacity` bytes, capacity a power of two

A record is a 4-byte little-endian payload length followed by the payload; both may wrap around
the end of the data area. Byte offset of counter value c in the data area is c & (capacity - 1);
the counters themselves never wrap in practice (2**64 bytes).

Ordering: the producer copies the record, then publishes the new head; the consumer copies the
record out, then publishes the new tail. Counters are written/read through a memoryview cast to
'Q', which CPython does with a single aligned 8-byte memcpy (no torn values, unlike
struct.pack_into('<Q'), which stores byte by byte). Store->store and load->load order is kept by
x86 (TSO); this is what makes a published head imply a visible payload.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import select
import sys
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import msgspec

__all__ = ["Channel", "Doorbell", "MessageTooLarge", "Ring", "RingFull"]

if sys.byteorder != "little":  # the layout promises little-endian counters and lengths
    raise ImportError("dsuf.ipc.ring supports little-endian hosts only")

_MAGIC = int.from_bytes(b"DSUFRNG1", "little")
_LINE = 64  # cache line
_HEADER = 3 * _LINE
_Q_MAGIC, _Q_CAPACITY, _Q_HEAD, _Q_TAIL = 0, 1, _LINE // 8, 2 * _LINE // 8
_LEN = 4  # bytes of the length prefix
_MAX_LEN = (1 << 32) - 1

SEND_TIMEOUT = 10.0  # Channel.send gives up on a full ring after this many seconds
SEND_BACKOFF = 0.0005  # and retries every 0.5 ms until then


class RingFull(Exception):
    """The message does not fit right now; it will once the consumer reads enough."""


class MessageTooLarge(ValueError):
    """The message can never fit this ring (payload > capacity - 4), so waiting would not help."""


class Doorbell:
    """An eventfd used to wake the consumer; the producer rings it after each put.

    The counter is level-triggered (readable while nonzero), so rings that happen while nobody
    waits are not lost, and many rings collapse into one wakeup. The descriptor is non-blocking
    and close-on-exec; hand it to a child with subprocess's `pass_fds`, which makes it
    inheritable in that child only."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @staticmethod
    def create() -> Doorbell:
        """A fresh, unrung doorbell."""
        return Doorbell(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))

    @property
    def fd(self) -> int:
        """The eventfd number: pass it to a child (pass_fds) and to Doorbell.from_fd there."""
        return self._fd

    @staticmethod
    def from_fd(fd: int) -> Doorbell:
        """Wrap an inherited eventfd (takes ownership: close() closes it)."""
        os.set_blocking(fd, False)
        return Doorbell(fd)

    def ring(self) -> None:
        """Wake the consumer (add 1 to the counter)."""
        try:
            os.eventfd_write(self._fd, 1)
        except BlockingIOError:  # counter saturated: it is already rung
            pass

    def clear(self) -> None:
        """Reset the counter to zero without blocking."""
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:  # not rung
            pass

    def wait(self, timeout: float | None) -> bool:
        """Sleep in poll() until rung or `timeout` seconds pass (None: forever); clears the bell.

        Returns whether it was rung. A ring that happened before the call counts."""
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        if timeout is None:
            ready = poller.poll()
        else:
            ready = poller.poll(max(0, int(timeout * 1000 + 0.999)))  # ceil, never spin early
        if not ready:
            return False
        self.clear()
        return True

    def close(self) -> None:
        """Close this process's descriptor (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _AttachedSegment:
    """An untracked mapping of an existing segment, as SharedMemory(name, track=False) gives on
    Python >= 3.13. Before 3.13 attaching through SharedMemory registers the segment with this
    process's resource tracker, which unlinks it (under the owner's feet) when this process exits."""

    def __init__(self, name: str) -> None:
        import _posixshmem

        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


def attach_segment(name: str) -> Any:
    """Map another process's shared-memory segment without adopting it (the creator unlinks it).
    The result has `.name`, `.buf` and `.close()`."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    return _AttachedSegment(name)


class Ring:
    """SPSC ring of length-prefixed records in shared memory.

    Exactly one process puts and exactly one gets; no locks are needed because each side writes
    only its own counter. The creating process owns the segment and unlinks it."""

    name: str
    capacity: int

    def __init__(self, shm: Any, owner: bool) -> None:
        self._shm = shm
        self._owner = owner
        self.name = shm.name
        self._hdr = shm.buf[:_HEADER].cast("Q")
        if self._hdr[_Q_MAGIC] != _MAGIC:
            self._release()
            raise ValueError(f"shared memory segment {self.name!r} is not a dsuf ring")
        self.capacity = self._hdr[_Q_CAPACITY]
        self._mask = self.capacity - 1
        self._data = shm.buf[_HEADER : _HEADER + self.capacity]
        if len(self._data) != self.capacity:
            self._release()
            raise ValueError(f"ring {self.name!r} is truncated")

    @staticmethod
    def create(capacity: int = 8 << 20) -> Ring:
        """Create a new segment (auto-named) with a data area of `capacity` bytes, a power of two."""
        if capacity < 16 or capacity & (capacity - 1):
            raise ValueError(f"ring capacity must be a power of two >= 16, got {capacity}")
        shm = shared_memory.SharedMemory(create=True, size=_HEADER + capacity)
        hdr = shm.buf[:_HEADER].cast("Q")
        hdr[_Q_HEAD] = hdr[_Q_TAIL] = 0
        hdr[_Q_CAPACITY] = capacity
        hdr[_Q_MAGIC] = _MAGIC  # last: an attacher that sees the magic sees a complete header
        hdr.release()
        return Ring(shm, owner=True)

    @staticmethod
    def attach(name: str) -> Ring:
        """Map the ring another process created (FileNotFoundError once it has been unlinked)."""
        return Ring(attach_segment(name), owner=False)

    def try_put(self, payload: bytes) -> None:
        """Append one record, or raise RingFull / MessageTooLarge without writing anything."""
        n = len(payload)
        need = _LEN + n
        if need > self.capacity or n > _MAX_LEN:
            raise MessageTooLarge(f"{n}-byte message cannot fit a {self.capacity}-byte ring")
        hdr = self._hdr
        head = hdr[_Q_HEAD]
        if head - hdr[_Q_TAIL] + need > self.capacity:
            raise RingFull
        self._write(head, n.to_bytes(_LEN, "little"))
        self._write(head + _LEN, payload)
        hdr[_Q_HEAD] = head + need  # publish after the bytes are in place

    def get(self) -> bytes | None:
        """Remove and return the oldest record, or None if the ring is empty."""
        hdr = self._hdr
        tail = hdr[_Q_TAIL]
        used = hdr[_Q_HEAD] - tail
        if used == 0:
            return None
        n = int.from_bytes(self._read(tail, _LEN), "little")
        if not _LEN + n <= used <= self.capacity:
            raise RuntimeError(f"ring {self.name!r} is corrupt (record {n}, used {used})")
        payload = self._read(tail + _LEN, n)
        hdr[_Q_TAIL] = tail + _LEN + n  # publish after the bytes are copied out
        return payload

    def _write(self, pos: int, src: bytes) -> None:
        n = len(src)
        off = pos & self._mask
        first = self.capacity - off
        if n <= first:
            self._data[off : off + n] = src
        else:  # wraps: copy in two parts, the rest to the start of the data area
            view = memoryview(src)
            self._data[off:] = view[:first]
            self._data[: n - first] = view[first:]

    def _read(self, pos: int, n: int) -> bytes:
        off = pos & self._mask
        if off + n <= self.capacity:
            return bytes(self._data[off : off + n])
        return bytes(self._data[off:]) + bytes(self._data[: off + n - self.capacity])

    def _release(self) -> None:
        for view in ("_hdr", "_data"):  # our views must go before the mapping can close
            v = self.__dict__.pop(view, None)
            if v is not None:
                v.release()
        self._shm.close()  # idempotent for both segment kinds

    def close(self) -> None:
        """Unmap the segment from this process (idempotent); the segment itself lives on."""
        self._release()

    def unlink(self) -> None:
        """Remove the segment's name (owner only); existing mappings stay valid until closed."""
        if not self._owner:
            raise RuntimeError("only the process that created a ring unlinks it")
        self._shm.unlink()

    def __del__(self) -> None:
        try:
            self._release()
        except Exception:
            pass


class Channel:
    """One direction: a Ring plus a Doorbell plus msgspec encode/decode of a message type.

    The sender puts then rings; the receiver clears the bell before reading the ring until empty,
    so a message published after the last read always leaves the bell rung (no lost wakeup)."""

    def __init__(self, ring: Ring, bell: Doorbell, msg_type: Any) -> None:
        self.ring = ring
        self.bell = bell
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(msg_type)

    def send(self, msg: Any, *, timeout: float = SEND_TIMEOUT) -> None:
        """Encode and put `msg`, then ring. While the ring is full, retry every 0.5 ms; after
        `timeout` seconds raise RingFull (the consumer is stuck or gone). MessageTooLarge is raised
        at once. Blocks the caller, so the asyncio front end uses it for small messages only."""
        payload = self._encoder.encode(msg)
        deadline = None
        while True:
            try:
                self.ring.try_put(payload)
                break
            except RingFull:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + timeout
                elif now >= deadline:
                    raise RingFull(f"ring {self.ring.name!r} stayed full for {timeout} s") from None
                time.sleep(SEND_BACKOFF)
        self.bell.ring()

    def recv_nowait(self) -> Any | None:
        """Decode and return the next message, or None if none is waiting."""
        payload = self.ring.get()
        return None if payload is None else self._decoder.decode(payload)

    def recv(self, timeout: float | None) -> Any | None:
        """Next message, sleeping on the doorbell while the ring is empty (for worker processes).

        Returns None if nothing arrives within `timeout` seconds (None: wait forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = self.recv_nowait()
            if msg is not None:
                return msg
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            # Stale rings (for messages already read) only cost one extra empty check; a ring for
            # a message put after our empty check is still pending, so wait() returns at once.
            self.bell.wait(remaining)

    def drain(self) -> list[Any]:
        """Every message available now. Clears the bell first, then reads until empty: anything put
        after the final empty read rings the bell again. Terminates because a producer that outruns
        us fills the ring and then has to wait."""
        self.bell.clear()
        out = []
        get, decode = self.ring.get, self._decoder.decode
        while (payload := get()) is not None:
            out.append(decode(payload))
        return out

    def attach_to_loop(self, loop: asyncio.AbstractEventLoop, on_messages: Callable[[list[Any]], None]) -> None:
        """Deliver messages on `loop`: when the doorbell fd becomes readable, call
        on_messages(self.drain()) (skipped when a stale ring finds nothing). No polling."""

        def on_readable() -> None:
            msgs = self.drain()
            if msgs:
                on_messages(msgs)

        loop.add_reader(self.bell.fd, on_readable)

    def detach_from_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop watching the doorbell on `loop`."""
        loop.remove_reader(self.bell.fd)

    def close(self) -> None:
        """Unmap the ring and close the doorbell in this process (does not unlink)."""
        self.ring.close()
        self.bell.close()
