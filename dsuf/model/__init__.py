"""Model core: config, checkpoint loading, quantisation codecs, the reference forward pass."""

from __future__ import annotations

from pathlib import Path

from .checkpoint import load_tensors
from .config import load_any_config
from .layers import ReferenceModel
from .v4 import V4Model
from .v41 import V41Model


def load_model(ckpt_dir: str | Path) -> ReferenceModel:
    """Load a checkpoint folder (config.json + safetensors) onto the CPU reference path; the model
    family follows from the config. V4.1 also reads the folder's tokenizer.json (Engram hashing)."""
    ckpt_dir = Path(ckpt_dir)
    config = load_any_config(ckpt_dir)
    tensors = load_tensors(ckpt_dir, config)
    if config.family == "v41":
        tokenizer = ckpt_dir / "tokenizer.json"
        if not tokenizer.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {ckpt_dir}: V4.1's Engram hashes token ids through it")
        return V41Model(config, tensors, tokenizer)
    return V4Model(config, tensors)
