"""The host-memory store of conversation snapshots, under a byte budget, with LRU eviction.

Entries are snapshot blobs (`snapshot.encode_snapshot`) named by the chain key of their tokens.
`get` refreshes recency; `put` evicts least-recently-used entries to make room and returns their
keys (the caller withdraws their Redis announcements). A `lease` pins an entry while it is read
or sent to a peer (kv_sharing.md §4.4): a pinned entry is never evicted, and one dropped or
replaced while pinned disappears from lookups at once but keeps its bytes counted until the last
lease ends ("free the buffer once no read lease is outstanding", §4.2 step 4).

The bytes live in an `Arena` (by default a private one of `budget_bytes`; the server passes its
shared arena, which the worker writes into and the transports send from). A snapshot made by the
worker is stored in two steps: `reserve` evicts and allocates its region, the worker fills it, and
`commit` makes it visible under its key (`abort` gives the region back).

`longest_prefix` finds, without help from the client, the stored snapshot whose tokens are the
longest prefix of a new prompt: it hashes the prompt once, taking the keys of exactly the prefix
lengths present in the store.

Thread-safety: none. The store belongs to the server's single asyncio thread; every method is
synchronous and runs to completion between awaits, so no locking is needed. Worker threads (e.g.
a checksum or a socket send off the loop) must receive the blob from a `lease`, not call into
the store.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

from .arena import Arena
from .snapshot import PrefixHasher, token_array


class StoreError(Exception):
    """Base class of the store's refusals."""


class SnapshotTooLarge(StoreError, ValueError):
    """A blob larger than the whole budget: it can never be stored; nothing was evicted."""


class StoreFull(StoreError):
    """Not enough unpinned bytes to evict for this blob (leases hold the rest); nothing was evicted."""


class EntryInfo(NamedTuple):
    key: str
    tokens: int
    bytes: int
    age_seconds: float  # since the entry was stored


class _Entry:
    __slots__ = ("key", "tokens", "offset", "blob", "created", "pins", "dropped", "meta")

    def __init__(self, key: str, tokens: int, offset: int, blob: memoryview, meta: Any) -> None:
        self.key, self.tokens, self.offset, self.blob, self.meta = key, tokens, offset, blob, meta
        self.created = time.monotonic()
        self.pins = 0
        self.dropped = False


class Reservation(NamedTuple):
    """A region allocated for a snapshot that is still being written; invisible to lookups."""

    key: str
    tokens: int
    offset: int
    view: memoryview  # writable, exactly the snapshot's size


class HostStore:
    """Snapshots in host memory, at most `budget_bytes` in all (counting reservations and blobs
    still leased after they were dropped or replaced)."""

    def __init__(self, budget_bytes: int, arena: Arena | None = None) -> None:
        if budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        if arena is not None and arena.size < budget_bytes:
            raise ValueError(f"the arena ({arena.size} bytes) is smaller than the budget ({budget_bytes} bytes)")
        self.budget_bytes = budget_bytes
        self.arena = arena if arena is not None else Arena.private(budget_bytes)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._draining: dict[int, _Entry] = {}  # dropped/replaced while leased, by id()
        self._lengths: Counter[int] = Counter()  # token counts present among live entries
        self._bytes = 0

    # ---- queries ------------------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        """Bytes held, including reservations and dropped entries still under lease."""
        return self._bytes

    def entries(self) -> list[EntryInfo]:
        """Live entries, least recently used first."""
        now = time.monotonic()
        return [EntryInfo(e.key, e.tokens, len(e.blob), now - e.created) for e in self._entries.values()]

    def leases(self, key: str) -> int:
        """Number of open leases on the live entry `key` (0 if absent)."""
        entry = self._entries.get(key)
        return entry.pins if entry else 0

    def get(self, key: str) -> memoryview | None:
        """The blob stored under `key` (marking it most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.blob

    def location(self, key: str) -> tuple[int, int] | None:
        """(offset, size) of `key`'s blob in the arena, or None."""
        entry = self._entries.get(key)
        return (entry.offset, len(entry.blob)) if entry else None

    def meta(self, key: str) -> Any:
        """What the caller attached to `key` at commit (e.g. its ownership epoch), or None."""
        entry = self._entries.get(key)
        return entry.meta if entry else None

    def set_meta(self, key: str, meta: Any) -> None:
        self._entries[key].meta = meta

    def longest_prefix(self, model_id: str, tokens: Sequence[int] | Any, *, max_tokens: int | None = None) -> tuple[str, int] | None:
        """(key, n) of the stored snapshot whose tokens are the longest prefix tokens[:n], or None.

        Only lengths ≤ `max_tokens` (default len(tokens)) are considered: pass len(tokens) - 1
        when the caller needs at least one token left to feed for the next logits. Does not touch
        recency; `get` or `lease` the key to use it. A hit names the tokens only — the blob's
        header is still verified (`decode_snapshot`) before use."""
        arr = token_array(tokens)
        limit = len(arr) if max_tokens is None else min(max_tokens, len(arr))
        lengths = [n for n in self._lengths if n <= limit]
        if not lengths:
            return None
        keys = PrefixHasher(model_id).keys_at(arr[: max(lengths)], lengths)
        for n in sorted(keys, reverse=True):
            if keys[n] in self._entries:
                return keys[n], n
        return None

    # ---- changes ------------------------------------------------------------------------------
    def put(self, key: str, tokens: int, blob: bytes | memoryview, meta: Any = None) -> list[str]:
        """Store a copy of `blob` under `key` (replacing any entry of that key), evicting least
        recently used unpinned entries to make room. Returns the evicted keys, oldest first.

        Raises SnapshotTooLarge if the blob exceeds the whole budget and StoreFull if evicting
        every unpinned entry would not make room; either way the store is left unchanged."""
        res, evicted = self.reserve(key, tokens, len(blob))
        res.view[:] = blob
        self.commit(res, meta)
        return evicted

    def reserve(self, key: str, tokens: int, size: int) -> tuple[Reservation, list[str]]:
        """Allocate `size` bytes for a snapshot of `key`, evicting least recently used unpinned
        entries. Returns the reservation and the evicted keys; raises like `put`, leaving the
        store unchanged. An unpinned entry of the same key is replaced at once (not reported as
        evicted); a pinned one stays readable until the commit replaces it."""
        if size > self.budget_bytes:
            raise SnapshotTooLarge(f"snapshot of {size} bytes exceeds the whole store budget of {self.budget_bytes} bytes")
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        # Victims by bytes first (a plan, so a refusal changes nothing), then more while the arena
        # is too fragmented for one run of `size` bytes.
        old = self._entries.get(key)
        replaced = len(old.blob) if old is not None and not old.pins else 0
        need = self._bytes - replaced + size - self.budget_bytes
        candidates = [e for e in self._entries.values() if not e.pins and e.key != key]
        evictable = sum(len(e.blob) for e in candidates)
        if need > evictable:
            raise StoreFull(
                f"cannot fit {size} bytes: {self._bytes} of {self.budget_bytes} bytes used and "
                f"only {evictable} evictable (the rest is leased or being written)"
            )
        if replaced:
            self._remove(old)
        victims: list[str] = []
        for entry in candidates:
            if need <= 0:
                break
            need -= len(entry.blob)
            victims.append(entry.key)
            self._remove(entry)
        offset = self.arena.alloc(size)
        while offset is None and len(victims) < len(candidates):
            entry = candidates[len(victims)]
            victims.append(entry.key)
            self._remove(entry)
            offset = self.arena.alloc(size)
        if offset is None:
            raise StoreFull(f"cannot fit {size} bytes: the free space is fragmented by leased entries")
        self._bytes += size
        return Reservation(key, tokens, offset, self.arena.region(offset, size)), victims

    def commit(self, res: Reservation, meta: Any = None) -> None:
        """Make a filled reservation visible under its key, replacing any entry of that key."""
        old = self._entries.get(res.key)
        if old is not None:
            self._remove(old)
        self._entries[res.key] = _Entry(res.key, res.tokens, res.offset, res.view, meta)
        self._lengths[res.tokens] += 1

    def abort(self, res: Reservation) -> None:
        """Give back a reservation that will not be committed."""
        self._bytes -= len(res.view)
        self.arena.free(res.offset)

    def drop(self, key: str) -> bool:
        """Remove `key` from the store (its bytes stay counted until any open lease ends).
        Returns whether it was present."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        self._remove(entry)
        return True

    @contextmanager
    def lease(self, key: str) -> Iterator[memoryview]:
        """Pin `key` for the duration of the block and yield its blob; KeyError if absent.

        While pinned the entry is never evicted. Dropping or replacing it meanwhile hides it from
        lookups; its bytes are released when the last lease ends."""
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(key)
        self._entries.move_to_end(key)
        entry.pins += 1
        try:
            yield entry.blob
        finally:
            entry.pins -= 1
            if entry.pins == 0 and entry.dropped:
                del self._draining[id(entry)]
                self._release(entry)

    def _remove(self, entry: _Entry) -> None:
        del self._entries[entry.key]
        self._lengths[entry.tokens] -= 1
        if not self._lengths[entry.tokens]:
            del self._lengths[entry.tokens]
        if entry.pins:
            entry.dropped = True
            self._draining[id(entry)] = entry
        else:
            self._release(entry)

    def _release(self, entry: _Entry) -> None:
        self._bytes -= len(entry.blob)
        self.arena.free(entry.offset)
