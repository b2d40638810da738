"""Conversation caches moving between servers: several `dsuf serve` processes share one real
redis-server; a conversation's next turn on another server fetches the previous turn's state from
its owner over the authenticated TCP transport, claims it, and answers token for token what a
server that recomputed the prompt answers. Every fault ends in that same correct answer."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("redis")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from redis_fixture import redis_server  # noqa: E402, F401
from server_fixture import REPO, Server, server_env  # noqa: E402
from test_conversation_cache import CHAT, EOS, answer, chat, hit, ids, prompt_len  # noqa: E402
from test_server import cache_home  # noqa: E402, F401

from dsuf.kvcache.ownership import OwnershipDirectory  # noqa: E402
from dsuf.kvcache.snapshot import chain_key, stamp_epoch  # noqa: E402
from dsuf.kvcache.transport import ExportRefused, KvFetcher, KvTransferServer  # noqa: E402

SECRET = "fleet-secret-for-tests"
MODEL_ID = "dsuf-tiny-v4-seed0"  # the embedded checkpoint's name: part of every chain key
TURN1 = [{"role": "user", "content": "Name a colour."}]
REPLY = "Blue, like the sky."
TURN2 = TURN1 + [{"role": "assistant", "content": REPLY}, {"role": "user", "content": "Another one?"}]


def prompt_ids(messages: list[dict]) -> list[int]:
    return CHAT.prepare({"model": "x", "messages": messages, "thinking": {"type": "disabled"}}).prompt_ids


def closing_tokens() -> list[int]:
    """Turn 1's prompt, its forced answer and EOS: what turn 2's prompt starts with."""
    return prompt_ids(TURN1) + ids(REPLY) + [EOS]


class Fleet:
    def __init__(self, redis, cache_home: Path, tmp: Path) -> None:
        self.redis, self.cache_home, self.tmp = redis, cache_home, tmp
        self.servers: list[Server] = []

    def start(self, name: str, *, secret: str = SECRET, lease_ms: int = 1500, extra: list[str] = ()) -> Server:
        args = ["--test-hooks", "--server-id", name, "--redis-url", self.redis.url, "--kv-port", "0",
                "--cluster-secret", secret, "--kv-lease-ms", str(lease_ms), "--kv-fetch-timeout", "3.0",
                "--kv-host-bytes", str(64 << 20), *extra]
        server = Server(self.tmp / f"{name}.log", args, server_env(self.cache_home))
        self.servers.append(server)
        return server

    def stop(self) -> None:
        for server in self.servers:
            if server.proc.poll() is None:
                try:
                    os.kill(server.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                server.stop()


@pytest.fixture
def fleet(redis_server, cache_home, tmp_path):
    f = Fleet(redis_server, cache_home, tmp_path)
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def reference(cache_home, tmp_path_factory):
    """A lone server with no cache: the answers every fleet turn must equal."""
    server = Server(tmp_path_factory.mktemp("ref") / "ref.log", ["--test-hooks", "--kv-host-bytes", "0"], server_env(cache_home))
    try:
        server.wait_ready()
        yield {"turn2": answer(chat(server, TURN2)), "turn3": lambda msgs: answer(chat(server, msgs))}
    finally:
        server.stop()


def ready(*servers: Server) -> None:
    for s in servers:
        s.wait_ready()
        s.wait_for_log("holds a lease")


def kvctl(redis_url: str, *args: str) -> list | dict:
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "kvctl"), "--redis", redis_url, "--json", *args],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def owner_of(redis_url: str, tokens: list[int]) -> dict:
    return kvctl(redis_url, "show", chain_key(MODEL_ID, tokens))


def turn1_on(server: Server) -> None:
    first = chat(server, TURN1, forced=ids(REPLY) + [EOS])
    assert first["choices"][0]["message"]["content"] == REPLY


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout} s")


def claimed_by(redis_url: str, tokens: list[int], owner: str) -> bool:
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "kvctl"), "--redis", redis_url, "--json", "show",
                           chain_key(MODEL_ID, tokens)], capture_output=True, text=True, timeout=30)
    return proc.returncode == 0 and json.loads(proc.stdout)["owner"] == owner


def test_the_next_turn_on_another_server_fetches_the_cache_and_the_turn_after_fetches_it_back(fleet, reference):
    a, b = fleet.start("A"), fleet.start("B")
    ready(a, b)
    turn1_on(a)
    key_tokens = closing_tokens()
    wait_until(lambda: claimed_by(fleet.redis.url, key_tokens, "A"), what="A's claim of turn 1")

    second = chat(b, TURN2)
    assert hit(second) == len(key_tokens)  # all of turn 1, fetched from A
    assert answer(second) == reference["turn2"]
    assert "fetched" in b.wait_for_log("fetched")
    wait_until(lambda: claimed_by(fleet.redis.url, key_tokens, "B"), what="B's claim after the fetch")

    content = second["choices"][0]["message"]["content"] or ""
    turn3 = TURN2 + [{"role": "assistant", "content": content}, {"role": "user", "content": "And one more?"}]
    wait_until(lambda: claimed_by(fleet.redis.url, prompt_ids(TURN2), "B"), what="B's claim of turn 2's prompt")
    third = chat(a, turn3)
    assert hit(third) >= prompt_len(TURN2, False)  # at least turn 2's prompt, which only B computed
    assert "from B" in a.wait_for_log("from B")
    assert answer(third) == reference["turn3"](turn3)


def test_a_conversation_id_names_the_latest_snapshot_across_servers(fleet, reference):
    a, b = fleet.start("A"), fleet.start("B")
    ready(a, b)
    first = chat(a, TURN1, forced=ids(REPLY) + [EOS], headers={"X-Conversation-Id": "conv-42"})
    assert first["choices"][0]["message"]["content"] == REPLY
    closing = len(closing_tokens())  # the name first points at the prompt's snapshot, then at the closing one
    wait_until(lambda: any(r["conv"] == "name:conv-42" and r["tokens"] == closing for r in kvctl(fleet.redis.url, "list")),
               what="the name record of turn 1's closing snapshot")
    second = chat(b, TURN2, prompt_cache_key="conv-42")
    assert hit(second) == closing and answer(second) == reference["turn2"]


@pytest.mark.parametrize("fault", ["killed_before", "killed_during", "frozen_past_lease", "frozen_within_lease", "wrong_secret"])
def test_a_lost_owner_or_a_refused_transfer_means_a_recompute_with_the_same_answer(fleet, reference, fault):
    a = fleet.start("A")
    b = fleet.start("B", secret="not-the-fleet-secret" if fault == "wrong_secret" else SECRET)
    ready(a, b)
    turn1_on(a)
    wait_until(lambda: claimed_by(fleet.redis.url, closing_tokens(), "A"), what="A's claim")
    pid = a.proc.pid
    if fault == "killed_before":
        os.kill(pid, signal.SIGKILL)  # its lease lives on for a while: B tries, and is refused by the OS
    elif fault in ("frozen_past_lease", "frozen_within_lease", "killed_during"):
        os.kill(pid, signal.SIGSTOP)
        if fault == "frozen_past_lease":
            time.sleep(2.0)  # > --kv-lease-ms: B sees no lease and does not even try
    if fault == "killed_during":  # B connects (the kernel accepts for the frozen A), then A dies mid-handshake
        killer = subprocess.Popen([sys.executable, "-c", f"import os, signal, time; time.sleep(0.5); os.kill({pid}, signal.SIGKILL)"])
    began = time.monotonic()
    second = chat(b, TURN2)
    took = time.monotonic() - began
    if fault == "killed_during":
        killer.wait(5)
    assert answer(second) == reference["turn2"]
    assert hit(second) == 0
    if fault == "frozen_past_lease":
        assert "failed" not in b.log()  # nothing to fetch from: a dead owner is a plain miss
    else:
        assert "recomputing" in b.wait_for_log("recomputing")
    assert took < 15


def turn1_owned_by_a(fleet: Fleet) -> tuple[Server, Server, list[int], str]:
    """Servers A and B; turn 1 answered on A, whose closing snapshot A has claimed: (A, B, the
    snapshot's tokens, its key)."""
    a, b = fleet.start("A"), fleet.start("B")
    ready(a, b)
    turn1_on(a)
    key_tokens = closing_tokens()
    wait_until(lambda: claimed_by(fleet.redis.url, key_tokens, "A"), what="A's claim")
    return a, b, key_tokens, chain_key(MODEL_ID, key_tokens)


def test_corrupted_bytes_and_a_stale_epoch_are_refused(fleet, reference, tmp_path):
    """A stand-in owner (this test) serves a snapshot with one flipped payload bit; the real
    server A refuses an export at an epoch it does not hold."""
    _, b, key_tokens, key = turn1_owned_by_a(fleet)

    async def scenario() -> None:
        evil = OwnershipDirectory(fleet.redis.url, "evil", ctrl_addr="", transports=["tcp"], lease_ms=5000)
        rec = await evil.lookup(key)
        lease = await evil.server("A")
        fetcher = KvFetcher(SECRET.encode())
        blob = bytearray(await fetcher.fetch(lease.ctrl_addr, key, rec.epoch, lambda n: memoryview(bytearray(n))))
        with pytest.raises(ExportRefused, match="epoch"):
            await fetcher.fetch(lease.ctrl_addr, key, rec.epoch + 1, lambda n: memoryview(bytearray(n)))
        await fetcher.close()

        blob[-1] ^= 0x01  # one bit of the payload

        @contextmanager
        def lookup(k: str, epoch: int):
            yield memoryview(blob)

        server = KvTransferServer(lookup, SECRET.encode())
        await server.start()
        evil.ctrl_addr = server.address
        await evil.start()
        claim = await evil.claim(key, rec.epoch, tokens=rec.tokens, bytes_=len(blob), layout=rec.layout)
        assert claim.ok
        stamp_epoch(blob, claim.epoch)  # the header is right, only the payload checksum fails
        second = await asyncio.to_thread(chat, b, TURN2)
        assert answer(second) == reference["turn2"] and hit(second) == 0
        await server.stop()
        await evil.close()

    asyncio.run(scenario())
    assert "checksum" in b.wait_for_log("checksum")


def test_an_owner_that_refuses_because_the_snapshot_moved_on_is_followed_to_its_new_owner(fleet, reference):
    """B finds the snapshot at one owner, but by the time it asks, another server has claimed it
    and the first refuses (stale epoch), as A does after another server fetched the same turn a
    moment earlier: B looks the record up again and fetches from the new owner instead of
    recomputing. Two stand-ins (this test) play the owners: the first moves the record to the
    second as it refuses."""
    _, b, key_tokens, key = turn1_owned_by_a(fleet)
    second_loop = asyncio.new_event_loop()  # the new owner's: the first one's refusal waits on its claim
    threading.Thread(target=second_loop.run_forever, daemon=True).start()

    def on_second(coro):
        return asyncio.run_coroutine_threadsafe(coro, second_loop).result(10)

    async def serving(name: str, lookup) -> tuple[OwnershipDirectory, KvTransferServer]:
        server = KvTransferServer(lookup, SECRET.encode())
        await server.start()
        directory = OwnershipDirectory(fleet.redis.url, name, ctrl_addr=server.address, transports=["tcp"], lease_ms=5000)
        await directory.start()
        return directory, server

    async def scenario() -> None:
        probe = OwnershipDirectory(fleet.redis.url, "probe", ctrl_addr="", transports=["tcp"], lease_ms=5000)
        rec = await probe.lookup(key)
        fetcher = KvFetcher(SECRET.encode())
        blob = bytearray(await fetcher.fetch((await probe.server("A")).ctrl_addr, key, rec.epoch, lambda n: memoryview(bytearray(n))))
        await fetcher.close()
        await probe.close()

        @contextmanager
        def new_owner(k: str, epoch: int):
            yield memoryview(blob)

        new, new_server = on_second(serving("new", new_owner))

        @contextmanager
        def old_owner(k: str, epoch: int):
            moved = on_second(new.claim(key, epoch, tokens=rec.tokens, bytes_=len(blob), layout=rec.layout))
            assert moved.ok
            stamp_epoch(blob, moved.epoch)
            raise ExportRefused(f"stale epoch {epoch} for snapshot {k[:12]}")
            yield  # (never)

        old, old_server = await serving("old", old_owner)
        claim = await old.claim(key, rec.epoch, tokens=rec.tokens, bytes_=len(blob), layout=rec.layout)
        assert claim.ok
        second = await asyncio.to_thread(chat, b, TURN2)
        assert answer(second) == reference["turn2"] and hit(second) == len(key_tokens)
        await old_server.stop()
        await old.close()
        on_second(new_server.stop())
        on_second(new.close())

    asyncio.run(scenario())
    second_loop.call_soon_threadsafe(second_loop.stop)
    assert "new holds them now" in b.wait_for_log("holds them now")


def test_two_servers_fetching_the_same_turn_at_once_leave_exactly_one_owner(fleet, reference):
    # Both fetches must finish: a stall past the usual 3 s on a loaded machine would recompute.
    patient = ["--kv-fetch-timeout", "15"]
    a, b, c = fleet.start("A"), fleet.start("B", extra=patient), fleet.start("C", extra=patient)
    ready(a, b, c)
    turn1_on(a)
    key_tokens = closing_tokens()
    wait_until(lambda: claimed_by(fleet.redis.url, key_tokens, "A"), what="A's claim")

    async def both() -> list[dict]:
        return await asyncio.gather(asyncio.to_thread(chat, b, TURN2), asyncio.to_thread(chat, c, TURN2))

    for resp in asyncio.run(both()):
        assert answer(resp) == reference["turn2"]
        assert hit(resp) == len(key_tokens)  # both fetched (the data is the same); one claim won
    # Whichever claimed first won; a loser of the same race keeps an unadvertised copy. The
    # announcement log shows every successful claim of the key: never two at one epoch.
    wait_until(lambda: owner_of(fleet.redis.url, key_tokens)["owner"] in ("B", "C"), what="a new owner")
    import redis

    client = redis.Redis.from_url(fleet.redis.url, decode_responses=True)
    key = chain_key(MODEL_ID, key_tokens)
    claims = [json.loads(fields["msg"]) for _, fields in client.xrange("kv:own:log")]
    epochs = [c["epoch"] for c in claims if c["conv"] == key and c["event"] == "claim"]
    client.close()
    assert epochs == list(range(1, len(epochs) + 1)) and epochs[0] == 1 and len(epochs) in (2, 3)


def test_redis_restarted_empty_mid_run_owners_reclaim_and_turns_go_on(fleet, reference):
    a, b = fleet.start("A", lease_ms=900), fleet.start("B", lease_ms=900)
    ready(a, b)
    turn1_on(a)
    key_tokens = closing_tokens()
    wait_until(lambda: claimed_by(fleet.redis.url, key_tokens, "A"), what="A's claim")

    fleet.redis.kill()
    second_while_down = chat(b, TURN2)  # Redis is down: B recomputes, never blocks or fails
    assert answer(second_while_down) == reference["turn2"]
    fleet.redis.start()  # same port, no data: a new cluster id
    wait_until(lambda: claimed_by(fleet.redis.url, key_tokens, "A"), timeout=15, what="A's re-claim after the reset")
    # B's own turn-2 snapshots are re-claimed too; A's turn 1 can be fetched by a newcomer
    c = fleet.start("C")
    ready(c)
    third = chat(c, TURN2)
    assert hit(third) >= len(key_tokens) and answer(third) == reference["turn2"]
