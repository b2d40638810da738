"""The Redis ownership directory (`dsuf.kvcache.ownership`) against a real redis-server.

Spec: `kv_sharing.md` §4.2 (schema, CAS handoff, leases, announcements, cluster id) and §5 (fault
injection: concurrent claims, stale owners, Redis restart with data loss, Redis hung).
Each test runs its own event loop (`asyncio.run`) under a deadline, so a hang fails instead of
blocking the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("redis")
import redis.asyncio as aioredis  # noqa: E402

from dsuf.kvcache.ownership import (  # noqa: E402
    ConvRecord,
    DirectoryUnavailable,
    OwnershipDirectory,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from redis_fixture import RedisServer, redis_server  # noqa: E402, F401

T = TypeVar("T")
LAYOUT = "dsv4.1-flash/kv1/bs64"


def run(coro: Awaitable[T], timeout: float = 15.0) -> T:
    async def guarded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(guarded())


def directory(url: str, server_id: str, **kw: Any) -> OwnershipDirectory:
    """A directory with a generous Redis deadline (a loaded CI machine can take 0.2 s for a call);
    the tests of the deadline itself pass their own `op_timeout`."""
    port = 7000 + sum(map(ord, server_id)) % 1000
    kw.setdefault("op_timeout", 2.0)
    return OwnershipDirectory(url, server_id, ctrl_addr=f"127.0.0.1:{port}", transports=["tcp"], **kw)


async def claim(d: OwnershipDirectory, conv: str, expected: int, tokens: int = 100):
    return await d.claim(conv, expected, tokens=tokens, bytes_=tokens * 890, layout=LAYOUT)


@contextlib.asynccontextmanager
async def started(*ds: OwnershipDirectory):
    for d in ds:
        await d.start()
    try:
        yield ds
    finally:
        for d in ds:
            await d.close()


def raw(server: RedisServer) -> aioredis.Redis:
    return aioredis.Redis.from_url(server.url, decode_responses=True)


# 1 ---------------------------------------------------------------------------------------------


def test_first_claim_wins_and_announces(redis_server: RedisServer) -> None:
    async def main() -> None:
        r = raw(redis_server)
        ps = r.pubsub()
        await ps.subscribe("kv:own")
        assert (await ps.get_message(timeout=1))["type"] == "subscribe"
        a = directory(redis_server.url, "A", retention_ms=60_000)
        async with started(a):
            assert await a.lookup("c1") is None
            t0 = int(time.time() * 1000)
            res = await claim(a, "c1", 0, tokens=10)
            assert (res.ok, res.epoch, res.owner, res.reason) == (True, 1, "A", "ok")

            expected = {"conv": "c1", "owner": "A", "epoch": 1, "boot": a.boot_id, "event": "claim"}
            msg = await ps.get_message(ignore_subscribe_messages=True, timeout=2)
            assert msg is not None and msg["channel"] == "kv:own"
            assert json.loads(msg["data"]) == expected
            log = await r.xrange("kv:own:log")
            assert len(log) == 1 and json.loads(log[0][1]["msg"]) == expected

            rec = await a.lookup("c1")
            assert rec is not None
            assert (rec.conv, rec.owner, rec.epoch, rec.boot) == ("c1", "A", 1, a.boot_id)
            assert (rec.tokens, rec.bytes, rec.layout) == (10, 8900, LAYOUT)
            assert abs(rec.ts - t0) < 5000
            assert a.is_mine(rec) and await a.owner_alive(rec)
            # The documented key layout, with its retention and the owner's index.
            assert await r.hget("kv:conv:{c1}", "owner") == "A"
            assert 50_000 < await r.pttl("kv:conv:{c1}") <= 60_000
            assert await r.smembers("kv:srv:{A}:convs") == {"c1"}
            lease = json.loads(await r.get("kv:srv:{A}"))
            assert lease["boot_id"] == a.boot_id and lease["ctrl_addr"] == a.ctrl_addr
            assert 0 < await r.pttl("kv:srv:{A}") <= 10_000

            # A second first-claim loses against the existing record, and says why.
            again = await claim(a, "c1", 0)
            assert (again.ok, again.epoch, again.owner, again.reason) == (False, 1, "A", "epoch")
            assert (await a.lookup("c1")).epoch == 1
            assert len(await r.xrange("kv:own:log")) == 1
        await ps.aclose()
        await r.aclose()

    run(main())


# 2 ---------------------------------------------------------------------------------------------


def test_concurrent_handoffs_exactly_one_wins(redis_server: RedisServer) -> None:
    async def main() -> None:
        r = raw(redis_server)
        # 50 claims at once on cold connections: this is about atomicity, not latency, so a
        # loaded CI machine gets a generous deadline.
        a, b, c = (directory(redis_server.url, s, op_timeout=2.0) for s in "ABC")
        async with started(a, b, c):
            convs = [f"race{i}" for i in range(25)]
            for conv in convs:
                assert (await claim(a, conv, 0)).ok
            # B and C both fetched at epoch 1 and now both try to take over, interleaved.
            results = await asyncio.gather(*(claim(d, conv, 1) for conv in convs for d in (b, c)))
            for i, conv in enumerate(convs):
                rb, rc = results[2 * i], results[2 * i + 1]
                assert rb.ok != rc.ok, (conv, rb, rc)
                win, lose = (rb, rc) if rb.ok else (rc, rb)
                assert win.epoch == 2
                assert (lose.epoch, lose.owner, lose.reason) == (2, win.owner, "epoch")
                rec = await a.lookup(conv)
                assert (rec.owner, rec.epoch) == (win.owner, 2)
                assert rec.boot == (b if win.owner == "B" else c).boot_id
            # The stale owner A can neither release nor touch, and no longer lists them.
            assert await r.smembers("kv:srv:{A}:convs") == set()
            for conv in convs:
                assert not await a.release(conv, 1)
                assert not await a.touch(conv, 1)
                assert await a.lookup(conv) is not None
            # The winner can; a release is announced and leaves no trace.
            rec = await a.lookup(convs[0])
            winner = b if rec.owner == "B" else c
            assert not await winner.release(convs[0], 1)  # right owner, wrong epoch
            assert await winner.touch(convs[0], 2, tokens=150)
            assert (await a.lookup(convs[0])).tokens == 150
            assert await winner.release(convs[0], 2)
            assert await a.lookup(convs[0]) is None
            assert convs[0] not in await r.smembers(f"kv:srv:{{{winner.server_id}}}:convs")
            last = json.loads((await r.xrevrange("kv:own:log", count=1))[0][1]["msg"])
            assert last == {"conv": convs[0], "owner": winner.server_id, "epoch": 2, "boot": winner.boot_id,
                            "event": "release"}
            # Claims and losses: 25 first claims + 25 winning handoffs + 1 release.
            assert await r.xlen("kv:own:log") == 51
        await r.aclose()

    run(main())


# 3 ---------------------------------------------------------------------------------------------


def test_lapsed_lease_and_restarted_server_are_stale(redis_server: RedisServer) -> None:
    async def main() -> None:
        a = directory(redis_server.url, "A", lease_ms=300)
        b = directory(redis_server.url, "B", lease_ms=300)
        await a.start()
        await b.start()
        assert (await claim(a, "c", 0)).ok
        await asyncio.sleep(0.8)  # well past the lease: the lease loop keeps it alive
        rec = await b.lookup("c")
        assert await b.owner_alive(rec)
        assert (await b.server("A")).boot_id == a.boot_id

        # A stops renewing (hung or dead, lease left behind): after the lease it is reported dead.
        await a.close(drop_lease=False)
        assert await b.server("A") is not None
        await asyncio.sleep(0.45)
        assert await b.server("A") is None
        assert not await b.owner_alive(rec)
        res = await claim(b, "c", rec.epoch)  # B recomputed; it claims with the epoch it read
        assert (res.ok, res.epoch, res.owner) == (True, 2, "B")
        await b.close()

        # A server restarted under the same id: its lease is live, but the records of its previous
        # incarnation name another boot, so they are stale.
        a1 = directory(redis_server.url, "A")
        await a1.start()
        assert (await claim(a1, "c2", 0)).ok
        a2 = directory(redis_server.url, "A", lease_ms=300)
        await a2.start()  # the new process takes the lease over
        rec2 = await a2.lookup("c2")
        assert rec2.owner == "A" and rec2.boot == a1.boot_id
        assert not await a2.owner_alive(rec2)
        assert not a2.is_mine(rec2)
        assert (await a2.server("A")).boot_id == a2.boot_id
        # The old process can no longer claim, and its lease loop does not take the lease back.
        stale = await claim(a1, "c3", 0)
        assert (stale.ok, stale.reason) == (False, "no_lease")
        assert a1.superseded
        await a1.heartbeat()
        assert (await a2.server("A")).boot_id == a2.boot_id
        assert not await a2.release("c2", 1)  # right id and epoch, wrong incarnation
        assert not await a2.touch("c2", 1)
        # The new one re-claims after recomputing.
        res = await claim(a2, "c2", rec2.epoch)
        assert (res.ok, res.epoch) == (True, 2)
        assert await a2.owner_alive(await a2.lookup("c2"))
        await a1.close()  # does not delete a2's lease
        assert (await a2.server("A")).boot_id == a2.boot_id
        await a2.close()
        r = raw(redis_server)
        assert await r.get("kv:srv:{A}") is None  # a clean shutdown deletes the lease
        await r.aclose()

    run(main())


# 4 ---------------------------------------------------------------------------------------------


def test_watch_yields_and_resumes(redis_server: RedisServer) -> None:
    async def next_n(it, n: int) -> list[dict]:
        return [await asyncio.wait_for(anext(it), 3) for _ in range(n)]

    async def main() -> None:
        r = raw(redis_server)
        a = directory(redis_server.url, "A")
        async with started(a):
            assert (await claim(a, "old", 0)).ok  # before the watcher: "$" skips it
            it = a.watch(block_ms=200)
            first = asyncio.ensure_future(anext(it))
            await asyncio.sleep(0.1)
            assert (await claim(a, "w1", 0)).ok
            assert (await claim(a, "w2", 0)).ok
            got = [await asyncio.wait_for(first, 3), *await next_n(it, 1)]
            assert [(m["conv"], m["event"], m["epoch"], m["owner"]) for m in got] == [
                ("w1", "claim", 1, "A"), ("w2", "claim", 1, "A")]
            assert all(m["boot"] == a.boot_id and "-" in m["id"] for m in got)

            # The server closes the watcher's connection while it blocks; claims made meanwhile
            # arrive once it has reconnected, none lost, none repeated.
            pending = asyncio.ensure_future(anext(it))
            await asyncio.sleep(0.1)
            killed = 0
            for client in await r.client_list():
                if client["cmd"] == "xread":
                    await r.client_kill_filter(_id=client["id"])
                    killed += 1
            assert killed == 1
            assert (await claim(a, "w3", 0)).ok
            assert (await claim(a, "w4", 0)).ok
            got = [await asyncio.wait_for(pending, 3), *await next_n(it, 1)]
            assert [m["conv"] for m in got] == ["w3", "w4"]
            last_id = got[-1]["id"]
            await it.aclose()

            # A new watcher (after a restart of the watching process) resumes from the last id.
            assert (await a.release("w3", 1))
            assert (await claim(a, "w5", 0)).ok
            it2 = a.watch(last_id, block_ms=200)
            got = await next_n(it2, 2)
            assert [(m["conv"], m["event"]) for m in got] == [("w3", "release"), ("w5", "claim")]
            nothing = asyncio.ensure_future(anext(it2))
            await asyncio.sleep(0.4)
            assert not nothing.done()
            nothing.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nothing
            await it2.aclose()

            # From the beginning of the log.
            it3 = a.watch("0-0")
            assert [m["conv"] for m in await next_n(it3, 3)] == ["old", "w1", "w2"]
            await it3.aclose()
        await r.aclose()

    run(main())


def test_a_watcher_stops_when_cancelled_wherever_the_cancellation_lands(redis_server: RedisServer) -> None:
    """Ctrl-C in `kvctl watch`, a server's shutdown: the cancellation may land while redis-py
    connects or writes, where Python 3.11's asyncio.wait_for can drop it (gh-86296)."""

    async def main() -> None:
        a = directory(redis_server.url, "A")
        for i in range(40):
            it = a.watch("0-0", block_ms=5000)
            task = asyncio.ensure_future(anext(it))
            await asyncio.sleep(i * 0.0002)  # from before the connection to well into the blocking read
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=3)
            assert done and task.cancelled(), f"a watcher cancelled after {i * 0.2:.1f} ms kept running"
            await it.aclose()

    run(main(), timeout=150)


# 5 ---------------------------------------------------------------------------------------------


def test_redis_restart_data_loss_detected_and_recovered(redis_server: RedisServer) -> None:
    async def main() -> None:
        a = directory(redis_server.url, "A", lease_ms=300)
        held = {"c1": 100, "c2": 200}  # what A holds in memory
        resets = asyncio.Event()

        async def reclaim() -> None:
            for conv, tokens in held.items():
                assert (await claim(a, conv, 0, tokens=tokens)).ok
            resets.set()

        a.on_cluster_reset(reclaim)
        async with started(a):
            for conv, tokens in held.items():
                assert (await claim(a, conv, 0, tokens=tokens)).ok
            unstarted = directory(redis_server.url, "B")
            assert (await claim(unstarted, "x", 0)).reason == "no_lease"  # no lease, no claims
            await unstarted.close()
            assert (await claim(a, "c1", 1)).ok  # epoch 2 now
            cluster0 = a.cluster_id
            assert cluster0

            redis_server.restart()  # SIGKILL: every key, and the script cache, is gone
            await asyncio.wait_for(resets.wait(), 3)
            assert a.cluster_id and a.cluster_id != cluster0
            lease = await a.server("A")
            assert lease is not None and lease.boot_id == a.boot_id
            # The re-claim started from fresh epochs (old epochs are meaningless now).
            recs = {r.conv: r for r in await a.list_convs("A")}
            assert {c: (r.epoch, r.tokens) for c, r in recs.items()} == {"c1": (1, 100), "c2": (1, 200)}
            assert (await claim(a, "c3", 0)).ok

        # A claim right after a restart, before the lease loop noticed (long lease): the claim
        # renews the lease itself, and the reset is still reported.
        resets2: list[str] = []
        b = directory(redis_server.url, "B", lease_ms=30_000)
        b.on_cluster_reset(lambda: resets2.append(b.cluster_id or ""))
        async with started(b):
            assert (await claim(b, "d1", 0)).ok
            redis_server.restart()
            t0 = time.monotonic()
            res = await claim(b, "d2", 0)
            assert res.ok and res.epoch == 1
            assert time.monotonic() - t0 < 1.0
            assert await b.lookup("d1") is None  # lost with the restart
            assert await b.owner_alive(await b.lookup("d2"))
            await asyncio.sleep(0.05)
            assert resets2 == [b.cluster_id]

    run(main())


# 6 ---------------------------------------------------------------------------------------------


def test_redis_hung_or_down_fails_fast(redis_server: RedisServer) -> None:
    async def expect_unavailable(aw: Awaitable[Any]) -> float:
        t0 = time.monotonic()
        with pytest.raises(DirectoryUnavailable):
            await aw
        return time.monotonic() - t0

    async def main() -> None:
        a = directory(redis_server.url, "A", op_timeout=0.2)
        async with started(a):
            assert (await claim(a, "c", 0)).ok
            assert (await claim(a, "other", 0, tokens=7)).ok
            rec = await a.lookup("c")

            redis_server.pause()  # SIGSTOP: connections open, nothing answers
            try:
                ops = [a.lookup("c"), claim(a, "c", 1), claim(a, "new", 0), a.server("A"),
                       a.owner_alive(rec), a.release("c", 1), a.touch("c", 1)]
                for op in ops:
                    assert await expect_unavailable(op) < 1.0
                # Concurrent callers do not queue behind each other.
                t0 = time.monotonic()
                res = await asyncio.gather(*(a.lookup(f"c{i}") for i in range(20)), return_exceptions=True)
                assert all(isinstance(x, DirectoryUnavailable) for x in res)
                assert time.monotonic() - t0 < 1.0
                await asyncio.sleep(0.3)  # the lease loop fails meanwhile, and keeps going
            finally:
                redis_server.resume()

            # Answers belong to their requests again (no stale replies on reused connections).
            for _ in range(3):
                assert (await a.lookup("c")).epoch == 1
                assert (await a.lookup("other")).tokens == 7
                assert await a.lookup("missing") is None
                assert (await a.server("A")).boot_id == a.boot_id
            res = await claim(a, "c", 1)
            assert (res.ok, res.epoch) == (True, 2)

            redis_server.kill()  # down: connection refused
            for op in [a.lookup("c"), claim(a, "c", 2), a.server("A"), a.list_convs(), a.servers()]:
                assert await expect_unavailable(op) < 1.0
            t0 = time.monotonic()
        assert time.monotonic() - t0 < 1.0  # close() does not hang on a dead Redis

    run(main())


# 7 ---------------------------------------------------------------------------------------------


def test_list_convs_and_servers(redis_server: RedisServer) -> None:
    async def main() -> None:
        r = raw(redis_server)
        a = directory(redis_server.url, "A")
        b = directory(redis_server.url, "B")
        c = directory(redis_server.url, "C", retention_ms=400)
        async with started(a, b, c):
            assert await a.list_convs() == [] and await a.list_convs("A") == []
            for conv in ("a1", "a2"):
                assert (await claim(a, conv, 0)).ok
            assert (await claim(b, "b1", 0)).ok
            assert (await claim(b, "a2", 1)).ok  # handoff A -> B

            def convs(recs: list[ConvRecord]) -> list[tuple[str, str, int]]:
                return [(x.conv, x.owner, x.epoch) for x in recs]

            assert convs(await c.list_convs("A")) == [("a1", "A", 1)]
            assert convs(await c.list_convs("B")) == [("a2", "B", 2), ("b1", "B", 1)]
            assert convs(await c.list_convs("nobody")) == []
            assert sorted(convs(await c.list_convs())) == [("a1", "A", 1), ("a2", "B", 2), ("b1", "B", 1)]

            a.set_stats(bytes_used=123_456, entries=2)
            await a.heartbeat()
            srv = {s.server_id: s for s in await c.servers()}
            assert sorted(srv) == ["A", "B", "C"]
            assert (srv["A"].ctrl_addr, srv["A"].boot_id, srv["A"].transports) == (a.ctrl_addr, a.boot_id, ["tcp"])
            assert (srv["A"].bytes_used, srv["A"].entries) == (123_456, 2)
            assert (srv["B"].bytes_used, srv["B"].entries) == (0, 0)
            assert all(0 < s.ttl_ms <= 10_000 for s in srv.values())
            assert srv["B"].boot_id == b.boot_id

            # Admin drop: gone from listings, announced.
            assert await c.drop("b1")
            assert not await c.drop("b1")
            assert convs(await c.list_convs("B")) == [("a2", "B", 2)]
            last = json.loads((await r.xrevrange("kv:own:log", count=1))[0][1]["msg"])
            assert (last["conv"], last["owner"], last["event"]) == ("b1", "B", "drop")

            # Expired records leave the listings and their index; touched ones stay.
            assert (await claim(c, "c1", 0)).ok and (await claim(c, "c2", 0)).ok
            await asyncio.sleep(0.25)
            assert await c.touch("c2", 1)
            await asyncio.sleep(0.25)  # c1 expired (400 ms), c2 has 150 ms left
            assert convs(await c.list_convs("C")) == [("c2", "C", 1)]
            assert await r.smembers("kv:srv:{C}:convs") == {"c2"}
            assert "c1" not in [x.conv for x in await c.list_convs()]

            await b.close()  # clean shutdown deletes the lease
            assert sorted(s.server_id for s in await a.servers()) == ["A", "C"]
        await r.aclose()

    run(main())
