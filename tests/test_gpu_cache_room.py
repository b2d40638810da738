"""The GPU worker's caches are preallocated for --max-batch sequences of --max-model-len tokens:
sizes that cannot fit are refused at load with the largest batch that does (on the CPU: sizes
are computed on the meta device, exactly as the worker would allocate them)."""

from __future__ import annotations

import pytest
import torch

from dsuf.gpu.model import check_cache_room, new_caches
from dsuf.gpu.weights import V4_FLASH_CONFIG
from dsuf.model.config import parse_config

C = parse_config(V4_FLASH_CONFIG)
GIB = 1 << 30


def need(batch: int, context: int) -> int:
    caches, mtp = new_caches(C, batch, context, torch.device("meta"), mtp=True)
    return sum(cache.nbytes for cache in [*caches, mtp])


def test_the_meta_sizes_are_the_bytes_the_caches_take() -> None:
    caches, mtp = new_caches(C, 1, 1024, torch.device("cpu"), mtp=True)
    assert need(1, 1024) == sum(t.nbytes for cache in [*caches, mtp] for t in vars(cache).values() if isinstance(t, torch.Tensor))


def test_the_default_sizes_fit_a_tensor_parallel_rank_on_h200() -> None:
    """64 sequences of 65536 tokens: about 16 GiB, next to a rank's ~80 GB of weights on 141 GB."""
    assert need(64, 65536) < 20 * GIB
    check_cache_room(C, 64, 65536, True, free=55 * GIB)


def test_a_million_tokens_at_the_default_batch_is_refused_with_the_batch_that_fits() -> None:
    with pytest.raises(ValueError) as info:
        check_cache_room(C, 64, 1 << 20, True, free=55 * GIB, device="cuda:0")
    message = str(info.value)
    best = int(message.split("use --max-batch ")[1].split()[0])
    assert message.startswith(f"caches for 64 sequences of 1048576 tokens need {need(64, 1 << 20) / GIB:.1f} GiB on cuda:0, which has 55.0 GiB free")
    assert need(best, 1 << 20) <= 55 * GIB < need(best + 1, 1 << 20)
    check_cache_room(C, best, 1 << 20, True, free=55 * GIB)


def test_when_not_even_one_sequence_fits_it_says_so() -> None:
    with pytest.raises(ValueError, match="even one sequence does not fit, or lower --max-model-len"):
        check_cache_room(C, 8, 1 << 20, True, free=1 * GIB)
