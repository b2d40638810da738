"""Conversation caches of one server: find a request's longest cached prefix (here or on a peer),
keep the snapshots its worker makes, advertise them in the fleet, and export them to peers.

The flow of a turn (kv_sharing.md §4.2, "Turn-routing flow"):

1. `attach(req)` names the prompt positions worth a snapshot (the end of the prompt and, since
   DeepSeek's encoding drops earlier reasoning from the history, the position right after the
   last `<｜Assistant｜>`, which is what a thinking-mode conversation's next turn repeats) and
   looks for the longest cached prefix: first in the local store, then, among longer prefixes
   ending at a turn boundary, in the fleet's Redis. A longer one held by a live peer is fetched
   (the transport writes it straight into this server's arena), verified (header, checksum,
   chain key, epoch) and claimed; the request then starts from it. Any doubt is a recompute.
2. The worker snapshots the state at those positions and, once the completion ends, after the
   tokens the next turn's prompt repeats (`on_step` reserves arena space for each and commits it
   when written), and each committed snapshot is claimed in Redis so peers can find it.
3. Peers fetch through the transfer server; `export` refuses a stale epoch and pins the blob
   (a read lease) while it is sent.

Redis being down or slow only costs remote hits: local hits go on, and nothing ever waits on
Redis longer than the directory's op timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

import numpy as np

from dsuf.ipc.messages import Restore, SnapshotWrite, Step, StepDone

from .ownership import ConvRecord, DirectoryUnavailable, OwnershipDirectory, ServerLease
from .snapshot import PrefixHasher, SnapshotError, decode_snapshot, stamp_epoch, token_array
from .store import HostStore, Reservation, StoreError

if TYPE_CHECKING:  # the transports are imported only by a server that joins a fleet
    from dsuf.engine.scheduler import Request, Scheduler

    from .transport import KvFetcher

log = logging.getLogger("dsuf.kvcache")

COMING_WAIT = 2.0  # seconds a turn waits for a snapshot the worker is making right now
NAME_PREFIX = "name:"  # records that point a client-chosen conversation id at its latest snapshot


class ConversationCache:
    def __init__(
        self,
        store: HostStore,
        *,
        model_id: str,
        revision: str,
        assistant_id: int,
        boundary_ids: set[int],
    ) -> None:
        self.store = store
        self.model_id, self.revision = model_id, revision
        self.assistant_id = assistant_id
        self._boundaries = np.array(sorted(boundary_ids), dtype=np.int32)
        self.directory: OwnershipDirectory | None = None
        self.fetcher: KvFetcher | None = None
        self.layout = f"{model_id}@{revision}"
        self._pending: dict[str, tuple[Reservation, str | None]] = {}  # key -> (region, conversation)
        self._coming: dict[str, asyncio.Future[bool]] = {}  # snapshots the worker is making now
        self._step_keys: dict[int, list[str]] = {}
        self._tasks: set[asyncio.Task] = set()
        self.stats = {"local_hits": 0, "fetched": 0, "fetch_failures": 0, "misses": 0, "exported": 0}

    def join(self, directory: OwnershipDirectory, fetcher: KvFetcher | None) -> None:
        """Share this server's snapshots with the fleet (and fetch from peers when `fetcher` is set)."""
        self.directory, self.fetcher = directory, fetcher
        directory.on_cluster_reset(self._reclaim_all)
        self._spawn(self._follow_announcements())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- admission ------------------------------------------------------------------------------

    async def attach(self, req: Request, conversation: str | None = None) -> None:
        """Name `req`'s snapshot points and start it from the longest cached prefix, if any."""
        prompt = token_array(req.prompt)
        n = len(prompt)
        points = {n}
        if n >= 2 and prompt[-2] == self.assistant_id:
            points.add(n - 1)
        named = await self._named(conversation) if conversation else None
        candidates = self._boundary_lengths(prompt)
        if named is not None and 0 < named[1] < n:
            candidates.add(named[1])
        hasher = PrefixHasher(self.model_id)
        keys = hasher.keys_at(prompt, points | candidates)
        req.hasher, req.conversation = hasher, conversation
        req.snapshots = {p: keys[p] for p in sorted(points) if keys[p] not in self.store}

        hit = self.store.longest_prefix(self.model_id, prompt, max_tokens=n - 1)
        coming = [p for p in candidates if p > (hit[1] if hit else 0) and keys[p] in self._coming]
        if coming:  # e.g. the previous turn's closing snapshot, one or two steps from done
            await asyncio.wait([self._coming[keys[max(coming)]]], timeout=COMING_WAIT)
            hit = self.store.longest_prefix(self.model_id, prompt, max_tokens=n - 1)
        fetched = None
        if self.directory is not None:
            longer = {p: keys[p] for p in candidates if p > (hit[1] if hit else 0)}
            if named is not None and named[1] in longer and longer[named[1]] != named[0]:
                del longer[named[1]]  # the name points at another conversation's tokens
            fetched = await self._fetch_longest(longer)
        if fetched is None and hit is None:
            self.stats["misses"] += 1
            return
        key, cached = fetched or hit
        self.stats["fetched" if fetched else "local_hits"] += 1
        pin = ExitStack()
        pin.enter_context(self.store.lease(key))
        offset, size = self.store.location(key)
        req.use_cached(cached, Restore(offset, size, key, cached), pin)

    def _boundary_lengths(self, prompt: np.ndarray) -> set[int]:
        """Prefix lengths n < len(prompt) whose last token ends a turn part: where snapshots are
        taken, so where a peer's cached prefix can end."""
        ends = np.flatnonzero(np.isin(prompt[:-1], self._boundaries)) + 1
        return set(ends.tolist())

    async def _named(self, conversation: str) -> tuple[str, int] | None:
        try:
            rec = await self.directory.lookup(NAME_PREFIX + conversation) if self.directory else None
        except DirectoryUnavailable:
            return None
        return (rec.layout.rpartition("#")[2], rec.tokens) if rec is not None and "#" in rec.layout else None

    async def _fetch_longest(self, candidates: dict[int, str]) -> tuple[str, int] | None:
        """Fetch the longest of `candidates` (prefix length -> key) that a live peer holds. An owner
        that refuses because another server claimed the snapshot meanwhile (it fetched the same turn
        a moment earlier) is followed once to the record's new owner."""
        if not candidates or self.fetcher is None:
            return None
        from .transport import ExportRefused, TransferError

        order = sorted(candidates, reverse=True)
        try:
            records = await self.directory.lookup_many([candidates[n] for n in order])
            for n, rec in zip(order, records):
                lease = await self._live_owner(rec)
                if lease is None:
                    continue
                try:
                    try:
                        await self._fetch(lease.ctrl_addr, rec.conv, n, rec.epoch, rec.owner)
                    except ExportRefused as exc:
                        now = await self.directory.lookup(rec.conv)
                        moved = now is not None and (now.owner, now.epoch) != (rec.owner, rec.epoch)
                        lease = await self._live_owner(now) if moved else None
                        if lease is None:
                            raise
                        log.info("%s refused %d cached tokens (%s); %s holds them now", rec.owner, n, exc, now.owner)
                        rec = now
                        await self._fetch(lease.ctrl_addr, rec.conv, n, rec.epoch, rec.owner)
                except (TransferError, SnapshotError, StoreError) as exc:
                    self.stats["fetch_failures"] += 1
                    log.warning("fetching %d cached tokens from %s failed (%s); recomputing", n, rec.owner, exc)
                    return None
                return rec.conv, n
        except DirectoryUnavailable as exc:
            log.info("conversation cache: directory unavailable (%s); local hits only", exc)
        return None

    async def _live_owner(self, rec: ConvRecord | None) -> ServerLease | None:
        """The lease of `rec`'s owner where it is a live peer holding our layout (None: not one)."""
        if rec is None or rec.layout != self.layout or self.directory.is_mine(rec):  # (ours: not in the store any more)
            return None
        lease = await self.directory.server(rec.owner)
        return lease if lease is not None and lease.boot_id == rec.boot else None  # (else the owner died or restarted)

    async def _fetch(self, addr: str, key: str, tokens: int, epoch: int, owner: str) -> None:
        from .transport import TransferError

        began = time.perf_counter()
        res: Reservation | None = None

        def alloc(size: int) -> memoryview:
            nonlocal res
            try:
                res, evicted = self.store.reserve(key, tokens, size)
            except StoreError as exc:
                raise TransferError(f"no room for {size} bytes: {exc}") from None
            self._evicted(evicted)
            return res.view

        try:
            blob = await self.fetcher.fetch(addr, key, epoch, alloc)
            header, _ = await asyncio.to_thread(
                decode_snapshot, blob, expect_model_id=self.model_id, expect_revision=self.revision,
                expect_key=key, expect_epoch=epoch,
            )  # CRC-32 of a large blob runs off the event loop (zlib releases the GIL)
            if header.token_count != tokens:
                raise SnapshotError(f"snapshot covers {header.token_count} tokens, expected {tokens}")
        except BaseException:
            if res is not None:
                self.store.abort(res)
            raise
        self.store.commit(res)
        log.info("fetched %d cached tokens (%d bytes) from %s in %.1f ms", tokens, len(res.view), owner, (time.perf_counter() - began) * 1e3)
        await self._advertise(key, tokens, len(res.view), expected=epoch)

    # ---- snapshots made by the worker -------------------------------------------------------------

    def expect(self, step: Step) -> None:
        """The step about to run makes these snapshots: a turn that needs one will wait for it."""
        keys = [w.snapshot for w in step.work if w.snapshot is not None]
        if keys:
            loop = asyncio.get_running_loop()
            for key in keys:
                if key not in self._coming:
                    self._coming[key] = loop.create_future()
            self._step_keys[step.step] = keys

    def worker_lost(self) -> None:
        """The worker died: the snapshots it was making will never be written."""
        for res, _ in self._pending.values():
            self.store.abort(res)
        self._pending.clear()
        self._step_keys.clear()
        for key in list(self._coming):
            self._arrived(key, False)
        self._publish_stats()

    def _arrived(self, key: str, ok: bool) -> None:
        future = self._coming.pop(key, None)
        if future is not None and not future.done():
            future.set_result(ok)

    def on_step(self, done: StepDone, scheduler: Scheduler) -> None:
        """Before the scheduler sees `done`: place new snapshots, commit written ones, forget refused ones."""
        for out in done.outputs:
            req = scheduler.running.get(out.seq)
            if out.cache_miss and req is not None and req.restore is not None:
                self.store.drop(req.restore.key)
        for made in done.snapshots:
            offset = -1
            if made.key not in self._pending:
                try:
                    res, evicted = self.store.reserve(made.key, made.tokens, made.size)
                except StoreError as exc:
                    log.info("snapshot of %d tokens not kept: %s", made.tokens, exc)
                else:
                    self._evicted(evicted)
                    req = scheduler.running.get(made.seq)
                    self._pending[made.key] = (res, req.conversation if req is not None else None)
                    offset = res.offset
            scheduler.writes.append(SnapshotWrite(made.key, offset))
        for key in self._step_keys.pop(done.step, ()):
            if key not in self._pending:  # not made (the sequence failed) or no room for it
                self._arrived(key, False)
        for key in done.written:
            res, conversation = self._pending.pop(key)
            self.store.commit(res)
            self._arrived(key, True)
            if self.directory is not None:
                self._spawn(self._advertise(key, res.tokens, len(res.view), expected=0, conversation=conversation))
        self._publish_stats()

    async def _advertise(self, key: str, tokens: int, size: int, *, expected: int, conversation: str | None = None) -> None:
        """Claim `key` in the fleet (taking it over from a dead owner) and stamp our epoch into it.
        Losing to a live owner leaves an unadvertised local copy, still used for local hits."""
        if self.directory is None:
            return
        try:
            claim = await self.directory.claim(key, expected, tokens=tokens, bytes_=size, layout=self.layout)
            if not claim.ok and claim.reason == "epoch" and claim.owner is not None and claim.owner != self.directory.server_id:
                lease = await self.directory.server(claim.owner)
                if lease is None:  # its owner is gone: the record is ours to take
                    claim = await self.directory.claim(key, claim.epoch, tokens=tokens, bytes_=size, layout=self.layout)
            if claim.ok and key in self.store:
                # In place, 64 bytes: a worker restoring from this blob at this very instant could
                # read a torn header; its CRC check then refuses it and that request recomputes.
                stamp_epoch(self.store.get(key), claim.epoch)
                self.store.set_meta(key, claim.epoch)
            if conversation:
                await self._name(conversation, key, tokens)
        except DirectoryUnavailable as exc:
            log.info("conversation cache: claim of %s not recorded (%s)", key[:12], exc)

    async def _name(self, conversation: str, key: str, tokens: int) -> None:
        """Point the client's conversation id at its latest snapshot (the record's layout field
        carries "layout#key"; whoever writes last wins, which is the latest turn)."""
        name = NAME_PREFIX + conversation
        rec = await self.directory.lookup(name)
        if rec is not None and rec.tokens > tokens and self.directory.is_mine(rec):
            return  # an older turn's snapshot finishing late must not move the name back
        await self.directory.claim(name, rec.epoch if rec else 0, tokens=tokens, bytes_=0, layout=f"{self.layout}#{key}")

    def _evicted(self, keys: list[str]) -> None:
        if self.directory is None:
            return
        for key in keys:
            self._spawn(self._release(key))

    async def _release(self, key: str) -> None:
        # An evicted entry's meta is gone with it, so release by the current record if it is ours.
        try:
            rec = await self.directory.lookup(key)
            if rec is not None and self.directory.is_mine(rec):
                await self.directory.release(key, rec.epoch)
        except DirectoryUnavailable:
            pass  # the record expires with its retention

    # ---- peers ------------------------------------------------------------------------------------

    @contextmanager
    def export(self, key: str, epoch: int) -> Iterator[memoryview]:
        """The transfer server's lookup: pin and yield `key`'s blob if we own it at `epoch`."""
        from .transport import ExportRefused

        if key not in self.store:
            raise ExportRefused(f"snapshot {key[:12]} is not held here")
        ours = self.store.meta(key)
        if ours != epoch:
            raise ExportRefused(f"stale epoch {epoch} for snapshot {key[:12]} (this server holds epoch {ours})")
        with self.store.lease(key) as blob:
            self.stats["exported"] += 1
            yield blob

    async def _follow_announcements(self) -> None:
        """Stop advertising snapshots another server has claimed since (their records moved on)."""
        me = self.directory.server_id
        while True:
            try:
                async for msg in self.directory.watch("$"):
                    conv = msg.get("conv")
                    if msg.get("event") == "claim" and msg.get("owner") != me and conv in self.store:
                        self.store.set_meta(conv, None)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("conversation cache: announcement watcher failed; restarting")
                await asyncio.sleep(1.0)

    async def _reclaim_all(self) -> None:
        """Redis lost its data: claim every snapshot we hold again, with fresh epochs."""
        entries = self.store.entries()
        log.info("conversation cache: fleet directory was reset; re-claiming %d snapshots", len(entries))
        for e in entries:
            await self._advertise(e.key, e.tokens, e.bytes, expected=0)

    def _publish_stats(self) -> None:
        if self.directory is not None:
            self.directory.set_stats(self.store.bytes_used, len(self.store))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
