"""The host-memory store of conversation snapshots, under a byte budget, with LRU eviction.

Entries are snapshot blobs (`snapshot.encode_snapshot`) named by the chain key of their tokens.
`get` refreshes recency; `put` evicts least-recently-used entries to make room and returns their
keys (the caller withdraws their Redis announcements). A `lease` pins an entry while it is read
or sent to a peer (kv_sharing.md §4.4): a pinned entry is never evicted, and one dropped or
replaced while pinned disappears from lookups at once but keeps its bytes counted until the last
lease ends ("free the buffer once no read lease is outstanding", §4.2 step 4).

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
    __slots__ = ("key", "tokens", "blob", "created", "pins", "dropped")

    def __init__(self, key: str, tokens: int, blob: bytes) -> None:
        self.key, self.tokens, self.blob = key, tokens, blob
        self.created = time.monotonic()
        self.pins = 0
        self.dropped = False


class HostStore:
    """Snapshots in host memory, at most `budget_bytes` in all (counting blobs still leased after
    they were dropped or replaced)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        self.budget_bytes = budget_bytes
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
        """Bytes held, including dropped entries still under lease."""
        return self._bytes

    def entries(self) -> list[EntryInfo]:
        """Live entries, least recently used first."""
        now = time.monotonic()
        return [EntryInfo(e.key, e.tokens, len(e.blob), now - e.created) for e in self._entries.values()]

    def leases(self, key: str) -> int:
        """Number of open leases on the live entry `key` (0 if absent)."""
        entry = self._entries.get(key)
        return entry.pins if entry else 0

    def get(self, key: str) -> bytes | None:
        """The blob stored under `key` (marking it most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.blob

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
    def put(self, key: str, tokens: int, blob: bytes) -> list[str]:
        """Store `blob` under `key` (replacing any entry of that key), evicting least recently
        used unpinned entries to stay within the budget. Returns the evicted keys, oldest first.

        Raises SnapshotTooLarge if the blob exceeds the whole budget and StoreFull if evicting
        every unpinned entry would not make room; either way the store is left unchanged."""
        size = len(blob)
        if size > self.budget_bytes:
            raise SnapshotTooLarge(f"snapshot of {size} bytes exceeds the whole store budget of {self.budget_bytes} bytes")
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        old = self._entries.get(key)
        freed_by_replace = len(old.blob) if old is not None and old.pins == 0 else 0
        need = self._bytes - freed_by_replace + size - self.budget_bytes
        victims: list[_Entry] = []
        if need > 0:
            for entry in self._entries.values():
                if entry.pins or entry is old:
                    continue
                victims.append(entry)
                need -= len(entry.blob)
                if need <= 0:
                    break
            if need > 0:
                raise StoreFull(
                    f"cannot fit {size} bytes: {self._bytes} of {self.budget_bytes} bytes used and "
                    f"only {sum(len(v.blob) for v in victims)} evictable (the rest is leased)"
                )
        for entry in victims:
            self._remove(entry)
        if old is not None:
            self._remove(old)
        entry = _Entry(key, tokens, blob)
        self._entries[key] = entry
        self._lengths[tokens] += 1
        self._bytes += size
        return [v.key for v in victims]

    def drop(self, key: str) -> bool:
        """Remove `key` from the store (its bytes stay counted until any open lease ends).
        Returns whether it was present."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        self._remove(entry)
        return True

    @contextmanager
    def lease(self, key: str) -> Iterator[bytes]:
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
                self._bytes -= len(entry.blob)

    def _remove(self, entry: _Entry) -> None:
        del self._entries[entry.key]
        self._lengths[entry.tokens] -= 1
        if not self._lengths[entry.tokens]:
            del self._lengths[entry.tokens]
        if entry.pins:
            entry.dropped = True
            self._draining[id(entry)] = entry
        else:
            self._bytes -= len(entry.blob)
