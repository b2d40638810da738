"""A decode step's indices in one launch (`layer.step_indices`, kernels_cu/step_index.cu) are
`layer.step_index`'s, field for field and bit for bit (tests/test_gpu_step_index.py specifies
those against the reference's visibility rules)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsuf.gpu.layer import LayerCache, layer_rope, step_index, step_indices
from dsuf.gpu.weights import V4_FLASH_CONFIG
from dsuf.model.config import parse_config

C = parse_config(V4_FLASH_CONFIG)
SLOTS = 9


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("context", [4096, 65536])
def test_one_launch_makes_the_indices_the_torch_ops_make(cuda, rows, context):
    kinds = []
    for ratio in (0, 4, 128):
        cache = LayerCache.new(C, ratio, 1, context, cuda)  # (one slot's caches: n_max is what matters)
        kinds.append((ratio, cache.n_max, layer_rope(C, ratio, cuda)))
    edges = torch.tensor([0, 1, 3, 126, 127, 128, 511, 512, context - 2, context - 1])
    pos = torch.cat((edges, torch.randint(0, context, (rows,))))[torch.randperm(len(edges) + rows)[:rows]].to(cuda)
    slots = torch.randint(0, SLOTS, (rows,), device=cuda)
    got = step_indices(C, kinds, slots, pos)
    for ratio, n_max, rope in kinds:
        want = step_index(C, ratio, n_max, rope, slots, pos)
        for field in dataclasses.fields(want):
            a, b = getattr(want, field.name), getattr(got[ratio], field.name)
            if isinstance(a, torch.Tensor):
                assert b is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"ratio {ratio}: {field.name}"
            else:
                assert a == b, f"ratio {ratio}: {field.name} {a} against {b}"
