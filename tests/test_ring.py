"""dsuf.ipc.ring: the shared-memory SPSC ring, the eventfd doorbell and the msgspec Channel."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from dsuf.ipc.ring import Channel, Doorbell, MessageTooLarge, Ring, RingFull

REPO = Path(__file__).resolve().parents[1]

# The wire protocol of the cross-process test, executed both here and in the child.
PROTOCOL = '''
import msgspec

class Text(msgspec.Struct, tag=True):
    seq: int
    text: str

class Blob(msgspec.Struct, tag=True):
    seq: int
    data: bytes

Msg = Text | Blob

def transform(m):
    """What the echo child sends back: Text -> Blob of its reversed UTF-8, Blob -> Text of its hex."""
    if isinstance(m, Text):
        return Blob(m.seq, m.text.encode()[::-1])
    return Text(m.seq, m.data.hex())
'''
proto: dict = {}
exec(PROTOCOL, proto)
Text, Blob, Msg, transform = proto["Text"], proto["Blob"], proto["Msg"], proto["transform"]

CHILD = PROTOCOL + '''
import sys
from dsuf.ipc.ring import Channel, Doorbell, Ring

in_name, out_name, in_fd, out_fd, count = sys.argv[1:]
inbox = Channel(Ring.attach(in_name), Doorbell.from_fd(int(in_fd)), Msg)
outbox = Channel(Ring.attach(out_name), Doorbell.from_fd(int(out_fd)), Msg)
for _ in range(int(count)):
    m = inbox.recv(timeout=10.0)
    if m is None:
        sys.exit("echo child: nothing arrived for 10 s")
    outbox.send(transform(m))
inbox.close()
outbox.close()
'''


@pytest.fixture
def make_ring():
    """make_ring(capacity) -> an owned Ring, closed and unlinked after the test."""
    made: list[Ring] = []

    def make(capacity: int) -> Ring:
        made.append(Ring.create(capacity))
        return made[-1]

    yield make
    for ring in made:
        ring.close()
        ring.unlink()


@pytest.fixture
def make_bell():
    made: list[Doorbell] = []

    def make() -> Doorbell:
        made.append(Doorbell.create())
        return made[-1]

    yield make
    for bell in made:
        bell.close()


# --- Ring ------------------------------------------------------------------------------------


def test_records_round_trip_in_order_including_ones_that_wrap(make_ring):
    ring = make_ring(256)
    rng = random.Random(0)
    assert ring.get() is None
    wrapped = 0
    written = 0
    for i in range(2000):
        payload = rng.randbytes(rng.choice([0, 1, 3, 17, 100, 200, 252]))
        start = written % ring.capacity
        ring.try_put(payload)
        written += 4 + len(payload)
        wrapped += start + 4 + len(payload) > ring.capacity
        assert ring.get() == payload, f"record {i}"
        assert ring.get() is None
    assert wrapped > 100  # the sizes above cross the end of the data area often


def test_length_prefix_and_payload_split_across_the_end(make_ring):
    ring = make_ring(64)
    ring.try_put(bytes(58))  # 62 bytes used: the next length prefix straddles the end (2 + 2)
    assert ring.get() == bytes(58)
    ring.try_put(b"ABCDEFGH")
    assert ring.get() == b"ABCDEFGH"
    ring.try_put(bytes(range(40)))  # head at offset 10: prefix 10..14, payload 14..54
    ring.try_put(bytes(range(100, 116)))  # prefix 54..58, payload 58..64 then 0..10: ring full
    with pytest.raises(RingFull):
        ring.try_put(b"")
    assert ring.get() == bytes(range(40))
    assert ring.get() == bytes(range(100, 116))
    assert ring.get() is None


def test_several_records_queue_up_in_order(make_ring):
    ring = make_ring(1024)
    records = [bytes([i]) * i for i in range(30)]
    for r in records:
        ring.try_put(r)
    assert [ring.get() for _ in records] == records
    assert ring.get() is None


def test_full_ring_raises_ring_full_until_the_consumer_reads(make_ring):
    ring = make_ring(64)
    ring.try_put(bytes(28))  # 32 bytes
    ring.try_put(bytes(28))  # 64 bytes: exactly full
    with pytest.raises(RingFull):
        ring.try_put(b"")
    assert ring.get() == bytes(28)
    with pytest.raises(RingFull):
        ring.try_put(bytes(29))  # 33 > 32 free
    ring.try_put(b"x" * 28)  # fits exactly again, wrapping to the start
    assert ring.get() == bytes(28)
    assert ring.get() == b"x" * 28


def test_message_too_large_for_any_ring_state(make_ring):
    ring = make_ring(64)
    ring.try_put(bytes(60))  # capacity - 4 fits an empty ring
    assert ring.get() == bytes(60)
    with pytest.raises(MessageTooLarge):
        ring.try_put(bytes(61))
    assert issubclass(MessageTooLarge, ValueError)
    assert ring.get() is None  # nothing was written


def test_capacity_must_be_a_power_of_two():
    with pytest.raises(ValueError):
        Ring.create(1000)


def test_attached_ring_shares_data_and_capacity(make_ring):
    owner = make_ring(4096)
    other = Ring.attach(owner.name)
    try:
        assert other.capacity == 4096 and other.name == owner.name
        owner.try_put(b"from owner")
        assert other.get() == b"from owner"
        other.try_put(b"from attacher")
        assert owner.get() == b"from attacher"
    finally:
        other.close()


def test_segment_is_gone_after_unlink():
    ring = Ring.create(1024)
    name = ring.name
    Ring.attach(name).close()
    ring.close()
    ring.unlink()
    with pytest.raises(FileNotFoundError):
        Ring.attach(name)


def test_only_the_owner_unlinks(make_ring):
    other = Ring.attach(make_ring(1024).name)
    try:
        with pytest.raises(RuntimeError):
            other.unlink()
    finally:
        other.close()


# --- Doorbell ----------------------------------------------------------------------------------


def test_doorbell_remembers_a_ring_until_cleared(make_bell):
    bell = make_bell()
    assert bell.wait(0) is False
    bell.ring()
    bell.ring()
    assert bell.wait(0) is True  # a ring before the wait counts, and wait clears it
    assert bell.wait(0) is False
    bell.ring()
    bell.clear()
    assert bell.wait(0) is False
    bell.clear()  # clearing an unrung bell does not block


def test_doorbell_wakes_a_sleeping_waiter(make_bell):
    bell = make_bell()
    threading.Timer(0.05, bell.ring).start()
    t0 = time.monotonic()
    assert bell.wait(5.0) is True
    assert time.monotonic() - t0 < 1.0


# --- Channel -----------------------------------------------------------------------------------


def test_channel_round_trips_a_tagged_union(make_ring, make_bell):
    ch = Channel(make_ring(1 << 12), make_bell(), Msg)
    assert ch.recv_nowait() is None
    ch.send(Text(1, "héllo"))
    ch.send(Blob(2, b"\x00\xff"))
    assert ch.bell.wait(0) is True  # send rings
    assert ch.recv_nowait() == Text(1, "héllo")
    assert ch.recv(timeout=0) == Blob(2, b"\x00\xff")
    assert ch.recv_nowait() is None


def test_recv_on_an_empty_channel_sleeps_instead_of_spinning(make_ring, make_bell, monkeypatch):
    ch = Channel(make_ring(1 << 12), make_bell(), Msg)
    looks = []
    real_get = ch.ring.get
    monkeypatch.setattr(ch.ring, "get", lambda: looks.append(1) or real_get())
    wall0, cpu0 = time.monotonic(), time.process_time()
    assert ch.recv(timeout=0.2) is None
    wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
    assert 0.19 <= wall < 0.5
    assert cpu < 0.05
    assert len(looks) <= 3  # looked at the ring before and after sleeping, not in a polling loop


def test_recv_wakes_when_a_message_arrives(make_ring, make_bell):
    ch = Channel(make_ring(1 << 12), make_bell(), Msg)
    threading.Timer(0.05, ch.send, args=(Text(7, "late"),)).start()
    assert ch.recv(timeout=5.0) == Text(7, "late")


def test_drain_returns_everything_and_leaves_the_bell_clear(make_ring, make_bell):
    ch = Channel(make_ring(1 << 12), make_bell(), Msg)
    msgs = [Text(i, str(i)) for i in range(10)]
    for m in msgs:
        ch.send(m)
    assert ch.drain() == msgs
    assert ch.drain() == []
    assert ch.bell.wait(0) is False


def test_drain_loses_no_wakeup_when_a_message_lands_after_the_last_read(make_ring, make_bell, monkeypatch):
    # The producer slips a message in right after drain's final (empty) read. Because drain clears
    # the bell before reading, that message's ring survives and the consumer will come back for it.
    ch = Channel(make_ring(1 << 12), make_bell(), Msg)
    producer = Channel(ch.ring, ch.bell, Msg)
    real_get = ch.ring.get
    injected = []

    def get_then_race():
        payload = real_get()
        if payload is None and not injected:
            injected.append(True)
            producer.send(Text(2, "raced"))
        return payload

    monkeypatch.setattr(ch.ring, "get", get_then_race)
    ch.send(Text(1, "first"))
    assert ch.drain() == [Text(1, "first")]
    assert ch.bell.wait(0) is True  # still rung for the raced message
    assert ch.drain() == [Text(2, "raced")]


def test_send_waits_for_space_then_gives_up_with_ring_full(make_ring, make_bell):
    ch = Channel(make_ring(128), make_bell(), Msg)
    big = Blob(0, bytes(40))  # 63 bytes encoded + 4: one fits, two do not
    ch.send(big)
    t0 = time.monotonic()
    with pytest.raises(RingFull):
        ch.send(big, timeout=0.1)
    assert 0.1 <= time.monotonic() - t0 < 1.0
    threading.Timer(0.05, ch.recv_nowait).start()  # the consumer frees space while send waits
    ch.send(Blob(1, bytes(40)), timeout=5.0)
    assert ch.recv_nowait() == Blob(1, bytes(40))


def test_send_rejects_a_message_that_can_never_fit(make_ring, make_bell):
    ch = Channel(make_ring(64), make_bell(), Msg)
    t0 = time.monotonic()
    with pytest.raises(MessageTooLarge):
        ch.send(Blob(0, bytes(100)))
    assert time.monotonic() - t0 < 1.0  # no waiting for space that can never come (a full ring would wait SEND_TIMEOUT)


# --- Cross-process ----------------------------------------------------------------------------

N_MESSAGES = 10_000
WINDOW = 32  # messages in flight; WINDOW * largest message < ring capacity, so neither side blocks


def make_requests(n: int) -> list:
    rng = random.Random(1)
    out = []
    for seq in range(n):
        size = rng.choice([0, 1, 10, 100, 500, 1500])
        if seq % 2:
            out.append(Blob(seq, rng.randbytes(size)))
        else:
            out.append(Text(seq, rng.randbytes(size).hex()[:size] + "ü"))
    return out


@pytest.fixture
def echo_child(make_ring, make_bell):
    """(to_child, from_child, process): Channels to a real child process that echoes N_MESSAGES."""
    to_ring, from_ring = make_ring(1 << 16), make_ring(1 << 16)
    to_bell, from_bell = make_bell(), make_bell()
    args = [to_ring.name, from_ring.name, str(to_bell.fd), str(from_bell.fd), str(N_MESSAGES)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], pass_fds=(to_bell.fd, from_bell.fd), cwd=REPO, env=env)
    try:
        yield Channel(to_ring, to_bell, Msg), Channel(from_ring, from_bell, Msg), proc
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_child_echoes_every_message_to_a_blocking_parent(echo_child):
    to_child, from_child, proc = echo_child
    requests = make_requests(N_MESSAGES)
    sent = 0
    for expected in map(transform, requests):
        while sent < N_MESSAGES and sent - expected.seq < WINDOW:
            to_child.send(requests[sent])
            sent += 1
        reply = from_child.recv(timeout=5.0)
        assert reply == expected
    assert from_child.recv(timeout=0.05) is None


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_child_echoes_every_message_to_an_event_loop_consumer(echo_child, loop_kind):
    to_child, from_child, proc = echo_child
    if loop_kind == "uvloop":
        loop = pytest.importorskip("uvloop").new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    requests = make_requests(N_MESSAGES)
    replies: list = []
    batches = 0

    async def main() -> None:
        nonlocal batches
        progress = asyncio.Event()

        def on_messages(msgs: list) -> None:
            nonlocal batches
            assert msgs
            batches += 1
            replies.extend(msgs)
            progress.set()

        from_child.attach_to_loop(asyncio.get_running_loop(), on_messages)
        sent = 0
        while len(replies) < N_MESSAGES:
            while sent < N_MESSAGES and sent - len(replies) < WINDOW:
                to_child.send(requests[sent])
                sent += 1
            progress.clear()
            await asyncio.wait_for(progress.wait(), 5.0)
        from_child.detach_from_loop(asyncio.get_running_loop())

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert replies == [transform(r) for r in requests]
    assert 0 < batches <= N_MESSAGES
