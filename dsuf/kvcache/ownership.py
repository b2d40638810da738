"""The Redis ownership directory: which server holds each conversation's KV cache.

Every server keeps the KV caches of its conversations in host memory. A turn that lands on
another server fetches the cache from its owner and takes ownership over. Redis is the meeting
point (spec `kv_sharing.md` §4.2):

* "Who owns conversation C" is a record with a fencing token, the `epoch`. A handoff is one Lua
  script that compares and bumps the epoch, so two servers racing for C cannot both win.
* "Is that owner still alive, and is it still the process that holds the memory" is a lease
  with a TTL that carries a `boot_id` (a fresh UUID per process start). A record whose `boot`
  differs from the lease's `boot_id` belongs to a previous incarnation: its memory is gone.
* Announcements of claims go out on pub/sub (a hint, lost while disconnected) and on a Stream
  (catch-up by last id), as in Dynamo's event plane.
* `kv:cluster` is a UUID created by the first server. If it changes or vanishes, Redis lost its
  data (a restart without persistence): the `on_cluster_reset` callback tells the server to
  re-claim what it holds.

Redis is never the last word: replication is asynchronous, so a failover can lose a claim and
epochs can regress. The owner checks the epoch of every export request and the fetcher checks the
buffer header; the worst case of a wrong record is a recompute. In the same spirit, a Redis that
is down or slow never blocks a turn: request-path calls run under `op_timeout` and raise
`DirectoryUnavailable`, which callers treat as "serve a local hit, or recompute".

Key layout (`P` is the prefix, "kv" by default):

=================================  =======  ===================================================
key                                type     contents
=================================  =======  ===================================================
``P:cluster``                      STRING   cluster UUID, ``SET NX`` by the first server
``P:srv:{server_id}``              STRING   lease, JSON {ctrl_addr, boot_id, transports,
                                            bytes_used, entries}; ``SET PX lease_ms``, renewed
                                            every lease_ms/3
``P:srv:{server_id}:convs``        SET      conversation ids claimed by that server (an index
                                            for listings; pruned lazily, expires with the last
                                            record it could hold)
``P:conv:{conv_id}``               HASH     owner, epoch, boot, tokens, bytes, ts (ms, Redis
                                            clock), layout; ``PEXPIRE retention_ms``, renewed
                                            by every claim and touch
``P:own``                          channel  JSON {conv, owner, epoch, boot, event}, event in
                                            claim | release | drop
``P:own:log``                      STREAM   the same JSON in field ``msg``, ``MAXLEN ~ 10000``
=================================  =======  ===================================================

The braces are Redis Cluster hash tags: a conversation's record hashes by its id alone, and a
server's lease and index share a slot. The claim, release and drop scripts nevertheless touch a
record, leases, indexes and the log together, which Cluster only allows within one slot; for a
Cluster deployment pass ``prefix="{kv}"`` (only the first tag counts, so every key then lands in
one slot). This module talks to a single Redis (or a Sentinel-managed primary) through its URL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

T = TypeVar("T")

LOG_MAXLEN = 10000  # approximate length of the announcement stream

# --- Lua -----------------------------------------------------------------------------------------
# Scripts run atomically; redis-py's registered scripts reload themselves after NOSCRIPT (a Redis
# restart). Index keys of *other* servers are derived inside the scripts from the prefix, which a
# single Redis allows (see the module docstring for Cluster).

# KEYS: lease, cluster. ARGV: lease json, lease_ms, boot_id, takeover (0/1), fresh cluster uuid.
# Returns {status, cluster_id}; status "superseded" when a live lease of another boot exists and
# this is not the first heartbeat of the process (a newer incarnation replaced us).
_HEARTBEAT = """
local cur = redis.call('GET', KEYS[1])
local status = 'ok'
if cur and ARGV[4] == '0' then
  local ok, d = pcall(cjson.decode, cur)
  if ok and type(d) == 'table' and d.boot_id ~= ARGV[3] then status = 'superseded' end
end
if status == 'ok' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
local c = redis.call('GET', KEYS[2])
if not c then
  c = ARGV[5]
  redis.call('SET', KEYS[2], c)
end
return {status, c}
"""

# Shared by the scripts below: the announcement, on the channel and the stream.
_ANNOUNCE = """
local function announce(conv, owner, epoch, boot, event)
  local msg = cjson.encode({conv = conv, owner = owner, epoch = epoch, boot = boot, event = event})
  redis.call('PUBLISH', ARGV[1] .. ':own', msg)
  redis.call('XADD', ARGV[1] .. ':own:log', 'MAXLEN', '~', ARGV[2], '*', 'msg', msg)
end
local function index_key(server) return ARGV[1] .. ':srv:{' .. server .. '}:convs' end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: record, claimant's lease. ARGV: prefix, log maxlen, conv, me, boot, expected epoch,
# tokens, bytes, layout, retention_ms.
# Returns {1, new_epoch, me} | {-1, cur_epoch, cur_owner} (epoch mismatch)
#       | {-2, cur_epoch, cur_owner} (the claimant holds no lease of its own boot).
_CLAIM = _ANNOUNCE + """
local conv, me, boot = ARGV[3], ARGV[4], ARGV[5]
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'owner')
local epoch = tonumber(cur[1]) or 0
local owner = cur[2] or ''
local lease = redis.call('GET', KEYS[2])
local ok, d = false, nil
if lease then ok, d = pcall(cjson.decode, lease) end
if not (ok and type(d) == 'table' and d.boot_id == boot) then return {-2, epoch, owner} end
if epoch ~= tonumber(ARGV[6]) then return {-1, epoch, owner} end
local new = epoch + 1
redis.call('HSET', KEYS[1], 'owner', me, 'epoch', new, 'boot', boot, 'ts', now_ms(),
           'tokens', ARGV[7], 'bytes', ARGV[8], 'layout', ARGV[9])
redis.call('PEXPIRE', KEYS[1], ARGV[10])
if owner ~= '' and owner ~= me then redis.call('SREM', index_key(owner), conv) end
redis.call('SADD', index_key(me), conv)
redis.call('PEXPIRE', index_key(me), ARGV[10])
announce(conv, me, new, boot, 'claim')
return {1, new, me}
"""

# KEYS: record. ARGV: prefix, log maxlen, conv, me, boot, epoch. Returns 1 if released.
_RELEASE = _ANNOUNCE + """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'boot')
if cur[1] ~= ARGV[4] or tonumber(cur[2]) ~= tonumber(ARGV[6]) or cur[3] ~= ARGV[5] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', index_key(ARGV[4]), ARGV[3])
announce(ARGV[3], ARGV[4], tonumber(ARGV[6]), ARGV[5], 'release')
return 1
"""

# KEYS: record. ARGV: prefix, log maxlen, conv, me, boot, epoch, retention_ms, tokens, bytes
# (empty: unchanged). Returns 1 if the record is still ours and was refreshed.
_TOUCH = _ANNOUNCE + """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'boot')
if cur[1] ~= ARGV[4] or tonumber(cur[2]) ~= tonumber(ARGV[6]) or cur[3] ~= ARGV[5] then return 0 end
redis.call('HSET', KEYS[1], 'ts', now_ms())
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'tokens', ARGV[8]) end
if ARGV[9] ~= '' then redis.call('HSET', KEYS[1], 'bytes', ARGV[9]) end
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('SADD', index_key(ARGV[4]), ARGV[3])
if redis.call('PTTL', index_key(ARGV[4])) < tonumber(ARGV[7]) then
  redis.call('PEXPIRE', index_key(ARGV[4]), ARGV[7])
end
return 1
"""

# KEYS: record. ARGV: prefix, log maxlen, conv. Admin removal, whoever owns it. Returns 1 if dropped.
_DROP = _ANNOUNCE + """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'boot')
if not cur[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', index_key(cur[1]), ARGV[3])
announce(ARGV[3], cur[1], tonumber(cur[2]) or 0, cur[3] or '', 'drop')
return 1
"""

# KEYS: a server's index. ARGV: prefix, log maxlen (unused), server id. Removes members whose
# record expired or moved to another owner (atomically, so a concurrent claim is not undone) and
# returns the rest.
_PRUNE = _ANNOUNCE + """
local live = {}
for _, conv in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local owner = redis.call('HGET', ARGV[1] .. ':conv:{' .. conv .. '}', 'owner')
  if owner == ARGV[3] then table.insert(live, conv) else redis.call('SREM', KEYS[1], conv) end
end
return live
"""


class DirectoryUnavailable(Exception):
    """Redis is unreachable, slow or failing: treat as a miss (recompute), never wait on it."""


@dataclass(frozen=True)
class Keys:
    """The key names under one prefix (see the module docstring)."""

    prefix: str = "kv"

    @property
    def cluster(self) -> str:
        return f"{self.prefix}:cluster"

    @property
    def channel(self) -> str:
        return f"{self.prefix}:own"

    @property
    def log(self) -> str:
        return f"{self.prefix}:own:log"

    def conv(self, conv: str) -> str:
        return f"{self.prefix}:conv:{{{conv}}}"

    def server(self, server_id: str) -> str:
        return f"{self.prefix}:srv:{{{server_id}}}"

    def server_convs(self, server_id: str) -> str:
        return f"{self.prefix}:srv:{{{server_id}}}:convs"


@dataclass(frozen=True)
class ConvRecord:
    """Who owns a conversation's KV cache, at which epoch, in which process incarnation."""

    conv: str
    owner: str
    epoch: int
    boot: str
    tokens: int
    bytes: int
    ts: int  # ms since the Unix epoch, Redis clock, of the last claim or touch
    layout: str


@dataclass(frozen=True)
class ServerLease:
    """A live server's lease: where to reach it and which incarnation it is."""

    server_id: str
    ctrl_addr: str
    boot_id: str
    transports: list[str]
    bytes_used: int = 0
    entries: int = 0
    ttl_ms: int = -1  # remaining lease time when read
    extra: dict[str, Any] = field(default_factory=dict)  # unknown fields, for newer writers


@dataclass(frozen=True)
class ClaimResult:
    """Outcome of a claim. On failure, `epoch`/`owner` are the current record's (0/None if none)."""

    ok: bool
    epoch: int
    owner: str | None
    reason: Literal["ok", "epoch", "no_lease"]


ResetCallback = Callable[[], Awaitable[None] | None]


def _being_cancelled() -> bool:
    """Whether the running task was asked to stop. redis-py awaits socket writes through
    asyncio.wait_for, which on Python 3.11 drops a cancellation that lands as the write
    completes (cpython gh-86296): the command then goes on, and a retry loop would never end."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _cancellable(aw: Awaitable[T]) -> T:
    """Await `aw`, then honour a cancellation it swallowed (a short call: at most its own length late)."""
    try:
        result = await aw
    except (RedisError, OSError, TimeoutError) as e:
        if _being_cancelled():
            raise asyncio.CancelledError from e
        raise
    if _being_cancelled():
        raise asyncio.CancelledError
    return result


def _int(v: Any, default: int = 0) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _record(conv: str, h: dict[str, str]) -> ConvRecord | None:
    if not h or "owner" not in h:
        return None
    return ConvRecord(
        conv=conv,
        owner=h["owner"],
        epoch=_int(h.get("epoch")),
        boot=h.get("boot", ""),
        tokens=_int(h.get("tokens")),
        bytes=_int(h.get("bytes")),
        ts=_int(h.get("ts")),
        layout=h.get("layout", ""),
    )


def _lease(server_id: str, raw: str | None, ttl_ms: int) -> ServerLease | None:
    if raw is None:
        return None
    try:
        d = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(d, dict):
        return None
    known = {"ctrl_addr", "boot_id", "transports", "bytes_used", "entries"}
    return ServerLease(
        server_id=server_id,
        ctrl_addr=str(d.get("ctrl_addr", "")),
        boot_id=str(d.get("boot_id", "")),
        transports=list(d.get("transports") or []),
        bytes_used=_int(d.get("bytes_used")),
        entries=_int(d.get("entries")),
        ttl_ms=_int(ttl_ms, -1),
        extra={k: v for k, v in d.items() if k not in known},
    )


def _between(s: str, head: str, tail: str) -> str | None:
    if s.startswith(head) and s.endswith(tail) and len(s) >= len(head) + len(tail):
        return s[len(head) : len(s) - len(tail)]
    return None


class OwnershipDirectory:
    """One server's view of the ownership directory: its lease, its claims, lookups of others.

    `start()` must run before claims succeed (a claim needs the server's own lease). All
    request-path methods (lookup, server, owner_alive, claim, release, touch) finish within about
    `op_timeout` (twice that for a claim that first renews a lapsed lease) or raise
    `DirectoryUnavailable`.
    """

    def __init__(
        self,
        redis_url: str,
        server_id: str,
        *,
        ctrl_addr: str,
        transports: list[str],
        lease_ms: int = 10000,
        retention_ms: int = 30 * 60 * 1000,
        op_timeout: float = 0.2,
        admin_timeout: float = 5.0,
        prefix: str = "kv",
    ) -> None:
        if lease_ms <= 0 or retention_ms <= 0 or op_timeout <= 0:
            raise ValueError("lease_ms, retention_ms and op_timeout must be positive")
        self.redis_url = redis_url
        self.server_id = server_id
        self.ctrl_addr = ctrl_addr
        self.transports = list(transports)
        self.lease_ms = lease_ms
        self.retention_ms = retention_ms
        self.op_timeout = op_timeout
        self.admin_timeout = admin_timeout
        self.keys = Keys(prefix)
        self.boot_id = str(uuid.uuid4())
        self.cluster_id: str | None = None  # last cluster id seen; None before the first heartbeat
        self.superseded = False  # a newer process with our server id holds the lease
        self._bytes_used = 0
        self._entries = 0
        self._took_over = False  # our first successful heartbeat replaced any older incarnation
        self._reset_callbacks: list[ResetCallback] = []
        self._bg: set[asyncio.Task[None]] = set()
        self._lease_task: asyncio.Task[None] | None = None
        self._hb_lock = asyncio.Lock()
        self._redis = self._client(op_timeout)
        r = self._redis
        self._s_heartbeat = r.register_script(_HEARTBEAT)
        self._s_claim = r.register_script(_CLAIM)
        self._s_release = r.register_script(_RELEASE)
        self._s_touch = r.register_script(_TOUCH)
        self._s_drop = r.register_script(_DROP)
        self._s_prune = r.register_script(_PRUNE)
        self._scripts = [self._s_claim, self._s_release, self._s_touch, self._s_drop, self._s_prune]
        self._scripts_loaded_for: str | None = None  # cluster id the scripts were last loaded for

    def _client(self, socket_timeout: float | None) -> aioredis.Redis:
        # One quick retry reconnects a pooled connection that died with a Redis restart; the
        # outer asyncio timeout bounds the whole call regardless.
        return aioredis.Redis.from_url(
            self.redis_url,
            decode_responses=True,
            socket_timeout=socket_timeout,
            socket_connect_timeout=self.op_timeout,
            retry=Retry(NoBackoff(), 1),
            health_check_interval=0,
        )

    async def _op(self, fn: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        """Run one Redis interaction under a deadline; every failure becomes DirectoryUnavailable."""
        try:
            async with asyncio.timeout(timeout or self.op_timeout):
                return await _cancellable(fn())
        except (RedisError, OSError, TimeoutError) as e:
            raise DirectoryUnavailable(f"redis {self.redis_url}: {type(e).__name__}: {e}") from e

    # --- lifecycle and lease -----------------------------------------------------------------

    def on_cluster_reset(self, callback: ResetCallback) -> None:
        """Register a callback for "Redis lost its data": the server should re-claim what it holds.

        It runs as its own task (a re-claim may take longer than a lease period)."""
        self._reset_callbacks.append(callback)

    def set_stats(self, bytes_used: int, entries: int) -> None:
        """Memory figures published with the next lease renewal (for kvctl and placement)."""
        self._bytes_used = int(bytes_used)
        self._entries = int(entries)

    async def start(self) -> None:
        """Write the lease once (best effort: Redis may be down) and start renewing it."""
        if self._lease_task is not None:
            return
        try:
            await self.heartbeat()
        except DirectoryUnavailable as e:
            log.warning("kv ownership: no lease yet for %s (%s); retrying in the background", self.server_id, e)
        self._lease_task = asyncio.create_task(self._lease_loop(), name=f"kv-lease-{self.server_id}")

    async def close(self, *, drop_lease: bool = True) -> None:
        """Stop renewing; by default also delete our lease so peers stop fetching from us at once."""
        tasks = [t for t in [self._lease_task, *self._bg] if t is not None]
        self._lease_task = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if drop_lease:
            try:
                await self._op(
                    lambda: self._redis.eval(
                        "local c = redis.call('GET', KEYS[1]) "
                        "if c then local ok, d = pcall(cjson.decode, c) "
                        "if ok and type(d) == 'table' and d.boot_id == ARGV[1] then "
                        "return redis.call('DEL', KEYS[1]) end end return 0",
                        1,
                        self.keys.server(self.server_id),
                        self.boot_id,
                    )
                )
            except DirectoryUnavailable as e:
                log.info("kv ownership: lease of %s not deleted at close (%s)", self.server_id, e)
        await self._redis.aclose()

    async def heartbeat(self) -> None:
        """Renew the lease now and check the cluster id (the lease loop does this every lease/3)."""
        async with self._hb_lock:
            lease = json.dumps(
                {
                    "ctrl_addr": self.ctrl_addr,
                    "boot_id": self.boot_id,
                    "transports": self.transports,
                    "bytes_used": self._bytes_used,
                    "entries": self._entries,
                }
            )
            takeover = "0" if self._took_over else "1"
            status, cluster = await self._op(
                lambda: self._s_heartbeat(
                    keys=[self.keys.server(self.server_id), self.keys.cluster],
                    args=[lease, self.lease_ms, self.boot_id, takeover, str(uuid.uuid4())],
                )
            )
            if status == "ok":
                self._took_over = True
                if self.superseded:
                    log.warning("kv ownership: %s holds its lease again (boot %s)", self.server_id, self.boot_id)
                self.superseded = False
            elif not self.superseded:
                self.superseded = True
                log.error(
                    "kv ownership: another process with server id %s holds the lease; this one (boot %s) is stale",
                    self.server_id,
                    self.boot_id,
                )
            old, self.cluster_id = self.cluster_id, cluster
            if old is not None and old != cluster:
                log.warning("kv ownership: cluster id changed %s -> %s: Redis lost its data", old, cluster)
                for cb in self._reset_callbacks:
                    t = asyncio.create_task(self._run_callback(cb), name="kv-cluster-reset")
                    self._bg.add(t)
                    t.add_done_callback(self._bg.discard)
            if self._scripts_loaded_for != cluster:
                # Load the scripts up front, so a burst of first claims (or the first claims after
                # a Redis restart) does not each pay NOSCRIPT + SCRIPT LOAD.
                await self._op(self._load_scripts)
                self._scripts_loaded_for = cluster

    async def _load_scripts(self) -> None:
        async with self._redis.pipeline(transaction=False) as p:
            for sc in self._scripts:
                p.script_load(sc.script)
            await p.execute()

    async def _run_callback(self, cb: ResetCallback) -> None:
        try:
            res = cb()
            if res is not None:
                await res
        except Exception:
            log.exception("kv ownership: on_cluster_reset callback failed")

    async def _lease_loop(self) -> None:
        interval = self.lease_ms / 3000
        down = False
        while True:
            try:
                await self.heartbeat()
                if down:
                    log.warning("kv ownership: Redis reachable again, lease of %s renewed", self.server_id)
                down = False
                await asyncio.sleep(interval)
            except DirectoryUnavailable as e:
                if not down:
                    log.warning("kv ownership: lease renewal of %s failed (%s); retrying", self.server_id, e)
                down = True
                await asyncio.sleep(min(interval, 0.5))
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end the lease silently
                log.exception("kv ownership: lease loop error")
                await asyncio.sleep(interval)

    # --- request path ------------------------------------------------------------------------

    async def lookup(self, conv: str) -> ConvRecord | None:
        """The conversation's record, or None when no server holds it."""
        h = await self._op(lambda: self._redis.hgetall(self.keys.conv(conv)))
        return _record(conv, h)

    async def lookup_many(self, convs: list[str]) -> list[ConvRecord | None]:
        """The records of several conversations in one round trip (None where there is none)."""
        if not convs:
            return []

        async def get() -> list[dict[str, str]]:
            async with self._redis.pipeline(transaction=False) as p:
                for conv in convs:
                    p.hgetall(self.keys.conv(conv))
                return await p.execute()

        return [_record(c, h) for c, h in zip(convs, await self._op(get))]

    async def server(self, server_id: str) -> ServerLease | None:
        """A server's lease, or None when it lapsed (the server is dead or partitioned)."""

        async def get() -> tuple[str | None, int]:
            async with self._redis.pipeline(transaction=False) as p:
                p.get(self.keys.server(server_id))
                p.pttl(self.keys.server(server_id))
                raw, ttl = await p.execute()
            return raw, ttl

        raw, ttl = await self._op(get)
        return _lease(server_id, raw, ttl)

    async def owner_alive(self, rec: ConvRecord) -> bool:
        """Whether the record's owner holds a lease *and* is the incarnation that wrote the record."""
        lease = await self.server(rec.owner)
        return lease is not None and lease.boot_id == rec.boot

    def is_mine(self, rec: ConvRecord) -> bool:
        """Whether this process (not an earlier one with our id) wrote the record."""
        return rec.owner == self.server_id and rec.boot == self.boot_id

    async def claim(self, conv: str, expected_epoch: int, *, tokens: int, bytes_: int, layout: str) -> ClaimResult:
        """Take ownership if the record is still at `expected_epoch` (0: no record); announce it.

        If our own lease is missing (e.g. Redis restarted since the last renewal), renew it once
        and retry, so a claim right after a Redis restart works. A directory that was not
        started (or was closed, or was superseded by a newer process with our id) cannot claim."""

        async def once() -> list[Any]:
            return await self._s_claim(
                keys=[self.keys.conv(conv), self.keys.server(self.server_id)],
                args=[
                    self.keys.prefix,
                    LOG_MAXLEN,
                    conv,
                    self.server_id,
                    self.boot_id,
                    int(expected_epoch),
                    int(tokens),
                    int(bytes_),
                    layout,
                    self.retention_ms,
                ],
            )

        code, epoch, owner = await self._op(once)
        if code == -2 and self._lease_task is not None and not self.superseded:
            await self.heartbeat()
            code, epoch, owner = await self._op(once)
        owner = owner or None
        if code == 1:
            return ClaimResult(True, int(epoch), owner, "ok")
        return ClaimResult(False, int(epoch), owner, "epoch" if code == -1 else "no_lease")

    async def release(self, conv: str, epoch: int) -> bool:
        """Delete the record if we still own it at `epoch` (a stale owner cannot); announce it."""
        res = await self._op(
            lambda: self._s_release(
                keys=[self.keys.conv(conv)],
                args=[self.keys.prefix, LOG_MAXLEN, conv, self.server_id, self.boot_id, int(epoch)],
            )
        )
        return bool(res)

    async def touch(self, conv: str, epoch: int, *, tokens: int | None = None, bytes_: int | None = None) -> bool:
        """Refresh the retention (and optionally the sizes) if we still own it at `epoch`."""
        res = await self._op(
            lambda: self._s_touch(
                keys=[self.keys.conv(conv)],
                args=[
                    self.keys.prefix,
                    LOG_MAXLEN,
                    conv,
                    self.server_id,
                    self.boot_id,
                    int(epoch),
                    self.retention_ms,
                    "" if tokens is None else int(tokens),
                    "" if bytes_ is None else int(bytes_),
                ],
            )
        )
        return bool(res)

    # --- admin and tools (SCAN-based, longer deadline) ------------------------------------------

    async def _records(self, convs: list[str]) -> list[ConvRecord]:
        async with self._redis.pipeline(transaction=False) as p:
            for c in convs:
                p.hgetall(self.keys.conv(c))
            hs = await p.execute()
        return [r for c, h in zip(convs, hs) if (r := _record(c, h)) is not None]

    async def list_convs(self, server_id: str | None = None) -> list[ConvRecord]:
        """All records, or those owned by `server_id` (its index, pruned of expired/moved ids)."""

        async def by_server() -> list[ConvRecord]:
            assert server_id is not None
            convs = await self._s_prune(keys=[self.keys.server_convs(server_id)], args=[self.keys.prefix, 0, server_id])
            return [r for r in await self._records(sorted(convs)) if r.owner == server_id]

        async def every() -> list[ConvRecord]:
            head, tail = self.keys.conv(""), "}"
            head = head[: -len(tail)]
            convs = []
            async for k in self._redis.scan_iter(match=f"{head}*{tail}", count=1000, _type="hash"):
                if (c := _between(k, head, tail)) is not None:
                    convs.append(c)
            return await self._records(sorted(set(convs)))

        return await self._op(by_server if server_id is not None else every, self.admin_timeout)

    async def servers(self) -> list[ServerLease]:
        """Every server holding a lease, sorted by id."""

        async def get() -> list[ServerLease]:
            head = self.keys.server("")[:-1]
            ids = []
            async for k in self._redis.scan_iter(match=f"{head}*}}", count=1000, _type="string"):
                if (s := _between(k, head, "}")) is not None:
                    ids.append(s)
            ids = sorted(set(ids))
            async with self._redis.pipeline(transaction=False) as p:
                for s in ids:
                    p.get(self.keys.server(s))
                    p.pttl(self.keys.server(s))
                res = await p.execute()
            out = [_lease(s, res[2 * i], res[2 * i + 1]) for i, s in enumerate(ids)]
            return [x for x in out if x is not None]

        return await self._op(get, self.admin_timeout)

    async def drop(self, conv: str) -> bool:
        """Admin: delete a record whoever owns it (announced as event "drop")."""
        res = await self._op(
            lambda: self._s_drop(keys=[self.keys.conv(conv)], args=[self.keys.prefix, LOG_MAXLEN, conv]),
            self.admin_timeout,
        )
        return bool(res)

    async def watch(self, last_id: str = "$", *, block_ms: int = 1000, count: int = 100) -> AsyncIterator[dict[str, Any]]:
        """Announcements from the stream after `last_id` ("$": from now), forever.

        Each item is the announcement dict plus "id", its stream id: pass the last one back to
        resume after a restart of the watcher. Lost connections are retried internally from the
        last id delivered, so nothing is skipped (unless it was trimmed past MAXLEN). "$" is
        resolved to the stream's current tail first, for the same reason."""
        # No socket timeout (redis-py would bound writes with asyncio.wait_for, see _being_cancelled):
        # a deadline per read instead, so that a cancellation always ends the watch at once.
        client = self._client(None)
        deadline = block_ms / 1000 + max(1.0, self.op_timeout)
        delay = 0.05
        try:
            while True:
                try:
                    async with asyncio.timeout(deadline):
                        if last_id == "$":
                            tail = await client.xrevrange(self.keys.log, "+", "-", count=1)
                            last_id = tail[0][0] if tail else "0-0"
                        resp = await client.xread({self.keys.log: last_id}, count=count, block=block_ms)
                    delay = 0.05
                except (RedisError, OSError) as e:  # TimeoutError included
                    log.info("kv watch: %s; retrying from %s", e, last_id)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                for _stream, entries in resp or []:
                    for sid, fields in entries:
                        last_id = sid
                        try:
                            msg = json.loads(fields.get("msg", "{}"))
                        except ValueError:
                            msg = {"raw": fields}
                        if not isinstance(msg, dict):
                            msg = {"raw": msg}
                        yield {**msg, "id": sid}
        finally:
            await client.aclose()
