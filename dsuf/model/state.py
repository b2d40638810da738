"""The explicit decoding state of one sequence, and its serialised form.

Everything the model remembers about a sequence lives here, nothing in the model objects, so a
state can be snapshotted after any token and resumed elsewhere (conversation caches):

- per layer, the sliding-window ring: `window[pos % W]` holds the KV entry of position `pos`;
- per compressing layer (V4) or KV source (V4.1), the compressed entries emitted so far
  (`compressed`, entry j covers the group starting at position ratio·j) and the compressor's
  partial state (`compressor.kv` and `.score`, float32 [coff·ratio, coff·width]: for overlapping
  ratio-4 compressors rows [0, ratio) are the previous complete group's overlap slots and rows
  [ratio, 2·ratio) the current group; otherwise rows [0, ratio) are the current group; only the
  first pos % ratio rows of the current group are meaningful; V4.1's ratio-1 sources have none);
- the index keys: per CSA layer (V4, with its own compressor state `indexer.*`) or per KV source
  (V4.1, derived from the source's latents);
- the same window state for each V4 MTP layer;
- V4.1: the last max_ngram_size − 1 compressed token ids the Engram hash looks back on
  (`engram.history`, int64, −1 where there is none).

Packed caches (`packed`, V4.1 in reference numerics): the window, compressed and index-key rows are
kept as the bytes of their cache formats (`V41_WINDOW_KV`, `V41_COMPRESSED_KV`, `V41_INDEX_KEYS`)
rather than as the fake-quantised values, which they decode to bit for bit. That is what makes a
V4.1 snapshot cost 890 bytes per token at the released shapes. Otherwise rows are held in the
activation dtype.

Serialised layout (version 1, all integers little-endian):

    8 bytes   magic b"DSUFSEQ1"
    4 bytes   u32 length N of the header
    N bytes   UTF-8 JSON header {"version": 1, "pos": int, "dtype": activation dtype, "packed": bool,
              "tensors": [[name, dtype, shape], ...]}
    then      each tensor's raw bytes, C-contiguous, in header order

Tensor names: `layers.{i}.window`, `layers.{i}.compressed`, `layers.{i}.compressor.kv`,
`layers.{i}.compressor.score`, `layers.{i}.index_keys`, `layers.{i}.indexer.kv`,
`layers.{i}.indexer.score`, `mtp.{i}.window`, `engram.history`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import torch

from .config import ModelConfig
from .engram import DEAD
from .quant import PackedRows

MAGIC = b"DSUFSEQ1"
VERSION = 1
_ACTIVATION_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_DTYPES = _ACTIVATION_DTYPES | {"uint8": torch.uint8, "int64": torch.int64}

# V4.1's cache formats (model.md §5): window KV 528 B, compressed KV 288 B, index key 68 B.
V41_WINDOW_KV = PackedRows("fp8", 32, "ue8m0")
V41_COMPRESSED_KV = PackedRows("fp4", 16, "e4m3")
V41_INDEX_KEYS = PackedRows("fp4", 32, "ue8m0")


class StateError(ValueError):
    """Serialised state that does not fit the model it is loaded for."""


@dataclass
class CompressorState:
    kv: torch.Tensor  # float32 [coff·ratio, coff·width]
    score: torch.Tensor  # float32, same shape; -inf where empty

    @staticmethod
    def new(ratio: int, width: int) -> "CompressorState":
        coff = 2 if ratio == 4 else 1
        shape = (coff * ratio, coff * width)
        return CompressorState(torch.zeros(shape), torch.full(shape, float("-inf")))


@dataclass
class LayerState:
    window: torch.Tensor  # [W, head_dim] (packed: uint8 [W, row bytes]), slot pos % W
    compressed: torch.Tensor | None = None  # [n_entries, head_dim]
    compressor: CompressorState | None = None
    index_keys: torch.Tensor | None = None  # [n_entries, index_head_dim]
    indexer: CompressorState | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"window": self.window}
        if self.compressed is not None:
            out["compressed"] = self.compressed
        if self.compressor is not None:
            out |= {"compressor.kv": self.compressor.kv, "compressor.score": self.compressor.score}
        if self.index_keys is not None:
            out["index_keys"] = self.index_keys
        if self.indexer is not None:
            out |= {"indexer.kv": self.indexer.kv, "indexer.score": self.indexer.score}
        return out

    def load(self, named: dict[str, torch.Tensor]) -> None:
        """Take over the tensors of `tensors()`'s names (checked by the caller)."""
        self.window = named["window"]
        if self.compressed is not None:
            self.compressed = named["compressed"]
        if self.compressor is not None:
            self.compressor = CompressorState(named["compressor.kv"], named["compressor.score"])
        if self.index_keys is not None:
            self.index_keys = named["index_keys"]
        if self.indexer is not None:
            self.indexer = CompressorState(named["indexer.kv"], named["indexer.score"])


def new_layer_state(c: ModelConfig, ratio: int, dtype: torch.dtype) -> LayerState:
    state = LayerState(window=torch.zeros(c.window_size, c.head_dim, dtype=dtype))
    if ratio:
        state.compressed = torch.zeros(0, c.head_dim, dtype=dtype)
        state.compressor = CompressorState.new(ratio, c.head_dim)
    if ratio == 4:
        state.index_keys = torch.zeros(0, c.index_head_dim, dtype=dtype)
        state.indexer = CompressorState.new(ratio, c.index_head_dim)
    return state


def new_v41_layer_state(c: ModelConfig, layer: int, dtype: torch.dtype, packed: bool) -> LayerState:
    """Every layer keeps its window; only the KV sources keep compressed entries and index keys."""
    assert c.csa2 is not None

    def rows(n: int, fmt: PackedRows, width: int) -> torch.Tensor:
        return torch.zeros(n, fmt.row_bytes(width), dtype=torch.uint8) if packed else torch.zeros(n, width, dtype=dtype)

    state = LayerState(window=rows(c.window_size, V41_WINDOW_KV, c.head_dim))
    if layer in c.csa2.kv_source_layers:
        ratio = c.compress_ratios[layer]
        state.compressed = rows(0, V41_COMPRESSED_KV, c.head_dim)
        state.compressor = CompressorState.new(ratio, c.head_dim) if ratio > 1 else None
        state.index_keys = rows(0, V41_INDEX_KEYS, c.index_head_dim)
    return state


@dataclass
class SequenceState:
    """Decoding state of one sequence after `pos` tokens."""

    pos: int
    dtype: torch.dtype
    layers: list[LayerState]
    mtp: list[LayerState] = field(default_factory=list)
    packed: bool = False
    engram: torch.Tensor | None = None

    @staticmethod
    def new(c: ModelConfig, dtype: torch.dtype, packed: bool = False) -> "SequenceState":
        if c.family == "v41":
            assert c.engram is not None
            return SequenceState(
                pos=0,
                dtype=dtype,
                layers=[new_v41_layer_state(c, i, dtype, packed) for i in range(c.n_layers)],
                packed=packed,
                engram=torch.full((c.engram.max_ngram_size - 1,), DEAD, dtype=torch.int64),
            )
        if packed:
            raise StateError("V4-Flash caches are not packed")
        return SequenceState(
            pos=0,
            dtype=dtype,
            layers=[new_layer_state(c, c.compress_ratios[i], dtype) for i in range(c.n_layers)],
            mtp=[new_layer_state(c, 0, dtype) for _ in range(c.n_mtp_layers if c.dspark is None else 0)],
        )

    def named_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for prefix, group in (("layers", self.layers), ("mtp", self.mtp)):
            for i, layer in enumerate(group):
                out |= {f"{prefix}.{i}.{k}": v for k, v in layer.tensors().items()}
        if self.engram is not None:
            out["engram.history"] = self.engram
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.named_tensors().values())

    def to_bytes(self) -> bytes:
        tensors = self.named_tensors()
        header = {
            "version": VERSION,
            "pos": self.pos,
            "dtype": str(self.dtype).removeprefix("torch."),
            "packed": self.packed,
            "tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()],
        }
        head = json.dumps(header, separators=(",", ":")).encode()
        parts = [MAGIC, struct.pack("<I", len(head)), head]
        parts += [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors.values()]
        return b"".join(parts)

    @staticmethod
    def from_bytes(c: ModelConfig, data: bytes) -> "SequenceState":
        """Rebuild a state, checking every tensor's name, dtype and shape against the config."""
        if data[:8] != MAGIC:
            raise StateError("not a dsuf sequence state (bad magic)")
        (n,) = struct.unpack_from("<I", data, 8)
        header = json.loads(bytes(data[12 : 12 + n]))
        if header.get("version") != VERSION:
            raise StateError(f"unsupported state version {header.get('version')!r}")
        dtype = _ACTIVATION_DTYPES.get(header.get("dtype"))
        if dtype is None or not isinstance(header.get("packed"), bool):
            raise StateError(f"state has no valid activation dtype and packing ({header.get('dtype')!r}, {header.get('packed')!r})")
        state = SequenceState.new(c, dtype, header["packed"])
        state.pos = int(header["pos"])
        expected = state.named_tensors()
        entries = header["tensors"]
        if [e[0] for e in entries] != list(expected):
            raise StateError("state tensors do not match this model's layers")
        offset = 12 + n
        loaded: dict[str, torch.Tensor] = {}
        for name, dtype_name, shape in entries:
            template = expected[name]
            t_dtype = _DTYPES.get(dtype_name)
            growing = name.endswith(("compressed", "index_keys"))
            if t_dtype != template.dtype or (list(template.shape) != shape and not (growing and shape[1:] == list(template.shape[1:]))):
                raise StateError(f"state tensor {name} is {dtype_name}{shape}, expected {template.dtype}{list(template.shape)}")
            size = torch.Size(shape).numel() * template.element_size()
            raw = bytearray(data[offset : offset + size])
            if len(raw) != size:
                raise StateError("state is truncated")
            loaded[name] = torch.frombuffer(raw, dtype=torch.uint8).view(t_dtype).reshape(shape) if size else torch.zeros(shape, dtype=t_dtype)
            offset += size
        if offset != len(data):
            raise StateError("state has trailing bytes")
        for prefix, group in (("layers", state.layers), ("mtp", state.mtp)):
            for i, layer in enumerate(group):
                p = f"{prefix}.{i}."
                layer.load({k.removeprefix(p): v for k, v in loaded.items() if k.startswith(p)})
        if state.engram is not None:
            state.engram = loaded["engram.history"]
        return state
