"""Conversation-cache snapshots and their host store.

A snapshot is named by the chain hash of its tokens, carries a header that the reader verifies
(any doubt means recompute, never a wrong cache), and restores a state that continues exactly like
the original. The store keeps snapshots under a byte budget, evicts least recently used ones,
never evicts one under lease, and finds the longest stored prefix of a new prompt.
"""

from __future__ import annotations

import struct
from array import array

import numpy as np
import pytest
import torch

from dsuf.kvcache.snapshot import (
    FIXED_BYTES,
    LAYOUT_VERSION,
    Named,
    PrefixHasher,
    SnapshotError,
    chain_key,
    decode_snapshot,
    encode_snapshot,
    prefix_keys,
    read_header,
    restore_state,
    snapshot_state,
    stamp_epoch,
)
from dsuf.kvcache.store import HostStore, SnapshotTooLarge, StoreFull
from dsuf.model import load_model
from dsuf.model.layers import Numerics

EXACT = Numerics("exact", torch.float32)
MODEL, REV = "deepseek-ai/DeepSeek-V4-Flash", "rev-a"


def rand_tokens(n: int, seed: int = 3, high: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(0, high, n).tolist()


# ---- chain keys ---------------------------------------------------------------------------------


def test_chain_keys_name_model_and_tokens():
    t = rand_tokens(100)
    k = chain_key(MODEL, t)
    assert len(k) == 32 and int(k, 16) >= 0
    assert chain_key(MODEL, list(t)) == k
    assert chain_key(MODEL, np.array(t, dtype=np.int64)) == k  # representation does not matter
    assert chain_key(MODEL, torch.tensor(t)) == k
    assert chain_key(MODEL, array("i", t)) == k
    assert chain_key("other-model", t) != k
    assert chain_key(MODEL, t[:-1]) != k
    assert chain_key(MODEL, t[:-1] + [t[-1] ^ 1]) != k
    assert chain_key(MODEL, [1, 2]) != chain_key(MODEL, [2, 1])
    # the model id is length-prefixed: no (model, tokens) pair can alias another
    assert chain_key("m", [0x41]) != chain_key("mA", [])
    assert chain_key(MODEL, []) != chain_key(MODEL, [0])


def test_token_ids_out_of_range_are_refused():
    for bad in ([-1], [2**31], [1.5], [[1, 2]]):
        with pytest.raises((ValueError, TypeError)):
            chain_key(MODEL, bad)


def test_keys_at_matches_chain_key_for_every_length():
    t = rand_tokens(70, seed=5)
    lengths = list(range(71))
    keys = prefix_keys(MODEL, t, lengths)
    assert keys == {n: chain_key(MODEL, t[:n]) for n in lengths}
    assert len(set(keys.values())) == 71
    # incremental: feeding in pieces gives the same keys, keys_at continues from what was fed
    h = PrefixHasher(MODEL)
    h.update(t[:20])
    assert h.key() == chain_key(MODEL, t[:20]) and h.count == 20
    more = h.keys_at(t[20:], [20, 33, 70])
    assert more == {n: keys[n] for n in (20, 33, 70)}
    assert h.count == 70 and h.key() == keys[70]
    h2 = PrefixHasher(MODEL)
    assert h2.keys_at(t, [5]) == {5: keys[5]}
    assert h2.count == 70 and h2.key() == keys[70]  # keys_at consumed all of its tokens
    with pytest.raises(ValueError):
        PrefixHasher(MODEL).keys_at(t[:10], [11])


def test_a_million_token_prefix_has_one_key_however_it_is_hashed():
    """A 1M-token context (a plain Python list: the slowest input form) hashed whole, at prefix
    points and incrementally gives the same keys (speed: see BENCHMARKS.md, not a timed test)."""
    t = rand_tokens(1_000_000, high=129_000)
    k = chain_key(MODEL, t)
    keys = prefix_keys(MODEL, t, [1000, 500_000, 999_999, 1_000_000])
    assert keys[1_000_000] == k and keys[500_000] == chain_key(MODEL, t[:500_000])
    h = PrefixHasher(MODEL)
    h.update(t[:999_999])
    assert h.key() == keys[999_999]


# ---- snapshot blobs -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir("default"))


@pytest.fixture(scope="module")
def taken(model):
    """(tokens of the whole conversation, first 37 of them, snapshot after those 37, epoch)."""
    seq = torch.tensor(rand_tokens(52, seed=11))
    state = model.new_state(EXACT)
    model.forward(seq[:37], state, EXACT)
    blob = snapshot_state(state, MODEL, REV, seq[:37], epoch=7)
    return seq, seq[:37].tolist(), blob


def test_a_restored_snapshot_continues_exactly_like_the_original(model, taken):
    seq, prefix, blob = taken
    original = model.new_state(EXACT)
    model.forward(seq[:37], original, EXACT)
    restored = restore_state(model.config, blob, model_id=MODEL, revision=REV, tokens=prefix, epoch=7)
    assert restored.pos == 37
    a, b = original.named_tensors(), restored.named_tensors()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    want = model.forward(seq[37:], original, EXACT)
    got = model.forward(seq[37:], restored, EXACT)
    assert torch.equal(got, want)
    header = read_header(blob)
    assert (header.model_id, header.model_revision, header.token_count, header.epoch) == (MODEL, REV, 37, 7)
    assert header.token_key == chain_key(MODEL, prefix)
    assert header.layout_version == LAYOUT_VERSION
    assert header.payload_bytes == len(blob) - header.payload_offset


def test_tokens_known_only_by_key_and_count_snapshot_and_restore_the_same(model, taken):
    # the worker never holds a whole prompt: it names the tokens by chain key and count
    seq, prefix, blob = taken
    named = Named(chain_key(MODEL, prefix), len(prefix))
    restored = restore_state(model.config, blob, model_id=MODEL, revision=REV, tokens=named)
    assert snapshot_state(restored, MODEL, REV, named, epoch=7) == blob
    with pytest.raises(SnapshotError, match="chain key"):
        restore_state(model.config, blob, model_id=MODEL, revision=REV, tokens=Named(chain_key(MODEL, prefix[:-1]), 37))
    with pytest.raises(SnapshotError, match="covers 37 tokens"):
        restore_state(model.config, blob, model_id=MODEL, revision=REV, tokens=Named(named.key, 36))


def test_stamping_an_epoch_rewrites_only_the_header(taken):
    _, prefix, blob = taken
    stamped = bytearray(blob)
    stamp_epoch(stamped, 12)
    header, payload = decode_snapshot(stamped, expect_model_id=MODEL, expect_revision=REV, expect_tokens=prefix, expect_epoch=12)
    assert header.epoch == 12 and bytes(payload) == blob[header.payload_offset :]
    assert stamped[FIXED_BYTES:] == blob[FIXED_BYTES:]
    with pytest.raises(SnapshotError, match="epoch 12 is stale"):
        decode_snapshot(stamped, expect_model_id=MODEL, expect_revision=REV, expect_epoch=7)


def test_snapshot_refuses_a_state_that_is_not_after_the_given_tokens(model, taken):
    seq, prefix, _ = taken
    state = model.new_state(EXACT)
    model.forward(seq[:5], state, EXACT)
    with pytest.raises(ValueError):
        snapshot_state(state, MODEL, REV, prefix, epoch=7)


def _flip(blob: bytes, at: int) -> bytes:
    b = bytearray(blob)
    b[at] ^= 0x01
    return bytes(b)


def _patch_fixed(blob: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(blob)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def _corruptions(blob: bytes, prefix: list[int]):
    """(name, blob, decode kwargs) for every way a snapshot must be refused."""
    ok = dict(expect_model_id=MODEL, expect_revision=REV, expect_tokens=prefix, expect_epoch=7)
    h = read_header(blob)
    payload = h.payload_offset
    yield "flipped payload byte (middle)", _flip(blob, payload + (len(blob) - payload) // 2), ok
    yield "flipped payload byte (last)", _flip(blob, len(blob) - 1), ok
    yield "flipped header byte (token count)", _flip(blob, 16), ok
    yield "flipped meta byte", _flip(blob, FIXED_BYTES + 3), ok
    yield "truncated payload", blob[:-1], ok
    yield "truncated to half", blob[: len(blob) // 2], ok
    yield "truncated inside header", blob[:40], ok
    yield "empty", b"", ok
    yield "trailing bytes", blob + b"\0", ok
    yield "wrong model id", blob, ok | {"expect_model_id": "deepseek-ai/DeepSeek-V4-Pro"}
    yield "wrong revision", blob, ok | {"expect_revision": "rev-b"}
    yield "wrong tokens (last differs)", blob, ok | {"expect_tokens": prefix[:-1] + [prefix[-1] ^ 1]}
    yield "wrong tokens (one fewer)", blob, ok | {"expect_tokens": prefix[:-1]}
    yield "wrong tokens (one more)", blob, ok | {"expect_tokens": prefix + [1]}
    yield "wrong expected key", blob, ok | {"expect_tokens": None, "expect_key": chain_key(MODEL, prefix[:-1])}
    yield "stale epoch", blob, ok | {"expect_epoch": 8}
    yield "older epoch", blob, ok | {"expect_epoch": 6}
    yield "bad magic", b"DSUFSNAQ" + blob[8:], ok
    yield "a bare SequenceState", blob[payload:], ok
    weak = dict(expect_model_id=MODEL, expect_revision=REV)  # nothing else to compare with
    yield "flipped header byte (epoch), no expectations", _flip(blob, 24 + 6), weak
    yield "flipped header byte (token key), no expectations", _flip(blob, 40), weak
    yield "flipped header byte (token count), no expectations", _flip(blob, 16), weak
    yield "unknown version", _patch_fixed(blob, 8, "<I", LAYOUT_VERSION + 1), ok
    yield "version 0", _patch_fixed(blob, 8, "<I", 0), ok


def test_every_corruption_is_refused(taken):
    _, prefix, blob = taken
    header, payload = decode_snapshot(blob, expect_model_id=MODEL, expect_revision=REV, expect_tokens=prefix, expect_epoch=7)
    assert bytes(payload) == blob[header.payload_offset :]
    names = []
    for name, bad, kwargs in _corruptions(blob, prefix):
        with pytest.raises(SnapshotError) as info:
            decode_snapshot(bad, **kwargs)
        message = str(info.value)
        assert message and "\n" not in message, name
        names.append(name)
    assert len(names) == 24


def test_error_messages_name_the_reason(taken):
    _, prefix, blob = taken
    ok = dict(expect_model_id=MODEL, expect_revision=REV, expect_tokens=prefix, expect_epoch=7)
    cases = {
        "magic": (b"XXXXXXXX" + blob[8:], ok),
        "version": (_patch_fixed(blob, 8, "<I", 2), ok),
        "model": (blob, ok | {"expect_model_id": "x"}),
        "revision": (blob, ok | {"expect_revision": "x"}),
        "epoch": (blob, ok | {"expect_epoch": 9}),
        "truncated": (blob[:-3], ok),
        "checksum": (_flip(blob, len(blob) - 1), ok),
    }
    for word, (bad, kwargs) in cases.items():
        with pytest.raises(SnapshotError, match=word):
            decode_snapshot(bad, **kwargs)


def test_restore_refuses_corrupt_and_mismatched_snapshots(model, taken):
    _, prefix, blob = taken
    cfg = model.config
    with pytest.raises(SnapshotError):
        restore_state(cfg, _flip(blob, len(blob) - 5), model_id=MODEL, revision=REV, tokens=prefix)
    with pytest.raises(SnapshotError):
        restore_state(cfg, blob, model_id=MODEL, revision=REV, tokens=prefix, epoch=1)
    with pytest.raises(SnapshotError):
        restore_state(cfg, blob, model_id=MODEL, revision=REV, tokens=prefix[1:] + [0])
    # a well-formed snapshot whose state belongs to another architecture
    other = cfg.replace(n_layers=cfg.n_layers - 1, compress_ratios=cfg.compress_ratios[:-1])
    with pytest.raises(SnapshotError, match="does not fit"):
        restore_state(other, blob, model_id=MODEL, revision=REV, tokens=prefix)
    # a header that lies about the state's position is caught after parsing
    h = read_header(blob)
    lying = encode_snapshot(
        model_id=MODEL, model_revision=REV, token_count=36, token_key=chain_key(MODEL, prefix[:36]), epoch=7,
        payload=blob[h.payload_offset :],
    )
    with pytest.raises(SnapshotError, match="position"):
        restore_state(cfg, lying, model_id=MODEL, revision=REV, tokens=prefix[:36])


def test_encode_decode_round_trip_of_an_arbitrary_payload():
    payload = bytes(range(256)) * 3
    blob = encode_snapshot(model_id="m", model_revision="", token_count=3, token_key=chain_key("m", [1, 2, 3]), epoch=0, payload=payload)
    header, view = decode_snapshot(blob, expect_model_id="m", expect_revision="", expect_tokens=[1, 2, 3], expect_epoch=0)
    assert bytes(view) == payload and header.checksum and header.epoch == 0
    # decoding without optional expectations still checks the rest
    decode_snapshot(memoryview(blob), expect_model_id="m", expect_revision="")
    with pytest.raises(SnapshotError):
        decode_snapshot(_flip(blob, len(blob) - 1), expect_model_id="m", expect_revision="")


# ---- the host store -----------------------------------------------------------------------------


def blob(n: int, fill: int = 0) -> bytes:
    return bytes([fill]) * n


def test_lru_eviction_under_the_budget():
    s = HostStore(1000)
    assert s.put("a", 1, blob(300)) == []
    assert s.put("b", 2, blob(300)) == []
    assert s.put("c", 3, blob(300)) == []
    assert s.bytes_used == 900 and len(s) == 3
    assert s.put("d", 4, blob(300)) == ["a"]  # oldest goes first
    assert s.put("e", 5, blob(500)) == ["b", "c"]  # as many as needed, oldest first
    assert [e.key for e in s.entries()] == ["d", "e"]
    assert s.bytes_used == 800 and "a" not in s and "d" in s
    assert s.get("a") is None


def test_get_refreshes_recency():
    s = HostStore(900)
    for k in "abc":
        s.put(k, 1, blob(300))
    assert s.get("a") == blob(300)
    assert s.put("d", 1, blob(300)) == ["b"]
    assert [e.key for e in s.entries()] == ["c", "a", "d"]


def test_replacing_a_key_frees_its_old_bytes():
    s = HostStore(1000)
    s.put("a", 1, blob(400))
    s.put("b", 1, blob(400))
    assert s.put("b", 1, blob(600, 1)) == []  # old "b" (400) goes, 400 + 600 fits
    assert s.get("b") == blob(600, 1) and s.bytes_used == 1000 and len(s) == 2


def test_a_fragmented_arena_evicts_until_one_run_fits():
    # Free bytes in two runs ([0, 300) and [600, 1000)) hold 700, but 500 needs one run: the
    # store evicts further, least recently used first, rather than moving blobs around.
    s = HostStore(1000)
    for k in "abc":
        s.put(k, 1, blob(300))
    s.get("a")  # "b" is now the least recently used
    assert s.put("d", 1, blob(100)) == []  # [900, 1000)
    s.drop("a")  # frees [0, 300)
    assert s.put("e", 1, blob(400)) == ["b"]  # 300 free + "b" makes [0, 600)
    assert s.put("f", 1, blob(500)) == ["c"]  # free: [400, 600) → evict "c" → [400, 900)
    assert sorted(k for k, *_ in s.entries()) == ["d", "e", "f"] and s.bytes_used == 1000


def test_leased_entries_are_not_evicted():
    s = HostStore(1000)
    s.put("a", 1, blob(300, 1))
    s.put("b", 2, blob(300, 2))
    s.put("c", 3, blob(300, 3))
    with s.lease("a") as data:
        assert data == blob(300, 1) and s.leases("a") == 1
        assert s.put("d", 4, blob(300)) == ["b"]  # "a" is older but pinned
        assert s.put("e", 5, blob(300)) == ["c"]
        assert "a" in s
    assert s.leases("a") == 0
    assert s.put("f", 6, blob(300)) == ["a"]  # unpinned again: evictable


def test_store_full_when_only_leased_entries_remain():
    s = HostStore(1000)
    s.put("a", 1, blob(400))
    s.put("b", 2, blob(400))
    with s.lease("a"), s.lease("b"):
        with pytest.raises(StoreFull):
            s.put("c", 3, blob(300))
        assert len(s) == 2 and s.bytes_used == 800  # nothing evicted by the refusal
    s2 = HostStore(1000)
    s2.put("a", 1, blob(500))
    s2.put("b", 2, blob(300))
    with s2.lease("a"):
        with pytest.raises(StoreFull):  # evicting "b" alone is not enough: refuse, evict nothing
            s2.put("c", 3, blob(600))
        assert "b" in s2 and s2.bytes_used == 800
    with pytest.raises(KeyError):
        with s2.lease("missing"):
            pass


def test_oversize_is_refused_and_evicts_nothing():
    s = HostStore(1000)
    s.put("a", 1, blob(600))
    with pytest.raises(SnapshotTooLarge, match="budget"):
        s.put("big", 9, blob(1001))
    assert "a" in s and s.bytes_used == 600 and "big" not in s
    assert s.put("exact", 9, blob(1000)) == ["a"]  # exactly the budget fits


def test_drop_while_leased_keeps_bytes_until_the_lease_ends():
    s = HostStore(1000)
    s.put("a", 1, blob(600))
    with s.lease("a") as data:
        assert s.drop("a") is True
        assert "a" not in s and s.get("a") is None and data == blob(600)
        assert s.bytes_used == 600
        with pytest.raises(StoreFull):
            s.put("b", 2, blob(500))
    assert s.bytes_used == 0
    assert s.drop("a") is False
    assert s.put("b", 2, blob(500)) == []


def test_entries_report_for_tools():
    s = HostStore(10_000)
    s.put("a", 10, blob(100))
    s.put("b", 20, blob(200))
    (ka, ta, ba, age_a), (kb, tb, bb, age_b) = s.entries()
    assert (ka, ta, ba, kb, tb, bb) == ("a", 10, 100, "b", 20, 200)
    assert 0 <= age_b <= age_a < 60


def test_longest_prefix_finds_the_longest_stored_prefix():
    conv = rand_tokens(60, seed=21)
    s = HostStore(1 << 20)
    for n in (10, 25, 40):
        s.put(chain_key(MODEL, conv[:n]), n, blob(100, n))
    s.put(chain_key("other-model", conv[:50]), 50, blob(100))  # same tokens, other model
    s.put(chain_key(MODEL, rand_tokens(45, seed=99)), 45, blob(100))  # another conversation

    query = conv[:45]  # first 40 match the longest stored prefix
    assert s.longest_prefix(MODEL, query) == (chain_key(MODEL, conv[:40]), 40)
    diverged = conv[:30] + [conv[30] ^ 1] + conv[31:45]  # token 30 differs
    assert s.longest_prefix(MODEL, diverged) == (chain_key(MODEL, conv[:25]), 25)
    assert s.longest_prefix(MODEL, conv[:40]) == (chain_key(MODEL, conv[:40]), 40)  # exact match
    assert s.longest_prefix(MODEL, conv[:40], max_tokens=39) == (chain_key(MODEL, conv[:25]), 25)
    assert s.longest_prefix(MODEL, conv[:9]) is None  # shorter than every stored prefix
    assert s.longest_prefix(MODEL, [conv[0] ^ 1] + conv[1:45]) is None  # first token differs
    assert s.longest_prefix("third-model", conv) is None
    assert s.longest_prefix(MODEL, []) is None
    key40, _ = s.longest_prefix(MODEL, query)
    s.drop(key40)
    assert s.longest_prefix(MODEL, query) == (chain_key(MODEL, conv[:25]), 25)
    assert HostStore(10).longest_prefix(MODEL, conv) is None


def test_store_and_snapshot_together(model, taken):
    """A prompt that extends a cached conversation finds its snapshot, which verifies and restores."""
    seq, prefix, snap = taken
    s = HostStore(4 * len(snap))
    s.put(chain_key(MODEL, prefix), len(prefix), snap)
    key, n = s.longest_prefix(MODEL, seq.tolist(), max_tokens=len(seq) - 1)
    assert n == 37
    with s.lease(key) as data:
        header, _ = decode_snapshot(data, expect_model_id=MODEL, expect_revision=REV, expect_key=key, expect_epoch=7)
        state = restore_state(model.config, data, model_id=MODEL, revision=REV, tokens=seq[:n])
    assert header.token_count == n and state.pos == n
