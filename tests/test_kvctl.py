"""`tools/kvctl` (dsuf.kvcache.kvctl) against a real redis-server, run as a real subprocess.

Two `OwnershipDirectory` instances (servers A and B) live on an event loop in a background thread,
so their leases keep renewing while the test blocks on kvctl; kvctl itself must hold no lease.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("redis")

from dsuf.kvcache.ownership import OwnershipDirectory  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from redis_fixture import RedisServer, free_port, redis_server  # noqa: E402, F401

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
KVCTL = ROOT / "tools" / "kvctl"
LAYOUT = "dsv4.1-flash/kv1/bs64"
TIMEOUT = 15.0


def kvctl(url: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(KVCTL), *(["--redis", url] if url else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)


def ok(url: str, *args: str) -> str:
    p = kvctl(url, *args)
    assert p.returncode == 0, (args, p.returncode, p.stdout, p.stderr)
    assert p.stderr == "", p.stderr
    return p.stdout


@dataclass
class Cluster:
    url: str
    a: OwnershipDirectory
    b: OwnershipDirectory
    loop: asyncio.AbstractEventLoop
    closed: set[str]

    def close(self, d: OwnershipDirectory) -> None:
        """Stop the server's directory (deleting its lease), once."""
        if d.server_id not in self.closed:
            self.closed.add(d.server_id)
            self.call(d.close())

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT)

    def claim(self, d: OwnershipDirectory, conv: str, expected: int, tokens: int) -> None:
        res = self.call(d.claim(conv, expected, tokens=tokens, bytes_=tokens * 890, layout=LAYOUT))
        assert res.ok, res


@pytest.fixture
def cluster(redis_server: RedisServer) -> Iterator[Cluster]:  # noqa: F811
    """Servers A (c1, c2, c3) and B (c4) with live leases, on a loop in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def mk(sid: str, port: int, transports: list[str]) -> OwnershipDirectory:
        return OwnershipDirectory(
            redis_server.url, sid, ctrl_addr=f"127.0.0.1:{port}", transports=transports, op_timeout=2.0
        )

    async def make() -> tuple[OwnershipDirectory, OwnershipDirectory]:
        return mk("A", 7101, ["tcp", "rdma"]), mk("B", 7102, ["tcp"])

    a, b = asyncio.run_coroutine_threadsafe(make(), loop).result(TIMEOUT)
    c = Cluster(redis_server.url, a, b, loop, set())
    a.set_stats(3 * 1024 * 1024, 3)
    c.call(a.start())
    c.call(b.start())
    for conv, tokens in (("c1", 100), ("c2", 2000), ("c3", 30)):
        c.claim(a, conv, 0, tokens)
    c.claim(b, "c4", 0, 40)
    try:
        yield c
    finally:
        for d in (a, b):
            c.close(d)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_servers(cluster: Cluster) -> None:
    lines = ok(cluster.url, "servers").splitlines()
    assert lines[0].split() == ["SERVER", "CTRL", "BOOT", "TRANSPORTS", "BYTES", "ENTRIES", "TTL"]
    assert len(lines) == 3
    ra, rb = (ln.split() for ln in lines[1:])
    assert ra[:4] == ["A", "127.0.0.1:7101", cluster.a.boot_id[:8], "tcp,rdma"]
    assert ra[4:7] == ["3.0", "MiB", "3"] and ra[7].endswith("s")
    assert rb[:4] == ["B", "127.0.0.1:7102", cluster.b.boot_id[:8], "tcp"]
    assert len({len(ln) for ln in lines}) == 1  # aligned: the last column (TTL) is right-aligned

    got = json.loads(ok(cluster.url, "--json", "servers"))
    assert [s["server_id"] for s in got] == ["A", "B"]
    sa = got[0]
    assert (sa["ctrl_addr"], sa["boot_id"], sa["transports"]) == ("127.0.0.1:7101", cluster.a.boot_id, ["tcp", "rdma"])
    assert (sa["bytes_used"], sa["entries"]) == (3 * 1024 * 1024, 3)
    assert 0 < sa["ttl_ms"] <= 10_000


def test_list_and_filter(cluster: Cluster) -> None:
    lines = ok(cluster.url, "list").splitlines()
    assert lines[0].split() == ["CONV", "OWNER", "EPOCH", "TOKENS", "BYTES", "AGE"]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert sorted(rows) == ["c1", "c2", "c3", "c4"]
    assert rows["c2"][:6] == ["c2", "A", "1", "2000", "1.7", "MiB"]  # 1 780 000 bytes
    assert rows["c1"][4:6] == ["86.9", "KiB"] and rows["c4"][1] == "B"
    assert all(r[-1].endswith("s") for r in rows.values())  # age, just claimed

    lines = ok(cluster.url, "list", "--server", "A").splitlines()
    assert [ln.split()[0] for ln in lines[1:]] == ["c1", "c2", "c3"]
    got = json.loads(ok(cluster.url, "--json", "list", "--server", "B"))
    assert [(r["conv"], r["owner"], r["epoch"], r["tokens"], r["bytes"]) for r in got] == [("c4", "B", 1, 40, 40 * 890)]
    assert ok(cluster.url, "list", "--server", "nobody").strip() == "no conversations owned by nobody"
    assert json.loads(ok(cluster.url, "--json", "list", "--server", "nobody")) == []

    # Default URL from the environment; kvctl left no lease of its own behind.
    env = {**os.environ, "DSUF_REDIS_URL": cluster.url}
    p = kvctl("", "--json", "servers", env=env)
    assert p.returncode == 0, p.stderr
    assert [s["server_id"] for s in json.loads(p.stdout)] == ["A", "B"]


def test_show_handoff_dead_owner_and_drop(cluster: Cluster) -> None:
    out = ok(cluster.url, "show", "c1")
    fields = dict(ln.split(":", 1) for ln in out.splitlines())
    fields = {k: v.strip() for k, v in fields.items()}
    assert (fields["conv"], fields["owner"], fields["epoch"]) == ("c1", "A", "1")
    assert fields["boot"] == cluster.a.boot_id and fields["alive"].startswith("yes")
    assert fields["layout"] == LAYOUT and fields["tokens"] == "100"

    cluster.claim(cluster.b, "c1", 1, 150)  # handoff to B
    got = json.loads(ok(cluster.url, "--json", "show", "c1"))
    assert (got["owner"], got["epoch"], got["boot"], got["tokens"]) == ("B", 2, cluster.b.boot_id, 150)
    assert got["alive"] is True and got["lease"]["ctrl_addr"] == "127.0.0.1:7102"

    cluster.close(cluster.a)  # A goes away: its lease is deleted, its records stay
    got = json.loads(ok(cluster.url, "--json", "show", "c2"))
    assert (got["owner"], got["alive"], got["lease"]) == ("A", False, None)
    assert "alive:    no" in ok(cluster.url, "show", "c2")
    assert [s["server_id"] for s in json.loads(ok(cluster.url, "--json", "servers"))] == ["B"]

    out = ok(cluster.url, "drop", "c2")
    assert out.startswith("dropped c2 (owner A, epoch 1") and out.count("\n") == 1
    p = kvctl(cluster.url, "show", "c2")
    assert (p.returncode, p.stdout, p.stderr) == (1, "", "kvctl: no such conversation: c2\n")
    p = kvctl(cluster.url, "drop", "c2")
    assert (p.returncode, p.stderr) == (1, "kvctl: no such conversation: c2\n")
    got = json.loads(ok(cluster.url, "--json", "drop", "c3"))
    assert got["dropped"] == "c3" and got["record"]["owner"] == "A"
    assert [r["conv"] for r in json.loads(ok(cluster.url, "--json", "list"))] == ["c1", "c4"]


class Watcher:
    """A `kvctl watch` subprocess whose stderr is read by a thread (to wait for "watching")."""

    def __init__(self, url: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(KVCTL), "--redis", url, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            # As in a terminal: a suite run in the background (`pytest &`) ignores SIGINT, and so
            # would its children.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        self.err: queue.Queue[str] = queue.Queue()
        self.err_lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.put(line)

    def ready(self) -> str:
        line = self.err.get(timeout=TIMEOUT)
        self.err_lines.append(line)
        assert "watching kv:own:log" in line, line
        return line

    def finish(self) -> tuple[int, str, str]:
        try:
            out, _ = self.proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        while not self.err.empty():
            self.err_lines.append(self.err.get())
        return self.proc.returncode, out, "".join(self.err_lines)


def test_watch_prints_live_announcements(cluster: Cluster) -> None:
    human = Watcher(cluster.url, "watch", "--count", "2")
    as_json = Watcher(cluster.url, "--json", "watch", "--count", "2")
    try:
        human.ready()
        as_json.ready()
        cluster.claim(cluster.a, "w1", 0, 10)  # after both listen: neither saw c1..c4
        cluster.claim(cluster.b, "w1", 1, 20)
        rc, out, err = human.finish()
        assert rc == 0, err
        lines = out.splitlines()
        assert lines[0].split() == ["TIME", "EVENT", "CONV", "OWNER", "EPOCH"]
        assert [ln.split()[1:] for ln in lines[1:]] == [["claim", "w1", "A", "1"], ["claim", "w1", "B", "2"]]
        assert all(len(ln.split()[0]) == len("12:34:56.789") for ln in lines[1:])

        rc, out, err = as_json.finish()
        assert rc == 0, err
        evs = [json.loads(ln) for ln in out.splitlines()]
        assert [(e["event"], e["conv"], e["owner"], e["epoch"]) for e in evs] == [
            ("claim", "w1", "A", 1),
            ("claim", "w1", "B", 2),
        ]
        assert evs[0]["boot"] == cluster.a.boot_id and evs[1]["boot"] == cluster.b.boot_id
        ids = [tuple(map(int, e["id"].split("-"))) for e in evs]
        assert ids[0] < ids[1]
        assert all(e["ts"] == int(e["id"].split("-")[0]) for e in evs)
    finally:
        for w in (human, as_json):
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()

    # --from replays the retained log (here the four setup claims, then w1's first).
    p = kvctl(cluster.url, "--json", "watch", "--from", "0", "--count", "5")
    assert p.returncode == 0 and p.stderr == "kvctl: watching kv:own:log after 0 (Ctrl-C to stop)\n", p.stderr
    assert [(e["conv"], e["epoch"]) for e in map(json.loads, p.stdout.splitlines())] == [
        ("c1", 1), ("c2", 1), ("c3", 1), ("c4", 1), ("w1", 1),
    ]  # fmt: skip


def test_watch_ctrl_c_exits_quietly(cluster: Cluster) -> None:
    w = Watcher(cluster.url, "watch")
    try:
        w.ready()
        w.proc.send_signal(signal.SIGINT)
        rc, out, err = w.finish()
        assert rc == 0 and "Traceback" not in err, err
        assert out.splitlines()[0].split()[0] == "TIME"
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


def test_empty_directory(redis_server: RedisServer) -> None:  # noqa: F811
    assert ok(redis_server.url, "servers") == "no servers\n"
    assert ok(redis_server.url, "list") == "no conversations\n"
    assert json.loads(ok(redis_server.url, "--json", "servers")) == []
    assert json.loads(ok(redis_server.url, "--json", "list")) == []
    p = kvctl(redis_server.url, "--json", "show", "nope")
    assert (p.returncode, p.stdout, p.stderr) == (1, "", "kvctl: no such conversation: nope\n")


def test_unreachable_redis() -> None:
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"  # nothing listens there
    for args in (["servers"], ["--json", "list"], ["show", "c1"], ["watch", "--count", "1"]):
        p = kvctl(url, *args)  # watch too: it must not retry a dead Redis forever
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert p.stderr.count("\n") == 1 and p.stderr.startswith("kvctl: Redis unavailable at "), p.stderr
        assert "Traceback" not in p.stderr and "secret" not in p.stderr and p.stdout == ""
    p = kvctl("http://127.0.0.1:1", "drop", "c1")
    assert p.returncode == 2 and p.stderr.startswith("kvctl: bad Redis URL") and p.stderr.count("\n") == 1
