"""The explicit decoding state of one sequence, and its serialised form.

Everything the model remembers about a sequence lives here, nothing in the model objects, so a
state can be snapshotted after any token and resumed elsewhere (conversation caches):

- per layer, the sliding-window ring: `window[pos % W]` holds the KV entry of position `pos`;
- per compressing layer, the compressed entries emitted so far (`compressed`, entry j covers
  the group starting at position ratio·j) and the compressor's partial state (`compressor.kv`
  and `.score`, float32 [coff·ratio, coff·width]: for overlapping ratio-4 compressors rows
  [0, ratio) are the previous complete group's overlap slots and rows [ratio, 2·ratio) the
  current group; otherwise rows [0, ratio) are the current group; only the first pos % ratio
  rows of the current group are meaningful);
- per CSA layer, the indexer's compressed keys (`index_keys`) and its compressor state;
- the same window state for each MTP layer.

Serialised layout (version 1, all integers little-endian):

    8 bytes   magic b"DSUFSEQ1"
    4 bytes   u32 length N of the header
    N bytes   UTF-8 JSON header {"version": 1, "pos": int, "tensors": [[name, dtype, shape], ...]}
    then      each tensor's raw bytes, C-contiguous, in header order

Tensor names: `layers.{i}.window`, `layers.{i}.compressed`, `layers.{i}.compressor.kv`,
`layers.{i}.compressor.score`, `layers.{i}.index_keys`, `layers.{i}.indexer.kv`,
`layers.{i}.indexer.score`, `mtp.{i}.window`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import torch

from .config import ModelConfig

MAGIC = b"DSUFSEQ1"
VERSION = 1
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


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
    window: torch.Tensor  # [W, head_dim], slot pos % W
    compressed: torch.Tensor | None = None  # [n_entries, head_dim]
    compressor: CompressorState | None = None
    index_keys: torch.Tensor | None = None  # [n_entries, index_head_dim]
    indexer: CompressorState | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"window": self.window}
        if self.compressed is not None:
            out |= {"compressed": self.compressed, "compressor.kv": self.compressor.kv, "compressor.score": self.compressor.score}
        if self.index_keys is not None:
            out |= {"index_keys": self.index_keys, "indexer.kv": self.indexer.kv, "indexer.score": self.indexer.score}
        return out


def new_layer_state(c: ModelConfig, ratio: int, dtype: torch.dtype) -> LayerState:
    state = LayerState(window=torch.zeros(c.window_size, c.head_dim, dtype=dtype))
    if ratio:
        state.compressed = torch.zeros(0, c.head_dim, dtype=dtype)
        state.compressor = CompressorState.new(ratio, c.head_dim)
    if ratio == 4:
        state.index_keys = torch.zeros(0, c.index_head_dim, dtype=dtype)
        state.indexer = CompressorState.new(ratio, c.index_head_dim)
    return state


@dataclass
class SequenceState:
    """Decoding state of one sequence after `pos` tokens."""

    pos: int
    dtype: torch.dtype
    layers: list[LayerState]
    mtp: list[LayerState] = field(default_factory=list)

    @staticmethod
    def new(c: ModelConfig, dtype: torch.dtype) -> "SequenceState":
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
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.named_tensors().values())

    def to_bytes(self) -> bytes:
        tensors = self.named_tensors()
        header = {
            "version": VERSION,
            "pos": self.pos,
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
        entries = header["tensors"]
        dtype = _DTYPES.get(entries[0][1]) if entries else None
        if dtype is None:
            raise StateError("state has no recognisable window tensor")
        state = SequenceState.new(c, dtype)
        state.pos = int(header["pos"])
        expected = state.named_tensors()
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
                layer.window = loaded[p + "window"]
                if layer.compressed is not None:
                    layer.compressed = loaded[p + "compressed"]
                    layer.compressor = CompressorState(loaded[p + "compressor.kv"], loaded[p + "compressor.score"])
                if layer.index_keys is not None:
                    layer.index_keys = loaded[p + "index_keys"]
                    layer.indexer = CompressorState(loaded[p + "indexer.kv"], loaded[p + "indexer.score"])
        return state
