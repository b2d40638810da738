"""The launcher (dsuf.gpu.runtime) on the GPU: what a launch may ask of a kernel."""

from __future__ import annotations

import ctypes

import torch

from dsuf.gpu.runtime import get_kernel, ptr

DEFAULT_SHARED = 48 << 10  # what a kernel's static plus dynamic shared memory may be unless it opts in


def test_dynamic_shared_memory_on_top_of_a_kernels_static(cuda):
    """hc_chunk_mixes holds 48 KB of static shared memory, all that a kernel gets unless it opts
    in: a launch that asks for 1 KB of dynamic shared memory on top (unused by the kernel) runs only
    because the runtime opts a kernel in for any dynamic bytes, and computes what the launch
    without them computes."""
    from cuda.bindings import driver

    kernel = get_kernel("mhc", "hc_chunk_mixes", cuda)
    err, dev = driver.cuDeviceGet(torch.cuda.current_device())
    assert err == driver.CUresult.CUDA_SUCCESS
    err, static = driver.cuKernelGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, kernel._kernel, dev)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    assert static + 1024 > DEFAULT_SHARED, f"hc_chunk_mixes has {static} bytes of static shared memory"
    tokens, length = 64, 4 * 1024
    x = torch.randn(tokens, length, device=cuda).to(torch.bfloat16)
    fn = torch.randn(24, length, device=cuda)
    mixes = []
    for shared in (0, 1024):
        mix = torch.full((tokens, 24), float("nan"), device=cuda)
        kernel((1, 1, 1), 256, [ptr(x), ptr(fn), ptr(mix), ctypes.c_int(length), ctypes.c_int(tokens), ctypes.c_double(1e-6)], shared=shared)
        mixes.append(mix)
    torch.cuda.synchronize()
    assert not mixes[0].isnan().any() and torch.equal(*mixes)
