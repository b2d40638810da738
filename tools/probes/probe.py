"""Loading a probe's kernels (tools/probes/NAME.cu, which may include kernels_cu/common.cuh)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dsuf.gpu.build import KERNEL_DIR, KernelCache, load_source  # noqa: E402
from dsuf.gpu.runtime import Kernel, device_arch, library_kernel, load_library  # noqa: E402


def probe_kernels(name: str, kernels: list[str]) -> dict[str, Kernel]:
    """The named kernels of tools/probes/NAME.cu, compiled by NVRTC for this GPU."""
    tmp = Path(tempfile.mkdtemp())
    shutil.copy(KERNEL_DIR / "common.cuh", tmp)
    shutil.copy(Path(__file__).resolve().parent / f"{name}.cu", tmp / f"{name}.cu")
    what = f"tools/probes/{name}.cu"
    library = load_library(KernelCache(tmp / "cache").get(load_source(name, tmp), device_arch()), what)
    return {k: library_kernel(library, k, what) for k in kernels}
