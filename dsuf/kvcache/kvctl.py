"""kvctl: inspect and administer the Redis KV ownership directory (`dsuf.kvcache.ownership`).

Usage::

    tools/kvctl [--redis URL] [--prefix kv] [--json] [--timeout S] COMMAND

    servers                     live leases: id, ctrl addr, boot, transports, bytes, entries, TTL
    list [--server ID]          conversation records: id, owner, epoch, tokens, bytes, age
    show ID                     one record in full, and whether its owner is alive
    watch [--count N] [--from ID]
                                announcements (claim / release / drop) as they happen, until
                                Ctrl-C or N events; --from replays the stream after a stream id
                                ("0": from the beginning of the retained log)
    drop ID                     admin delete of a record, whoever owns it (announced as "drop")

`--redis` defaults to `$DSUF_REDIS_URL`, else ``redis://127.0.0.1:6379/0``. Human tables by
default; `--json` prints JSON (a list for servers/list, an object for show/drop, one object per
line for watch). Exit codes: 0 ok, 1 no such conversation (show, drop), 2 Redis unreachable or a
usage error. Errors are one line on stderr.

kvctl never holds a server lease: it builds an `OwnershipDirectory` it never `start()`s and only
uses its read and admin calls (lookup, server, servers, list_convs, drop, watch). Two small reads
go through a client of its own: the Redis clock (ages are measured against the clock that wrote
`ts`, not the local one) and the stream's tail (so `watch` can say "ready" before it blocks).
`list --server` prunes that server's index of expired or moved ids (the directory's own atomic
script), the one side effect besides `drop`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Collection, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from dsuf.kvcache.ownership import ConvRecord, DirectoryUnavailable, OwnershipDirectory, ServerLease

DEFAULT_URL = "redis://127.0.0.1:6379/0"
_STREAM_ID = re.compile(r"^(\$|\d+(-\d+)?)$")


class CtlError(Exception):
    """A failure reported as one line on stderr with `code` as the exit status."""

    def __init__(self, msg: str, code: int) -> None:
        super().__init__(msg)
        self.code = code


# --- formatting ----------------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    v = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        v /= 1024
        if v < 1024 or unit == "PiB":
            return f"{v:.1f} {unit}"
    raise AssertionError("unreachable")


def human_duration(ms: int) -> str:
    if ms < 0:
        return "-"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f}s" if s < 10 else f"{int(s)}s"
    m, s = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def clock(ms: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ms / 1000)) + f".{ms % 1000:03d}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Collection[int] = ()) -> str:
    """Aligned columns with a header line; columns in `right` (numbers) are right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def redact(url: str) -> str:
    """The URL without its password (error messages end up in logs)."""
    try:
        u = urlsplit(url)
        if u.password is None:
            return url
        netloc = (f"{u.username}:***@" if u.username else ":***@") + (u.hostname or "")
        if u.port is not None:
            netloc += f":{u.port}"
        return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))
    except ValueError:
        return "<unparsable url>"


def _one_line(s: str) -> str:
    return " ".join(str(s).split())


def _lease_json(lease: ServerLease) -> dict[str, Any]:
    return dataclasses.asdict(lease)


def _rec_json(rec: ConvRecord) -> dict[str, Any]:
    return dataclasses.asdict(rec)


def _stream_ms(sid: str) -> int:
    try:
        return int(str(sid).split("-", 1)[0])
    except ValueError:
        return 0


# --- the tool ------------------------------------------------------------------------------------


class Ctl:
    """An unstarted (lease-less) directory plus a plain client for the Redis clock and stream tail."""

    def __init__(self, url: str, prefix: str, timeout: float) -> None:
        self.url = url
        self.timeout = timeout
        try:
            self.dir = OwnershipDirectory(
                url,
                f"kvctl-{os.getpid()}",  # never start()ed: no lease is ever written under this id
                ctrl_addr="",
                transports=[],
                op_timeout=timeout,
                admin_timeout=timeout,
                prefix=prefix,
            )
            self.raw = aioredis.Redis.from_url(
                url, decode_responses=True, socket_timeout=timeout, socket_connect_timeout=timeout
            )
        except ValueError as e:
            raise CtlError(f"kvctl: bad Redis URL {redact(url)!r}: {_one_line(str(e))}", 2) from e

    async def aclose(self) -> None:
        # close(drop_lease=False): there is no lease to drop; this only closes the connections.
        with contextlib.suppress(Exception):
            await self.dir.close(drop_lease=False)
        with contextlib.suppress(Exception):
            await self.raw.aclose()

    def unavailable(self, e: BaseException) -> CtlError:
        cause = e.__cause__ if isinstance(e, DirectoryUnavailable) and e.__cause__ is not None else e
        what = type(cause).__name__
        detail = _one_line(str(cause)) or "timed out"
        if isinstance(cause, TimeoutError):
            detail = f"no answer within {self.timeout:g} s"
        return CtlError(f"kvctl: Redis unavailable at {redact(self.url)}: {what}: {detail}", 2)

    async def _raw(self, fn: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout):
                return await fn()
        except (RedisError, OSError, TimeoutError) as e:
            raise self.unavailable(e) from e

    async def now_ms(self) -> int:
        """The Redis clock: record `ts` and stream ids come from it."""
        sec, usec = await self._raw(self.raw.time)
        return int(sec) * 1000 + int(usec) // 1000

    async def stream_tail(self) -> str:
        tail = await self._raw(lambda: self.raw.xrevrange(self.dir.keys.log, "+", "-", count=1))
        return tail[0][0] if tail else "0-0"


async def cmd_servers(ctl: Ctl, args: argparse.Namespace) -> int:
    leases = await ctl.dir.servers()
    if args.json:
        print(json.dumps([_lease_json(x) for x in leases]))
        return 0
    if not leases:
        print("no servers")
        return 0
    rows = [
        (
            x.server_id,
            x.ctrl_addr or "-",
            x.boot_id[:8] or "-",
            ",".join(x.transports) or "-",
            human_bytes(x.bytes_used),
            x.entries,
            human_duration(x.ttl_ms),
        )
        for x in leases
    ]
    print(table(["SERVER", "CTRL", "BOOT", "TRANSPORTS", "BYTES", "ENTRIES", "TTL"], rows, right={4, 5, 6}))
    return 0


async def cmd_list(ctl: Ctl, args: argparse.Namespace) -> int:
    recs = await ctl.dir.list_convs(args.server)
    if args.json:
        print(json.dumps([_rec_json(r) for r in recs]))
        return 0
    if not recs:
        print("no conversations" + (f" owned by {args.server}" if args.server else ""))
        return 0
    now = await ctl.now_ms()
    rows = [
        (r.conv, r.owner, r.epoch, r.tokens, human_bytes(r.bytes), human_duration(max(0, now - r.ts)) if r.ts else "-")
        for r in recs
    ]
    print(table(["CONV", "OWNER", "EPOCH", "TOKENS", "BYTES", "AGE"], rows, right={2, 3, 4, 5}))
    return 0


async def cmd_show(ctl: Ctl, args: argparse.Namespace) -> int:
    rec = await ctl.dir.lookup(args.id)
    if rec is None:
        raise CtlError(f"kvctl: no such conversation: {args.id}", 1)
    lease = await ctl.dir.server(rec.owner)
    alive = lease is not None and lease.boot_id == rec.boot
    if args.json:
        print(json.dumps({**_rec_json(rec), "alive": alive, "lease": _lease_json(lease) if lease else None}))
        return 0
    now = await ctl.now_ms()
    if lease is None:
        status = "no (no lease: the server is down or partitioned)"
    elif not alive:
        status = f"no (the lease is of another incarnation, boot {lease.boot_id}: the cache is gone)"
    else:
        status = f"yes (lease {human_duration(lease.ttl_ms)} left, ctrl {lease.ctrl_addr or '-'})"
    fields = [
        ("conv", rec.conv),
        ("owner", rec.owner),
        ("epoch", rec.epoch),
        ("boot", rec.boot or "-"),
        ("alive", status),
        ("tokens", rec.tokens),
        ("bytes", f"{rec.bytes} ({human_bytes(rec.bytes)})"),
        ("updated", f"{clock(rec.ts)} ({human_duration(max(0, now - rec.ts))} ago)" if rec.ts else "-"),
        ("layout", rec.layout or "-"),
    ]
    w = max(len(k) for k, _ in fields)
    for k, v in fields:
        print(f"{k + ':':<{w + 1}}  {v}")
    return 0


async def cmd_drop(ctl: Ctl, args: argparse.Namespace) -> int:
    rec = await ctl.dir.lookup(args.id)
    dropped = await ctl.dir.drop(args.id)
    if not dropped:
        raise CtlError(f"kvctl: no such conversation: {args.id}", 1)
    if args.json:
        print(json.dumps({"dropped": args.id, "record": _rec_json(rec) if rec else None}))
    elif rec is not None:
        size = f"{rec.tokens} tokens, {human_bytes(rec.bytes)}"
        print(f"dropped {rec.conv} (owner {rec.owner}, epoch {rec.epoch}, {size})")
    else:  # claimed between the lookup and the drop
        print(f"dropped {args.id}")
    return 0


_WATCH_COLS = (("TIME", 12), ("EVENT", 7), ("CONV", 24), ("OWNER", 12))


def _watch_line(values: Sequence[Any]) -> str:
    parts = [f"{str(v):<{w}}" for v, (_, w) in zip(values, _WATCH_COLS)]
    return "  ".join(parts + [str(values[-1])]).rstrip()


async def cmd_watch(ctl: Ctl, args: argparse.Namespace) -> int:
    start = args.from_id
    if start == "$":
        # Resolve "now" here rather than inside watch(): it doubles as the reachability check
        # (watch() itself retries a dead Redis forever) and lets us say when we are listening.
        start = await ctl.stream_tail()
    else:
        await ctl.now_ms()  # reachability check
    if not args.json:
        print(_watch_line([h for h, _ in _WATCH_COLS] + ["EPOCH"]), flush=True)
    print(f"kvctl: watching {ctl.dir.keys.log} after {start} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    n = 0
    async with contextlib.aclosing(ctl.dir.watch(start)) as events:
        async for ev in events:
            ts = _stream_ms(ev.get("id", ""))
            if args.json:
                print(json.dumps({**ev, "ts": ts}), flush=True)
            else:
                cols = [ev.get(k, "?") for k in ("event", "conv", "owner", "epoch")]
                print(_watch_line([clock(ts), *cols]), flush=True)
            n += 1
            if args.count is not None and n >= args.count:
                break
    return 0


COMMANDS = {"servers": cmd_servers, "list": cmd_list, "show": cmd_show, "watch": cmd_watch, "drop": cmd_drop}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvctl",
        description="Inspect and administer the Redis KV ownership directory. Holds no server lease.",
    )
    p.add_argument(
        "--redis",
        default=os.environ.get("DSUF_REDIS_URL") or DEFAULT_URL,
        help=f"Redis URL (default: $DSUF_REDIS_URL or {DEFAULT_URL})",
    )
    p.add_argument("--prefix", default="kv", help="key prefix (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="machine-readable JSON output")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per Redis call (default: %(default)s)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("servers", help="live server leases")
    pl = sub.add_parser("list", help="conversation records")
    pl.add_argument("--server", metavar="ID", help="only those owned by this server")
    ps = sub.add_parser("show", help="one record in full, and whether its owner is alive")
    ps.add_argument("id", metavar="ID")
    pw = sub.add_parser("watch", help="live announcements, until Ctrl-C or --count events")
    pw.add_argument("--count", type=int, metavar="N", help="stop after N events")
    pw.add_argument(
        "--from", dest="from_id", default="$", metavar="ID",
        help='replay the stream after this stream id ("0": everything retained; default: from now)',
    )  # fmt: skip
    pd = sub.add_parser("drop", help="admin delete of a record, whoever owns it")
    pd.add_argument("id", metavar="ID")
    return p


async def _amain(args: argparse.Namespace) -> int:
    ctl = Ctl(args.redis, args.prefix, args.timeout)
    try:
        return await COMMANDS[args.command](ctl, args)
    except DirectoryUnavailable as e:
        raise ctl.unavailable(e) from e
    finally:
        await ctl.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.command == "watch" and args.count is not None and args.count <= 0:
        parser.error("--count must be positive")
    if args.command == "watch" and not _STREAM_ID.match(args.from_id):
        parser.error(f"--from: not a stream id: {args.from_id!r} (e.g. 0, 1700000000000-0, $)")
    try:
        return asyncio.run(_amain(args))
    except CtlError as e:
        print(str(e), file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 0 if args.command == "watch" else 130
    except BrokenPipeError:
        # The reader went away (`kvctl watch | head`): not an error. Point stdout at devnull so
        # the interpreter's final flush does not complain.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # one line, never a traceback
        print(f"kvctl: {type(e).__name__}: {_one_line(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
