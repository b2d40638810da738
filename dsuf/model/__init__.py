"""Model core: config, checkpoint loading, quantisation codecs, the reference forward pass."""

from __future__ import annotations

from pathlib import Path

from .checkpoint import load_tensors
from .config import load_config
from .v4 import V4Model


def load_model(ckpt_dir: str | Path) -> V4Model:
    """Load a checkpoint folder (config.json + safetensors) onto the CPU reference path."""
    config = load_config(ckpt_dir)
    return V4Model(config, load_tensors(ckpt_dir, config))
