"""Loading NVRTC-built kernels with the CUDA driver API and launching them on torch's streams.

A kernel file is compiled once per architecture (see build.py), loaded with cuLibraryLoadData
(context-independent: the driver loads it into a context on first use) and launched with
cuLaunchKernel on the caller's current torch stream, so kernels order with torch's own work and
can be captured in CUDA graphs.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Sequence

import torch

from .build import KernelCache, load_source

Arg = ctypes.c_void_p | ctypes.c_int | ctypes.c_float | ctypes.c_double | ctypes.Structure


def device_index(device: torch.device | int | None = None) -> int:
    """The ordinal of a CUDA device (None, or a device without an index: the current one)."""
    if isinstance(device, int):
        return device
    return device.index if device is not None and device.index is not None else torch.cuda.current_device()


def device_arch(device: torch.device | int | None = None) -> str:
    """The NVRTC target of a CUDA device: sm_90a on Hopper, sm_100a on B200/B300, else sm_XY."""
    return _arch(device_index(device))


@functools.cache
def _arch(index: int) -> str:  # asked at every launch: torch's device query costs microseconds
    major, minor = torch.cuda.get_device_capability(index)
    arch = f"sm_{major}{minor}"
    return arch + "a" if (major, minor) in ((9, 0), (10, 0)) else arch


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    """A tensor's device address as a kernel argument (None: a null pointer)."""
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


@functools.cache
def _driver():
    from cuda.bindings import driver

    return driver


def _check(err, what: str) -> None:
    driver = _driver()
    if err != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorString(err)
        raise RuntimeError(f"{what} failed: {err.name} ({text.decode() if text else '?'})")


# Programmatic dependent launch (Hopper and later): a kernel may be scheduled while the one before
# it on the stream runs; every kernel waits for its predecessor first (pdl_begin in common.cuh).
# DSUF_PDL=0 launches plainly, for comparison.
PDL = os.environ.get("DSUF_PDL", "1") != "0"


@functools.cache
def _pdl_attribute():
    driver = _driver()
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    return attr


def _launch_config(grid: tuple[int, int, int], block: int, shared: int, stream: int):
    """A CUlaunchConfig of this shape on `stream` (a raw handle), without attributes."""
    driver = _driver()
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes, config.hStream = shared, driver.CUstream(stream)
    return config


class Kernel:
    """One `extern "C"` kernel of a loaded library."""

    def __init__(self, handle, name: str) -> None:
        self.name = name
        self._kernel = handle
        self._function = _driver().CUfunction(int(handle))
        self._shared_granted: dict[int, int] = {}  # device ordinal -> dynamic bytes allowed
        # Launch configurations by (grid, block, shared bytes, stream): a prompt chunk launches
        # ~1,300 kernels from Python, and its host time, not the GPU's, bounds mid-size prompts.
        self._configs: dict[tuple, object] = {}
        self._clusters: dict[tuple[int, int, int], int] = {}  # (cluster CTAs, threads, device) -> clusters at once

    def _grant_shared(self, nbytes: int, device: int) -> None:
        """Raise the kernel's dynamic shared-memory limit on `device` to at least nbytes (opted in
        for any dynamic bytes: the 48 KB default counts the kernel's static shared memory too)."""
        if nbytes <= self._shared_granted.get(device, 0):
            return
        driver = _driver()
        err, dev = driver.cuDeviceGet(device)
        _check(err, "cuDeviceGet")
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        (err,) = driver.cuKernelSetAttribute(attribute, nbytes, self._kernel, dev)
        _check(err, f"cuKernelSetAttribute({self.name}, {nbytes} bytes of shared memory)")
        self._shared_granted[device] = nbytes

    def __call__(
        self,
        grid: tuple[int, int, int],
        block: int,
        args: Sequence[Arg],
        stream: torch.cuda.Stream | None = None,
        shared: int = 0,
    ) -> None:
        """Launch on `stream` (default: the current stream) with `shared` bytes of dynamic shared
        memory. Errors in the launch itself raise here; faults inside the kernel surface at the
        next synchronisation, as with torch."""
        driver = _driver()
        if min(grid) < 1:
            raise ValueError(f"{self.name}: empty grid {grid}")
        if stream is None:  # the raw handle: torch.cuda.current_stream() builds a Stream object
            device = torch.cuda.current_device()
            handle = torch._C._cuda_getCurrentRawStream(device)
        else:
            device, handle = device_index(stream.device), stream.cuda_stream
        self._grant_shared(shared, device)
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        if not PDL:
            (err,) = driver.cuLaunchKernel(self._function, *grid, block, 1, 1, shared, driver.CUstream(handle), ctypes.addressof(params), 0)
            _check(err, f"cuLaunchKernel({self.name})")
            return
        (err,) = driver.cuLaunchKernelEx(self._config(grid, block, shared, handle), self._function, ctypes.addressof(params), 0)
        _check(err, f"cuLaunchKernelEx({self.name})")

    def max_active_clusters(self, cluster: int, block: int, device: torch.device | int | None = None) -> int:
        """How many clusters of `cluster` CTAs (the kernel's compiled cluster size along y) of
        `block` threads the device runs at once: where SMs come in GPCs of different sizes, fewer
        than its SMs over `cluster`, and a launch of more takes a second wave."""
        index = device_index(device)
        key = (cluster, block, index)
        if key not in self._clusters:
            config = _launch_config((1, cluster, 1), block, 0, torch.cuda.current_stream(index).cuda_stream)
            err, n = _driver().cuOccupancyMaxActiveClusters(self._function, config)
            _check(err, f"cuOccupancyMaxActiveClusters({self.name})")
            self._clusters[key] = n
        return self._clusters[key]

    def _config(self, grid: tuple[int, int, int], block: int, shared: int, stream: int):
        """The CUlaunchConfig of a programmatic dependent launch, made once per shape and stream."""
        key = (*grid, block, shared, stream)
        config = self._configs.get(key)
        if config is None:
            if len(self._configs) >= 256:  # prompt chunks of many sizes: keep the recent shapes
                self._configs.clear()
            config = _launch_config(grid, block, shared, stream)
            config.attrs, config.numAttrs = [_pdl_attribute()], 1
            self._configs[key] = config
        return config


_lock = threading.Lock()


def load_library(cubin: bytes, what: str):
    """A CUBIN loaded into the process (`what` names it in errors)."""
    driver = _driver()
    (err,) = driver.cuInit(0)
    _check(err, "cuInit")
    err, library = driver.cuLibraryLoadData(cubin, None, None, 0, None, None, 0)
    _check(err, f"cuLibraryLoadData({what})")
    return library


def library_kernel(library, name: str, what: str) -> Kernel:
    """Kernel `name` of a loaded library."""
    err, handle = _driver().cuLibraryGetKernel(library, name.encode())
    _check(err, f"cuLibraryGetKernel({name} in {what})")
    return Kernel(handle, name)


@functools.cache
def _library(source_name: str, arch: str):
    return load_library(KernelCache().get(load_source(source_name), arch), f"kernels_cu/{source_name}.cu, {arch}")


_kernels: dict[tuple[str, str, str], Kernel] = {}  # (source, name, arch) -> loaded kernel


def get_kernel(source_name: str, name: str, device: torch.device | int | None = None) -> Kernel:
    """Kernel `name` of kernels_cu/SOURCE_NAME.cu built for the device's architecture (compiled
    or read from the cache on first use, then held for the process)."""
    key = (source_name, name, arch := device_arch(device))
    kernel = _kernels.get(key)  # (asked at every launch: the lock only where it may build)
    if kernel is None:
        with _lock:
            if key not in _kernels:
                _kernels[key] = library_kernel(_library(source_name, arch), name, f"kernels_cu/{source_name}.cu")
            kernel = _kernels[key]
    return kernel


TensorMap = ctypes.c_uint64 * 16  # a CUtensorMap's 128 opaque bytes (struct TensorMap in common.cuh)


@functools.lru_cache(maxsize=4096)
def _tensor_map_2d(address: int, rows: int, row_bytes: int, box_bytes: int, box_rows: int) -> TensorMap:
    driver = _driver()
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tmap = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, address,
        [u64(row_bytes), u64(rows)], [u64(row_bytes)], [u32(box_bytes), u32(box_rows)], [u32(1), u32(1)],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B, driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    _check(err, "cuTensorMapEncodeTiled")
    return TensorMap(*(int(word) for word in tmap.opaque))


def tensor_map_2d(t: torch.Tensor, box_bytes: int, box_rows: int) -> TensorMap:
    """A TMA map of a contiguous tensor seen as rows of bytes (its last dimension), copied in
    boxes of box_bytes x box_rows (tma_copy_2d); the maps of long-lived tensors (weights) are kept."""
    if not t.is_contiguous() or t.data_ptr() % 16 or (t.shape[-1] * t.element_size()) % 16:
        raise ValueError(f"tensor_map_2d: need a contiguous, 16-byte aligned tensor of 16-byte rows, got {tuple(t.shape)} {t.dtype}")
    row_bytes = t.shape[-1] * t.element_size()
    return _tensor_map_2d(t.data_ptr(), t.numel() * t.element_size() // row_bytes, row_bytes, box_bytes, box_rows)
