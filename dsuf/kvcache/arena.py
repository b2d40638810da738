"""The host arena: one block of memory that holds every snapshot of a server, and its allocator.

One arena per server, sized by `--kv-host-bytes`. The front end owns it and allocates in it; the
worker maps the same POSIX shared-memory segment by name and writes a finished snapshot straight
into the region the front end reserved for it, or reads one from there to restore a sequence,
so a snapshot crosses the process boundary without passing through the rings or the event loop.
A transport registers the whole arena once (RDMA memory registration is per region and costly,
kv_sharing.md §3.2) and sends or receives straight from and into it.

Allocation is first fit over a free list kept sorted by offset, coalescing neighbours on free:
snapshots are few (thousands) and large, so a list walk costs nothing next to copying them.
"""

from __future__ import annotations

import bisect
import mmap
import os
import secrets
from typing import Any

from dsuf.ipc.ring import attach_segment


class Arena:
    """`size` bytes of host memory with an offset allocator.

    `Arena.shared(size)` creates a named shared-memory segment (the front end's); `Arena.attach(name)`
    maps it in another process (the worker's, which only reads and writes regions, never allocates);
    `Arena.private(size)` is anonymous memory for a store no other process touches."""

    def __init__(self, buf: memoryview, size: int, *, align: int, shm: Any = None, owner: bool = False) -> None:
        if align < 1 or align & (align - 1):
            raise ValueError("align must be a power of two")
        self.size = size
        self.align = align
        self.view = buf[:size]
        self._shm, self._owner = shm, owner
        self.name: str | None = shm.name if shm is not None else None  # what another process attaches by
        self._free: list[tuple[int, int]] = [(0, size)] if size else []  # (offset, length), sorted
        self._used: dict[int, int] = {}  # offset -> allocated length

    @classmethod
    def shared(cls, size: int, *, align: int = 64) -> Arena:
        if size <= 0:
            raise ValueError("arena size must be positive")
        shm = _Segment.create(size)
        return cls(shm.buf, size, align=align, shm=shm, owner=True)

    @staticmethod
    def remove_orphans(shm_dir: str = "/dev/shm") -> list[str]:
        """Unlink the arenas of processes that died without unlinking theirs (SIGKILL, OOM):
        each would otherwise pin its written pages of /dev/shm until reboot. An arena's name
        carries its creator's pid; one whose pid is alive is left alone (servers sharing one
        /dev/shm must share a PID namespace too, as they do on one host or in one pod)."""
        removed = []
        for entry in os.scandir(shm_dir):
            parts = entry.name.split("_")
            if len(parts) != 4 or parts[:2] != ["dsuf", "arena"] or not parts[2].isdigit():
                continue
            try:
                os.kill(int(parts[2]), 0)
                continue  # alive (or another user's process with that pid)
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            try:
                os.unlink(entry.path)
                removed.append(entry.name)
            except OSError:
                pass
        return removed

    @classmethod
    def attach(cls, name: str) -> Arena:
        """Map another process's arena (for reading and writing regions it hands out)."""
        shm = attach_segment(name)
        return cls(shm.buf, len(shm.buf), align=1, shm=shm)

    @classmethod
    def private(cls, size: int, *, align: int = 1) -> Arena:
        if size <= 0:
            raise ValueError("arena size must be positive")
        return cls(memoryview(mmap.mmap(-1, size)), size, align=align)  # pages are touched lazily

    @property
    def bytes_allocated(self) -> int:
        return sum(self._used.values())

    def alloc(self, n: int) -> int | None:
        """Offset of a fresh region of `n` bytes (n ≥ 0), or None when no free run is long enough."""
        if n < 0:
            raise ValueError("allocation size must be >= 0")
        need = max(self.align, -(-n // self.align) * self.align)  # a 0-byte blob still gets its own offset
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                self._used[off] = need
                return off
        return None

    def free(self, offset: int) -> None:
        length = self._used.pop(offset)  # KeyError: not allocated (a double free is a bug)
        i = bisect.bisect(self._free, (offset, 0))
        if i < len(self._free) and offset + length == self._free[i][0]:  # merge with the next run
            length += self._free.pop(i)[1]
        if i and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and with the previous one
            offset, length = self._free[i - 1][0], self._free[i - 1][1] + length
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (offset, length))

    def region(self, offset: int, n: int) -> memoryview:
        if offset < 0 or n < 0 or offset + n > self.size:
            raise ValueError(f"region [{offset}, {offset + n}) is outside the {self.size}-byte arena")
        return self.view[offset : offset + n]

    def close(self) -> None:
        """Unlink the arena's name (creator) and unmap it once no view of it is left."""
        self.view.release()
        if self._shm is not None:
            if self._owner:
                self._shm.unlink()
            try:
                self._shm.close()
            except BufferError:  # a region is still referenced; the mapping goes with the process
                pass
            self._shm = None


class _Segment:
    """A new POSIX shared-memory segment, mapped. Unlike multiprocessing's SharedMemory it has no
    finaliser that complains when regions of it are still referenced at interpreter exit."""

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name, self._mmap = name, mm
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, size: int) -> _Segment:
        import _posixshmem

        while True:
            name = f"dsuf_arena_{os.getpid()}_{secrets.token_hex(4)}"
            try:
                fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
                break
            except FileExistsError:
                continue
        try:
            os.ftruncate(fd, size)
            return cls(name, mmap.mmap(fd, size))
        finally:
            os.close(fd)

    def unlink(self) -> None:
        import _posixshmem

        _posixshmem.shm_unlink("/" + self.name)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()

