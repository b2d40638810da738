"""Engram: V4.1's n-gram memory, read before the blocks of `engram_layer_ids`.

Three parts, each behind its own small interface:

- `NgramHasher`: token ids → per-layer hash ids. Ids go through a compressed vocabulary derived
  from the tokenizer (tokens that normalise alike collapse), then each position's last
  `max_ngram_size` compressed ids are hashed with per-layer odd multipliers into prime-sized
  bucket ranges, one per (n-gram size, head). The last `max_ngram_size − 1` ids are carried in the
  sequence state, so chunked prefill and decode hash exactly like one prefill.
- `EngramTable`: hash ids → table rows (FP8 with one E8M0 scale per 32 values, dequantised on
  lookup). The only thing that touches the ≈98 GB tables, so they can live elsewhere (host
  memory on the GPU path) without the rest noticing.
- `Engram`: rows → `wkv` → one key per stream and a shared value; a per-stream sigmoid gate of
  the key against the stream decides how much of the value is added.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import quant
from .layers import ACC, Linear, Numerics, f64

if TYPE_CHECKING:
    from .config import EngramConfig

DEAD = -1  # a compressed id that blocks n-gram look-back: before the sequence start, or an image token


# ---- the table layout: primes ---------------------------------------------------------------------

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic Miller–Rabin below 3.3e24


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def table_primes(e: EngramConfig) -> list[list[list[int]]]:
    """Bucket moduli [layer][n-gram size 2 … max][head]: for every (layer, n-gram size) the search
    restarts just below `engram_vocab_size` and takes the next primes no layer has used yet, so
    every (layer, n-gram size, head) owns a disjoint prime-sized range of its layer's table."""
    used: set[int] = set()
    primes = []
    for _ in e.layer_ids:
        per_layer = []
        for _ in range(e.max_ngram_size - 1):
            current, heads = e.vocab_size - 1, []
            for _ in range(e.n_heads):
                current += 1
                while current in used or not is_prime(current):
                    current += 1
                used.add(current)
                heads.append(current)
            per_layer.append(heads)
        primes.append(per_layer)
    return primes


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """int64 [layers, max_ngram_size]: odd multipliers from numpy's default_rng(10007 · layer),
    bounded so that compressed id × multiplier cannot overflow int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram_size, dtype=np.int64) for layer in layer_ids]
    return torch.from_numpy(np.stack(rows) * 2 + 1)


# ---- the compressed vocabulary ----------------------------------------------------------------------


def _normalizer():
    from tokenizers import Regex, normalizers

    # A token that is exactly one space would strip to nothing and merge with unrelated tokens:
    # a private-use sentinel carries it through Strip().
    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(),
        normalizers.Replace(sentinel, " "),
    ])


@functools.lru_cache(maxsize=4)
def _compressed_map(digest: str, tokenizer_json: str) -> tuple[torch.Tensor, int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    normalizer = _normalizer()
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    keys: dict[str, int] = {}
    lookup = torch.empty(n, dtype=torch.int64)
    for token_id, text in enumerate(texts):
        if "\ufffd" in text:  # a partial UTF-8 byte token: nothing to normalise, key it by its raw form
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup[token_id] = keys.setdefault(key, len(keys))
    return lookup, len(keys)


def compressed_vocabulary(tokenizer_json: str | Path) -> tuple[torch.Tensor, int]:
    """(compressed id of every token id, number of compressed ids) for a tokenizer.json: each token
    is decoded alone and normalised (NFKC, NFD, strip accents, lowercase, collapse whitespace);
    tokens with equal keys share an id, in order of first appearance."""
    text = Path(tokenizer_json).read_text()
    return _compressed_map(hashlib.blake2b(text.encode(), digest_size=16).hexdigest(), text)


# ---- hashing ------------------------------------------------------------------------------------------


class NgramHasher:
    """Token ids → hash ids [T, engram layers, n_hash_columns] (row indices into each layer's table)."""

    def __init__(self, e: EngramConfig, token_map: torch.Tensor, compressed_vocab_size: int) -> None:
        if compressed_vocab_size != e.compressed_vocab_size:
            raise ValueError(
                f"the tokenizer's compressed vocabulary has {compressed_vocab_size} ids but the config says "
                f"engram_compressed_vocab_size={e.compressed_vocab_size}: every hash would differ from training"
            )
        primes = table_primes(e)
        self.max_ngram = e.max_ngram_size
        self.token_map = token_map
        self.pad = int(token_map[e.pad_token_id])
        self.multipliers = hash_multipliers(e.layer_ids, e.max_ngram_size, compressed_vocab_size)
        self.primes = torch.tensor(primes)  # [layers, n-gram sizes, heads]
        flat = self.primes.flatten(1)
        self.offsets = (flat.cumsum(dim=1) - flat).view_as(self.primes)  # each range starts after the previous

    def new_history(self) -> torch.Tensor:
        """The compressed ids before position 0: none, so every look-back is blocked."""
        return torch.full((self.max_ngram - 1,), DEAD, dtype=torch.int64)

    def __call__(self, ids: torch.Tensor, history: torch.Tensor, dead: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] following `history` (the previous max_ngram−1 compressed ids); `dead` [T] marks
        tokens that take no part in any n-gram (image spans). Returns (hash ids, the new history)."""
        compressed = torch.where(dead, DEAD, self.token_map[ids])
        seq = torch.cat((history, compressed))
        T, n = ids.shape[0], self.max_ngram
        # Look-back stops for good at the first blocked slot: an n-gram never spans the sequence
        # start or an image; the blocked slots read the pad token's id instead.
        tokens, blocked = [], torch.zeros(T, dtype=torch.bool)
        for shift in range(n):
            source = seq[n - 1 - shift : n - 1 - shift + T]
            blocked = blocked | (source == DEAD)
            tokens.append(torch.where(blocked, self.pad, source))
        products = torch.stack(tokens, dim=-1).unsqueeze(1) * self.multipliers  # [T, layers, max_ngram]
        # XOR in one more look-back at a time: after shift k the running value hashes the (k+1)-gram.
        rolling, hashes = products[..., 0], []
        for k in range(1, n):
            rolling = rolling ^ products[..., k]
            hashes.append(rolling.unsqueeze(-1) % self.primes[:, k - 1] + self.offsets[:, k - 1])
        return torch.cat(hashes, dim=-1), seq[-(n - 1) :].clone()


# ---- the tables and the gated update --------------------------------------------------------------


class EngramTable:
    """One layer's table: FP8 rows [rows, head_dim] with E8M0 scales per `block` values. A rank
    of a tensor-parallel group holds the rows [start, start + held) and answers zero for others
    (the sum over ranks then holds every row exactly once)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, start: int = 0) -> None:
        self.weight, self.scale, self.start = weight, scale, start

    def lookup(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """Rows for hash ids [...] → float32 [..., head_dim]."""
        local = hash_ids - self.start
        held = (local >= 0) & (local < self.weight.shape[0])
        local = local.where(held, 0)
        rows = quant.dequant_fp8_rows(self.weight[local], self.scale[local])
        return rows.masked_fill(~held.unsqueeze(-1), 0)


class Engram:
    """X_i ← X_i + gate_i · value per stream i, where [key_1 … key_n, value] = wkv(gathered rows)
    and gate_i = σ(signed √ of the normalised dot of X_i with (q_weight·k_weight)_i ⊙ key_i)."""

    def __init__(self, table: EngramTable, wkv: Linear, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> None:
        self.table, self.wkv, self.eps = table, wkv, eps
        self.weight = q_weight.float() * k_weight.float()  # [n, D]; only ever used as the product
        self.hc, self.dim = q_weight.shape

    def __call__(self, x: torch.Tensor, hash_ids: torch.Tensor, text: torch.Tensor, num: Numerics) -> torch.Tensor:
        """x [T, n, D] streams; hash_ids [T, n_hash_columns] of this layer; text [T] (False: no update)."""
        rows = self.table.lookup(hash_ids).to(num.dtype)
        kv = self.wkv(rows.flatten(1), num)
        key, value = kv.float().split([self.hc * self.dim, self.dim], dim=-1)
        key = key.unflatten(-1, (self.hc, self.dim))
        h = x.float()
        # Normalised per (token, stream) over D, not jointly over the streams.
        rstd = torch.rsqrt(h.to(ACC).square().mean(-1) + self.eps).float() * torch.rsqrt(key.to(ACC).square().mean(-1) + self.eps).float()
        dot = (h * self.weight * key).to(ACC).sum(-1).float() * rstd * self.dim**-0.5
        gate = f64(lambda d: torch.sigmoid(d.abs().clamp_min(1e-6).sqrt().copysign(d)), dot)  # signed sqrt, as in training
        gate = gate.masked_fill(~text.unsqueeze(-1), 0)
        return (h + gate.unsqueeze(-1) * value.unsqueeze(1)).to(x.dtype)
