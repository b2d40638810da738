"""The host arena: an offset allocator over one block of (shared) memory."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from dsuf.kvcache.arena import Arena


def test_allocations_are_aligned_disjoint_and_inside_the_arena():
    arena = Arena.private(4096, align=64)
    offsets = [arena.alloc(n) for n in (1, 64, 65, 0, 700)]
    assert offsets == [0, 64, 128, 256, 320]  # rounded up to 64; a 0-byte blob still gets its own slot
    assert arena.bytes_allocated == 64 + 64 + 128 + 64 + 704
    assert arena.alloc(4096) is None


def test_freeing_coalesces_neighbours_into_one_run():
    arena = Arena.private(300)
    a, b, c = arena.alloc(100), arena.alloc(100), arena.alloc(100)
    assert arena.alloc(1) is None
    arena.free(a)
    arena.free(c)
    assert arena.alloc(200) is None  # 100 + 100, but not adjacent
    arena.free(b)
    assert arena.alloc(300) == 0  # all three merged back
    with pytest.raises(KeyError):
        arena.free(123)


def test_random_alloc_free_never_overlaps_and_ends_whole():
    rng = random.Random(5)
    arena = Arena.private(1 << 16, align=16)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            arena.free(off)
            del live[off]
        else:
            n = rng.randint(0, 3000)
            off = arena.alloc(n)
            if off is not None:
                live[off] = max(16, -(-n // 16) * 16)
        spans = sorted(live.items())
        assert all(o + n <= nxt for (o, n), (nxt, _) in zip(spans, spans[1:]))
        assert all(o + n <= arena.size for o, n in spans)
    for off in list(live):
        arena.free(off)
    assert arena.alloc(1 << 16) == 0


def test_another_process_reads_and_writes_the_shared_arena_by_name():
    arena = Arena.shared(1 << 20)
    try:
        off = arena.alloc(5)
        arena.region(off, 5)[:] = b"hello"
        code = (
            "import sys; from dsuf.kvcache.arena import Arena; a = Arena.attach(sys.argv[1]); "
            f"r = a.region({off}, 5); assert bytes(r) == b'hello'; r[:] = b'HELLO'"
        )
        subprocess.run([sys.executable, "-c", code, arena.name], check=True, timeout=60)
        assert bytes(arena.region(off, 5)) == b"HELLO"
        with pytest.raises(ValueError, match="outside"):
            arena.region(arena.size - 2, 5)
    finally:
        arena.close()
    with pytest.raises(FileNotFoundError):
        Arena.attach(arena.name)  # the creator unlinked it


def test_arenas_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name in (f"dsuf_arena_{dead.pid}_0a0b0c0d", f"dsuf_arena_{os.getpid()}_01020304", "dsuf_ring_x", "other"):
        (tmp_path / name).write_bytes(b"x")
    assert Arena.remove_orphans(str(tmp_path)) == [f"dsuf_arena_{dead.pid}_0a0b0c0d"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"dsuf_arena_{os.getpid()}_01020304", "dsuf_ring_x", "other"])
