"""Run-time compilation of the CUDA kernels in `kernels_cu/` with NVRTC, cached on disk.

Each `kernels_cu/NAME.cu` is one compilation unit; `*.cuh` files beside it are handed to NVRTC as
headers (no CUDA include directory is needed: the kernels include nothing else). NVRTC compiles
straight to a CUBIN for one real architecture (`sm_90a` on Hopper, `sm_100a` on Blackwell); it
needs no GPU, so `dsuf build-kernels` and CI can build every kernel anywhere.

Cache entries live in `$DSUF_KERNEL_CACHE` (default `~/.cache/dsuf/kernels`), named by a hash of
everything that can change the binary: the source, every header, the architecture, the options
and the NVRTC version. An entry carries a checksum of its payload; an entry that fails the check
(truncated or corrupted) is rebuilt, never loaded.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels_cu"
"""The CUDA sources: `kernels_cu/` at the top of the checkout (dsuf is installed editable)."""

DEFAULT_ARCHS = ("sm_90a", "sm_100a")
BASE_OPTIONS = ("--std=c++17",)

_MAGIC = b"DSUFCUBIN1\n"
_ARCH_RE = re.compile(r"^sm_\d+[af]?$")


class NvrtcUnavailable(RuntimeError):
    """NVRTC (pip: cuda-bindings + nvidia-cuda-nvrtc, the `gpu` extra) cannot be loaded."""


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel; the message names the file and carries NVRTC's log."""


@dataclass(frozen=True)
class KernelSource:
    """One compilation unit and the headers it may include."""

    name: str  # file stem: kernels_cu/NAME.cu
    path: Path
    text: str
    headers: tuple[tuple[str, str], ...]  # (include name, text), sorted by name


def load_sources(kernel_dir: Path = KERNEL_DIR) -> list[KernelSource]:
    """Every `*.cu` in kernel_dir, sorted by name, each with all of the directory's `*.cuh`."""
    headers = tuple((p.name, p.read_text()) for p in sorted(kernel_dir.glob("*.cuh")))
    return [KernelSource(p.stem, p, p.read_text(), headers) for p in sorted(kernel_dir.glob("*.cu"))]


def load_source(name: str, kernel_dir: Path = KERNEL_DIR) -> KernelSource:
    """kernels_cu/NAME.cu with the directory's headers."""
    path = kernel_dir / f"{name}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"no kernel source {path}")
    headers = tuple((p.name, p.read_text()) for p in sorted(kernel_dir.glob("*.cuh")))
    return KernelSource(name, path, path.read_text(), headers)


def cache_root() -> Path:
    """$DSUF_KERNEL_CACHE, or ~/.cache/dsuf/kernels."""
    env = os.environ.get("DSUF_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dsuf" / "kernels"


def check_arch(arch: str) -> str:
    if not _ARCH_RE.match(arch):
        raise ValueError(f"not a real GPU architecture: {arch!r} (expected e.g. sm_90a or sm_100a)")
    return arch


def compile_options(arch: str, extra: Sequence[str] = ()) -> tuple[str, ...]:
    """The NVRTC options for one architecture: a CUBIN for exactly that chip."""
    return (*BASE_OPTIONS, f"--gpu-architecture={check_arch(arch)}", *extra)


def nvrtc_version() -> str:
    """NVRTC's version as 'MAJOR.MINOR'; raises NvrtcUnavailable when it cannot be loaded."""
    nvrtc = _nvrtc()
    err, major, minor = nvrtc.nvrtcVersion()
    _check(nvrtc, err, "nvrtcVersion")
    return f"{major}.{minor}"


def cache_key(source: KernelSource, arch: str, options: Sequence[str], version: str) -> str:
    """Hex digest naming a cache entry: changes with the source, any header, the architecture,
    the options or the NVRTC version."""
    h = hashlib.sha256()

    def field(data: str) -> None:
        raw = data.encode()
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)

    field(_MAGIC.decode())
    field(source.name)
    field(source.text)
    for name, text in source.headers:
        field(name)
        field(text)
    field(arch)
    for option in options:
        field(option)
    field(version)
    return h.hexdigest()


def compile_cubin(source: KernelSource, arch: str, extra_options: Sequence[str] = ()) -> tuple[bytes, str]:
    """Compile one source to a CUBIN for arch with NVRTC: (cubin, NVRTC's log)."""
    nvrtc = _nvrtc()
    options = compile_options(arch, extra_options)
    err, prog = nvrtc.nvrtcCreateProgram(
        source.text.encode(),
        source.path.name.encode(),
        len(source.headers),
        [text.encode() for _, text in source.headers],
        [name.encode() for name, _ in source.headers],
    )
    _check(nvrtc, err, "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        log = _program_log(nvrtc, prog)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(
                f"NVRTC failed to compile kernels_cu/{source.path.name} for {arch} "
                f"({_error_name(nvrtc, err)}):\n{log}"
            )
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(nvrtc, err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(nvrtc, err, "nvrtcGetCUBIN")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


class KernelCache:
    """CUBINs by cache key under `root`; compiles (and stores) on a miss or a bad entry."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else cache_root()
        self.compiles = 0  # NVRTC compilations done by this instance (hits do none)
        self.logs: dict[tuple[str, str], str] = {}  # (kernel, arch) -> log of the last compile

    def entry_path(self, source: KernelSource, arch: str, extra_options: Sequence[str] = ()) -> Path:
        key = cache_key(source, arch, compile_options(arch, extra_options), nvrtc_version())
        return self.root / f"{source.name}-{arch}-{key[:32]}.cubin"

    def get(self, source: KernelSource, arch: str, extra_options: Sequence[str] = ()) -> bytes:
        """The CUBIN of source for arch: from the cache when a valid entry exists, else compiled."""
        path = self.entry_path(source, arch, extra_options)
        cubin = _read_entry(path)
        if cubin is None:
            cubin, log = compile_cubin(source, arch, extra_options)
            self.compiles += 1
            self.logs[(source.name, arch)] = log
            _write_entry(path, cubin)
        return cubin


@dataclass(frozen=True)
class BuildResult:
    name: str
    arch: str
    size: int
    compiled: bool  # False: served from the cache


def build_all(
    archs: Sequence[str] = DEFAULT_ARCHS,
    cache: KernelCache | None = None,
    kernel_dir: Path = KERNEL_DIR,
    extra_options: Sequence[str] = (),
) -> list[BuildResult]:
    """Compile (or find in the cache) every kernel in kernel_dir for every arch."""
    cache = cache or KernelCache()
    results = []
    for source in load_sources(kernel_dir):
        for arch in archs:
            before = cache.compiles
            cubin = cache.get(source, arch, extra_options)
            results.append(BuildResult(source.name, arch, len(cubin), cache.compiles > before))
    return results


def _read_entry(path: Path) -> bytes | None:
    """The payload of a cache entry, or None if it is missing or fails its checksum."""
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    head = len(_MAGIC) + 32
    if len(blob) <= head or not blob.startswith(_MAGIC):
        return None
    payload = blob[head:]
    if hashlib.sha256(payload).digest() != blob[len(_MAGIC) : head]:
        return None
    return payload


def _write_entry(path: Path, payload: bytes) -> None:
    """Write atomically (temp file + rename), so readers never see half an entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # the `gpu` extra is not installed
        raise NvrtcUnavailable(f"NVRTC is not available ({exc}); install dsuf[gpu]") from exc
    try:
        nvrtc.nvrtcVersion()
    except Exception as exc:  # the bindings are there but libnvrtc is not
        raise NvrtcUnavailable(f"NVRTC is not available ({exc}); install dsuf[gpu]") from exc
    return nvrtc


def _error_name(nvrtc, err) -> str:
    _, name = nvrtc.nvrtcGetErrorString(err)
    return name.decode() if isinstance(name, bytes) else str(name)


def _check(nvrtc, err, what: str) -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {_error_name(nvrtc, err)}")


def _program_log(nvrtc, prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    _check(nvrtc, err, "nvrtcGetProgramLogSize")
    log = b" " * size
    (err,) = nvrtc.nvrtcGetProgramLog(prog, log)
    _check(nvrtc, err, "nvrtcGetProgramLog")
    return log.rstrip(b"\x00").decode(errors="replace").strip()
