"""A real `redis-server` per test: a free loopback port, no persistence, fault injection, teardown.

The ownership directory depends on Lua, pub/sub, Streams, expiry and restart semantics, which only
a real server has. `redis_server` starts Debian's binary (`apt-get install redis-server`; the
test is skipped only when the binary is absent), waits for PING and yields a `RedisServer` with
its `url` and `kill()` (SIGKILL), `restart()` (same port, data lost), `pause()` (SIGSTOP) and
`resume()` (SIGCONT). Teardown always kills it, paused or not.

Use it from a test module with `from redis_fixture import redis_server  # noqa: F401`.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT = 10.0


def free_port() -> int:
    """A port nothing listens on, chosen below the kernel's ephemeral range: a port the kernel hands
    out for `bind(0)` (a server's `--kv-port 0`, a client socket) can never take it meanwhile."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12_000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def ping(port: int, timeout: float = 0.2) -> bool:
    """Whether a Redis answers PING on the port (raw RESP: no client library involved)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process on 127.0.0.1; `restart()` keeps the port, so clients reconnect."""

    def __init__(self, binary: str, workdir: Path, port: int | None = None) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.log_path = workdir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self) -> None:
        assert self.proc is None, "already running"
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--daemonize", "no",
            "--logfile", "",
        ]  # fmt: skip
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while not ping(self.port):
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"redis-server exited at start:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer PING within {START_TIMEOUT} s:\n{self.log_tail()}")
            time.sleep(0.005)

    def kill(self) -> None:
        """SIGKILL (works on a paused process too) and reap."""
        if self.proc is None:
            return
        try:
            self.proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self.proc = None
        self.paused = False

    def restart(self) -> None:
        """SIGKILL, then start again on the same port: every key is gone (no persistence)."""
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections (kernel backlog), nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for this test (its own process and port: tests may kill it)."""
    binary = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    )
    if binary is None:
        pytest.skip("redis-server not found on PATH (Debian: apt-get install redis-server)")
    server: RedisServer | None = None
    for attempt in range(3):  # a free port can be taken between free_port() and bind
        server = RedisServer(binary, tmp_path)
        try:
            server.start()
            break
        except RuntimeError:
            if attempt == 2:
                raise
    assert server is not None
    try:
        yield server
    finally:
        server.kill()
