"""A server of a fleet holds a lease in Redis while it runs (seen by tools/kvctl), drops it when it
stops, and serves normally when Redis is unreachable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("redis")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from redis_fixture import free_port, redis_server  # noqa: E402, F401
from server_fixture import REPO, Server, http, server_env  # noqa: E402
from test_server import cache_home  # noqa: E402, F401


def kvctl_servers(url: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "kvctl"), "--redis", url, "--json", "servers"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_serving_server_holds_a_lease_and_drops_it_on_stop(redis_server, cache_home, tmp_path):
    server = Server(tmp_path / "s.log", ["--server-id", "node-a"], server_env(cache_home, DSUF_REDIS_URL=redis_server.url))
    try:
        server.wait_ready()
        server.wait_for_log("holds a lease")
        (lease,) = kvctl_servers(redis_server.url)
        # no cluster secret: the server transfers no caches, so it offers no transfer address
        assert lease["server_id"] == "node-a" and lease["ctrl_addr"] == "" and lease["transports"] == []
        assert "no --cluster-secret" in server.log()
    finally:
        assert server.stop() == 0
    assert kvctl_servers(redis_server.url) == []


def test_an_unreachable_redis_does_not_stop_the_server_from_serving(cache_home, tmp_path):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    server = Server(tmp_path / "s.log", ["--redis-url", dead], server_env(cache_home))
    try:
        server.wait_ready()
        body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status, _, _ = http("POST", server.url + "/v1/chat/completions", body)
        assert status == 200
    finally:
        assert server.stop() == 0
