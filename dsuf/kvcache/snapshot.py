"""Versioned binary snapshots of a conversation's model state, named by a chain hash of its tokens.

Chain key (the name of a token prefix)
--------------------------------------

    key(model_id, t[0:n]) = blake2b(digest_size=16, person=b"dsuf-chain-v1",
                                    u32le(len(m)) ‖ m ‖ int32le(t[0]) ‖ … ‖ int32le(t[n-1])).hex()

where m is the model id in UTF-8. Because the tokens are appended after a fixed prefix, the key of
every prefix of a prompt falls out of one pass over it (`PrefixHasher.keys_at`, hashlib `copy()`).
The scheme is part of the cache format: changing it (or the personalisation string) renames every
snapshot, so bump the personalisation string if it ever changes. Token ids are 0 ≤ id < 2³¹.

Snapshot blob, layout version 1 (all integers little-endian)
------------------------------------------------------------

    off  size  field
      0     8  magic b"DSUFSNAP"
      8     4  u32 layout_version (1); magic and this field keep their offsets in every version
     12     4  u32 M, length of the meta part
     16     8  u64 token_count
     24     8  u64 epoch (fencing token of the owner, kv_sharing.md §4.2; 0 = never claimed)
     32     8  u64 P, payload_bytes
     40    16  token_key, the raw 16-byte chain key of the snapshot's tokens
     56     4  u32 payload_crc, CRC-32 (zlib) of the payload
     60     4  u32 header_crc, CRC-32 (zlib) of bytes [0, 60) followed by the meta part
     64     M  meta: UTF-8 JSON {"model_id": str, "model_revision": str}
   64+M     P  payload: `SequenceState.to_bytes()` (its own magic, version and tensor table)

The reader verifies everything it can before the payload is used (`decode_snapshot`): magic,
version, header CRC, model id and revision, payload length, token count and key, epoch, payload
CRC. Any mismatch is a `SnapshotError` with a one-line reason; the caller's answer to it is always
"recompute", never "use it anyway" (design.md, Conversation caches).
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np

from dsuf.model.config import ModelConfig
from dsuf.model.state import SequenceState, StateError

MAGIC = b"DSUFSNAP"
LAYOUT_VERSION = 1
KEY_BYTES = 16
_PERSON = b"dsuf-chain-v1"
_FIXED = struct.Struct("<8sIIQQQ16sII")  # the 64-byte fixed header above
FIXED_BYTES = _FIXED.size
_HEADER_CRC_AT = FIXED_BYTES - 4  # header_crc covers the fixed header up to itself, then the meta
_MAX_META = 1 << 16
_INT32_MAX = 2**31 - 1

assert FIXED_BYTES == 64


class SnapshotError(ValueError):
    """A snapshot that must not be used; the message is one line saying why."""


# ---- chain keys ---------------------------------------------------------------------------------


def token_array(tokens: Sequence[int] | Any) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array (no per-token Python loop).

    Accepts lists/tuples/ranges of ints, array('i'/'l'/…), numpy integer arrays and CPU torch
    tensors. Raises ValueError for ids outside [0, 2³¹) and for anything not 1-D integer."""
    if isinstance(tokens, bytes | bytearray | memoryview | str):
        raise TypeError("token ids must be a sequence of ints, not raw bytes or text")
    if hasattr(tokens, "detach") and hasattr(tokens, "numpy"):  # torch.Tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.size == 0:
        return np.zeros(0, dtype="<i4")
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _INT32_MAX:
        raise ValueError("token ids must lie in [0, 2**31)")
    return np.ascontiguousarray(arr, dtype="<i4")


def _model_prefix(model_id: str) -> bytes:
    if not isinstance(model_id, str) or not model_id:
        raise ValueError("model_id must be a non-empty string")
    mid = model_id.encode()
    return struct.pack("<I", len(mid)) + mid


class PrefixHasher:
    """Incremental chain hash of one token stream.

    `update(tokens)` appends; `key()` names everything fed so far; `keys_at(tokens, lengths)`
    appends `tokens` and returns, in the same single pass, the keys of the given absolute prefix
    lengths (count before the call ≤ length ≤ count after it). Each key costs one hashlib
    `copy()`, so naming every stored prefix length of a 1M-token prompt is one pass over 4 MB."""

    def __init__(self, model_id: str) -> None:
        self._h = hashlib.blake2b(_model_prefix(model_id), digest_size=KEY_BYTES, person=_PERSON)
        self._count = 0

    @property
    def count(self) -> int:
        """Number of tokens fed so far."""
        return self._count

    def update(self, tokens: Sequence[int] | Any) -> None:
        arr = token_array(tokens)
        self._h.update(memoryview(arr).cast("B"))
        self._count += len(arr)

    def key(self) -> str:
        """Chain key of the tokens fed so far (the hasher can go on being fed)."""
        return self._h.copy().hexdigest()

    def digest(self) -> bytes:
        return self._h.copy().digest()

    def keys_at(self, tokens: Sequence[int] | Any, lengths: Iterable[int]) -> dict[int, str]:
        """Feed `tokens`; return {n: chain key of the first n tokens of the whole stream} for each
        n in `lengths`. Lengths outside [count before, count after] are a ValueError."""
        arr = token_array(tokens)
        start, end = self._count, self._count + len(arr)
        wanted = sorted(set(lengths))
        if wanted and (wanted[0] < start or wanted[-1] > end):
            raise ValueError(f"prefix lengths must lie in [{start}, {end}], got {wanted[0]}..{wanted[-1]}")
        raw = memoryview(arr).cast("B")
        out: dict[int, str] = {}
        at = start
        for n in wanted:
            self._h.update(raw[(at - start) * 4 : (n - start) * 4])
            at = n
            out[n] = self._h.copy().hexdigest()
        self._h.update(raw[(at - start) * 4 :])
        self._count = end
        return out


def chain_key(model_id: str, tokens: Sequence[int] | Any) -> str:
    """Hex chain key (32 hex digits) naming `tokens` as a prefix under `model_id`."""
    h = PrefixHasher(model_id)
    h.update(tokens)
    return h.key()


def prefix_keys(model_id: str, tokens: Sequence[int] | Any, lengths: Iterable[int]) -> dict[int, str]:
    """{n: chain_key(model_id, tokens[:n])} for every n in `lengths`, in one pass over `tokens`."""
    return PrefixHasher(model_id).keys_at(tokens, lengths)


# ---- snapshot blobs -----------------------------------------------------------------------------


class SnapshotHeader(msgspec.Struct, frozen=True):
    """The verified header of a snapshot blob (see the module docstring for the byte layout).

    Checksums are zlib CRC-32, chosen over blake2b-16 for speed: a snapshot of a long V4-Flash
    conversation is gigabytes and CRC-32 runs ~4x faster here (2.1 vs 0.5 GB/s measured on the
    dev box), both releasing the GIL. The checksum only has to catch accidental damage (torn
    reads, reuse of a buffer after eviction, bit rot): what the payload *is* — model, revision,
    tokens, epoch — is established by the header fields, and CRC-32 detects every burst error up
    to 32 bits and misses other random damage with probability 2⁻³². Snapshots move inside a
    trusted cluster network (kv_sharing.md §4.4), so no adversarial collision resistance is
    needed; a header that is itself damaged fails `header_crc`."""

    magic: bytes
    layout_version: int
    model_id: str
    model_revision: str
    token_count: int
    token_key: str  # hex chain key of the snapshot's tokens
    epoch: int
    payload_bytes: int
    checksum: int  # CRC-32 of the payload
    header_crc: int  # CRC-32 of the fixed header (before this field) and the meta part
    payload_offset: int  # where the payload starts in the blob (64 + meta length)


def encode_snapshot(
    *, model_id: str, model_revision: str, token_count: int, token_key: str, epoch: int, payload: bytes | memoryview
) -> bytes:
    """Frame `payload` with a layout-1 header. `token_key` is the hex chain key of the tokens."""
    if not isinstance(model_revision, str):
        raise ValueError("model_revision must be a string")
    _model_prefix(model_id)
    key = bytes.fromhex(token_key)
    if len(key) != KEY_BYTES:
        raise ValueError(f"token_key must be {KEY_BYTES} bytes of hex")
    if token_count < 0 or epoch < 0:
        raise ValueError("token_count and epoch must be >= 0")
    meta = json.dumps({"model_id": model_id, "model_revision": model_revision}, separators=(",", ":")).encode()
    if len(meta) > _MAX_META:
        raise ValueError("model id/revision too long")
    payload = memoryview(payload).cast("B")
    head = _FIXED.pack(MAGIC, LAYOUT_VERSION, len(meta), token_count, epoch, len(payload), key, zlib.crc32(payload), 0)
    header_crc = zlib.crc32(meta, zlib.crc32(head[:_HEADER_CRC_AT]))
    return b"".join((head[:_HEADER_CRC_AT], struct.pack("<I", header_crc), meta, payload))


def _byte_view(blob: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(blob)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def read_header(blob: bytes | bytearray | memoryview) -> SnapshotHeader:
    """Parse and check the header alone (magic, version, header CRC, meta); payload not checked."""
    view = _byte_view(blob)
    if len(view) < FIXED_BYTES:
        raise SnapshotError(f"snapshot truncated: {len(view)} bytes, shorter than the {FIXED_BYTES}-byte header")
    magic, version, meta_len, count, epoch, payload_len, key, crc, header_crc = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise SnapshotError(f"not a dsuf snapshot (bad magic {magic!r})")
    if version != LAYOUT_VERSION:
        raise SnapshotError(f"unknown snapshot layout version {version} (this server reads {LAYOUT_VERSION})")
    if meta_len > _MAX_META or FIXED_BYTES + meta_len > len(view):
        raise SnapshotError("snapshot truncated inside its meta part")
    meta_raw = view[FIXED_BYTES : FIXED_BYTES + meta_len]
    if zlib.crc32(meta_raw, zlib.crc32(view[:_HEADER_CRC_AT])) != header_crc:
        raise SnapshotError("snapshot header checksum mismatch (damaged header)")
    try:
        meta = json.loads(bytes(meta_raw))
        model_id, revision = meta["model_id"], meta["model_revision"]
        assert isinstance(model_id, str) and isinstance(revision, str)
    except Exception:
        raise SnapshotError("snapshot meta part is not the expected JSON") from None
    return SnapshotHeader(
        magic=magic,
        layout_version=version,
        model_id=model_id,
        model_revision=revision,
        token_count=count,
        token_key=key.hex(),
        epoch=epoch,
        payload_bytes=payload_len,
        checksum=crc,
        header_crc=header_crc,
        payload_offset=FIXED_BYTES + meta_len,
    )


def decode_snapshot(
    blob: bytes | bytearray | memoryview,
    *,
    expect_model_id: str,
    expect_revision: str,
    expect_tokens: Sequence[int] | Any | None = None,
    expect_key: str | None = None,
    expect_epoch: int | None = None,
) -> tuple[SnapshotHeader, memoryview]:
    """Verify a snapshot blob and return (header, payload view).

    Checks magic, layout version, header CRC, model id, revision, payload length, the token
    count and chain key (recomputed from `expect_tokens` when given; compared with `expect_key`
    when given — e.g. the name it was looked up under), the epoch (must equal `expect_epoch` when
    given: a different epoch is a stale or foreign owner), and last the payload CRC. Raises
    `SnapshotError` on the first mismatch."""
    header = read_header(blob)
    if header.model_id != expect_model_id:
        raise SnapshotError(f"snapshot is for model {header.model_id!r}, not {expect_model_id!r}")
    if header.model_revision != expect_revision:
        raise SnapshotError(f"snapshot is for revision {header.model_revision!r}, not {expect_revision!r}")
    view = _byte_view(blob)
    have = len(view) - header.payload_offset
    if have != header.payload_bytes:
        what = "truncated" if have < header.payload_bytes else "has trailing bytes"
        raise SnapshotError(f"snapshot {what}: payload {have} bytes, header says {header.payload_bytes}")
    if expect_tokens is not None:
        tokens = token_array(expect_tokens)
        if len(tokens) != header.token_count:
            raise SnapshotError(f"snapshot covers {header.token_count} tokens, expected {len(tokens)}")
        if chain_key(expect_model_id, tokens) != header.token_key:
            raise SnapshotError("snapshot tokens differ from the expected tokens (chain key mismatch)")
    if expect_key is not None and expect_key != header.token_key:
        raise SnapshotError(f"snapshot chain key {header.token_key} is not the expected {expect_key}")
    if expect_epoch is not None and header.epoch != expect_epoch:
        raise SnapshotError(f"snapshot epoch {header.epoch} is stale or foreign (expected {expect_epoch})")
    payload = view[header.payload_offset :]
    if zlib.crc32(payload) != header.checksum:
        raise SnapshotError("snapshot payload checksum mismatch (damaged or torn payload)")
    return header, payload


# ---- SequenceState <-> snapshot -----------------------------------------------------------------


class Named(NamedTuple):
    """Tokens known by their chain key and count only (the worker never holds a whole prompt)."""

    key: str
    count: int


def _named(model_id: str, tokens: Sequence[int] | Named | Any) -> Named:
    if isinstance(tokens, Named):
        return tokens
    arr = token_array(tokens)
    return Named(chain_key(model_id, arr), len(arr))


def snapshot_state(state: SequenceState, model_id: str, revision: str, tokens: Sequence[int] | Named | Any, epoch: int = 0) -> bytes:
    """Snapshot `state`, which must be the state after exactly `tokens`."""
    named = _named(model_id, tokens)
    if state.pos != named.count:
        raise ValueError(f"state is at position {state.pos} but {named.count} tokens were given")
    return encode_snapshot(
        model_id=model_id,
        model_revision=revision,
        token_count=named.count,
        token_key=named.key,
        epoch=epoch,
        payload=state.to_bytes(),
    )


def restore_state(
    config: ModelConfig,
    blob: bytes | bytearray | memoryview,
    *,
    model_id: str,
    revision: str,
    tokens: Sequence[int] | Named | Any,
    epoch: int | None = None,
) -> SequenceState:
    """Verify `blob` against (model, revision, tokens, epoch) and rebuild its SequenceState.

    Every failure — header, checksum, or a state that does not fit `config` — is a SnapshotError."""
    named = _named(model_id, tokens)
    header, payload = decode_snapshot(
        blob, expect_model_id=model_id, expect_revision=revision, expect_key=named.key, expect_epoch=epoch
    )
    if header.token_count != named.count:
        raise SnapshotError(f"snapshot covers {header.token_count} tokens, expected {named.count}")
    try:
        # SequenceState.from_bytes json-parses a slice of its input, which needs bytes (one copy).
        state = SequenceState.from_bytes(config, bytes(payload))
    except (StateError, ValueError, KeyError, IndexError, TypeError, struct.error) as e:
        raise SnapshotError(f"snapshot state does not fit this model: {e}") from None
    if state.pos != header.token_count:
        raise SnapshotError(f"snapshot state is at position {state.pos}, header says {header.token_count} tokens")
    return state


def stamp_epoch(blob: bytearray | memoryview, epoch: int) -> None:
    """Rewrite a (writable) snapshot's epoch in place, after its owner claimed it at that epoch.

    Only the fixed header changes (epoch and header CRC); the payload and its CRC are untouched,
    so this costs the same for any snapshot size."""
    view = _byte_view(blob)
    header = read_header(view)
    _FIXED.pack_into(
        view, 0, MAGIC, LAYOUT_VERSION, header.payload_offset - FIXED_BYTES, header.token_count, epoch,
        header.payload_bytes, bytes.fromhex(header.token_key), header.checksum, 0,
    )
    crc = zlib.crc32(view[FIXED_BYTES : header.payload_offset], zlib.crc32(view[:_HEADER_CRC_AT]))
    struct.pack_into("<I", view, _HEADER_CRC_AT, crc)
