"""A real `dsuf serve` process for the server tests: a free port, /readyz polling, the log, teardown.

`Server` starts `python -m dsuf serve --port P ...` with its stdout and stderr in a log file, so the
tests can assert on what it logged; `stop()` always ends it (SIGTERM, then SIGKILL) and also ends
its worker if the worker outlived it. Plain-HTTP helpers (`http`, `sse_stream`) cover what the
OpenAI client cannot express: raw bodies, status codes, headers, the SSE framing, disconnects.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import aiohttp
from redis_fixture import free_port

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 120.0


def server_env(cache_home: Path, **extra: str) -> dict[str, str]:
    """The environment of a server: ours without any DSUF_* setting, plus the test cache and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSUF_")}
    env.update(XDG_CACHE_HOME=str(cache_home), PYTHONUNBUFFERED="1", **extra)
    return env


def http(method: str, url: str, body: bytes | str | dict | None = None, headers: dict | None = None,
         timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one plain HTTP request; 4xx/5xx are answers, not exceptions."""
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    hdrs = {"Content-Type": "application/json"} if body is not None else {}
    hdrs.update(headers or {})
    req = urllib.request.Request(url, data=body, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


class SSEStream:
    """An open streaming chat-completions response read with aiohttp, one SSE event at a time.

    `events()` yields the `data:` payloads as strings ("[DONE]" included); `close()` drops the
    connection, which is how a client going away looks to the server."""

    def __init__(self, session: aiohttp.ClientSession, resp: aiohttp.ClientResponse) -> None:
        self.session, self.resp = session, resp
        self.raw = b""  # every byte received, to check the framing
        self._buf = b""

    @property
    def status(self) -> int:
        return self.resp.status

    async def next_event(self) -> str | None:
        """The next event's data, or None at the end of the body."""
        while b"\n\n" not in self._buf:
            chunk = await self.resp.content.readany()
            if not chunk:
                return None
            self.raw += chunk
            self._buf += chunk
        event, self._buf = self._buf.split(b"\n\n", 1)
        text = event.decode()
        assert text.startswith("data: "), f"not an SSE data event: {text!r}"
        return text[len("data: "):]

    async def next_json(self) -> dict | None:
        data = await self.next_event()
        return None if data is None or data == "[DONE]" else json.loads(data)

    async def read_until_content(self, count: int) -> list[dict]:
        """Read chunks until `count` of them carried content or reasoning text."""
        seen, out = 0, []
        while seen < count:
            chunk = await self.next_json()
            assert chunk is not None, f"the stream ended after {out}"
            out.append(chunk)
            delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
            seen += bool(delta.get("content") or delta.get("reasoning_content"))
        return out

    async def rest(self) -> list[str]:
        """Every remaining event's data until the body ends."""
        out = []
        while (data := await self.next_event()) is not None:
            out.append(data)
        return out

    async def close(self) -> None:
        self.resp.close()
        await self.session.close()


async def sse_stream(port: int, body: dict, headers: dict | None = None) -> SSEStream:
    """POST a streaming chat request; returns once the response headers are in."""
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=60))
    try:
        resp = await session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**body, "stream": True}, headers=headers)
    except BaseException:
        await session.close()
        raise
    return SSEStream(session, resp)


class Server:
    """One `dsuf serve` process on a free port."""

    def __init__(self, log_path: Path, args: list[str], env: dict[str, str]) -> None:
        self.log_path = log_path
        self._args, self._env = args, env
        self.readyz_history: list[int | str] = []  # every /readyz answer while waiting ("refused" = no listener yet)
        self.loading_probe: object = None
        self._spawn()

    def _spawn(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsuf", "serve", "--port", str(self.port), *self._args],
            stdout=self._log_file, stderr=subprocess.STDOUT, env=self._env, cwd=REPO,
        )

    def _lost_its_port(self) -> bool:
        """The process exited because another process bound its port between `free_port()` and its own bind."""
        return self.proc.returncode != 0 and any(
            "address already in use" in line and str(self.port) in line for line in self.log().splitlines())

    # ---- the log ---------------------------------------------------------------------------------

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log()
            if text in log:
                return log
            time.sleep(0.02)
        raise AssertionError(f"{text!r} not logged within {timeout} s; log:\n{self.log()}")

    def worker_pid(self) -> int:
        """The pid of the worker started last."""
        pids = re.findall(r"worker started \(pid (\d+),", self.log())
        assert pids, f"no 'worker started (pid N, ...)' line in the log:\n{self.log()}"
        return int(pids[-1])

    # ---- lifecycle ---------------------------------------------------------------------------------

    def readyz(self) -> int | str:
        try:
            return http("GET", self.url + "/readyz", timeout=5)[0]
        except (urllib.error.URLError, ConnectionError, OSError):
            return "refused"

    def wait_ready(self, timeout: float = READY_TIMEOUT, while_loading: Callable[[Server], object] | None = None) -> None:
        """Poll /readyz (every 20 ms, from the moment the process starts) until 200.

        `while_loading(server)` runs once, at the first 503; its result is kept as `loading_probe`."""
        deadline = time.monotonic() + timeout
        respawns = 2
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if respawns and self._lost_its_port():
                    respawns -= 1
                    self._log_file.close()
                    self._spawn()
                    continue
                raise AssertionError(f"the server exited with {self.proc.returncode} before it was ready; log:\n{self.log()}")
            status = self.readyz()
            self.readyz_history.append(status)
            if status == 200:
                return
            if status == 503 and while_loading is not None and self.loading_probe is None:
                self.loading_probe = while_loading(self)
            time.sleep(0.02)
        raise AssertionError(f"/readyz not 200 within {timeout} s (saw {sorted(set(map(str, self.readyz_history)))}); log:\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> int:
        """End the server (SIGTERM, then SIGKILL) and any worker that outlived it; returns the exit code."""
        workers = [int(pid) for pid in re.findall(r"worker started \(pid (\d+),", self.log())]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for worker in workers:
            _kill_if_worker(worker)
        self._log_file.close()
        return self.proc.returncode


def _kill_if_worker(pid: int, grace: float = 3.0) -> None:
    """The worker leaves by itself within ~1 s of its parent; kill it by pid if it did not."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return
        if b"dsuf.worker.main" not in cmdline:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
