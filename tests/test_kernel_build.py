"""The NVRTC kernel build and its disk cache (no GPU needed: NVRTC compiles for any target)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsuf.gpu import build
from dsuf.gpu.build import KernelCache, KernelCompileError, KernelSource, cache_key, load_sources

try:
    build.nvrtc_version()
    NVRTC_MISSING = None
except build.NvrtcUnavailable as exc:
    NVRTC_MISSING = str(exc)

needs_nvrtc = pytest.mark.skipif(NVRTC_MISSING is not None, reason=f"NVRTC cannot be imported: {NVRTC_MISSING}")

GOOD = """#include "helper.cuh"
extern "C" __global__ void twice(float* x) { x[threadIdx.x] = twice_of(x[threadIdx.x]); }
"""
HELPER = "__device__ float twice_of(float v) { return 2.0f * v; }\n"


def write_kernels(tmp_path: Path, files: dict[str, str]) -> Path:
    d = tmp_path / "kernels_cu"
    d.mkdir()
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def source(text: str = GOOD, header: str = HELPER) -> KernelSource:
    return KernelSource("twice", Path("twice.cu"), text, (("helper.cuh", header),))


def test_cache_key_changes_with_every_input():
    base = cache_key(source(), "sm_90a", ("--std=c++17",), "13.0")
    variants = [
        cache_key(source(GOOD + "\n// edit"), "sm_90a", ("--std=c++17",), "13.0"),
        cache_key(source(header=HELPER + "// edit\n"), "sm_90a", ("--std=c++17",), "13.0"),
        cache_key(source(), "sm_100a", ("--std=c++17",), "13.0"),
        cache_key(source(), "sm_90a", ("--std=c++17", "-lineinfo"), "13.0"),
        cache_key(source(), "sm_90a", ("--std=c++17",), "13.1"),
    ]
    assert base == cache_key(source(), "sm_90a", ("--std=c++17",), "13.0")
    assert len({base, *variants}) == 1 + len(variants)


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DSUF_KERNEL_CACHE", str(tmp_path / "kc"))
    assert build.cache_root() == tmp_path / "kc"
    monkeypatch.delenv("DSUF_KERNEL_CACHE")
    assert build.cache_root() == Path.home() / ".cache" / "dsuf" / "kernels"


def test_bad_arch_is_refused():
    with pytest.raises(ValueError, match="sm_90a"):
        build.compile_options("compute_90")


@needs_nvrtc
def test_cache_hit_avoids_recompiling(tmp_path):
    kdir = write_kernels(tmp_path, {"twice.cu": GOOD, "helper.cuh": HELPER})
    (src,) = load_sources(kdir)
    first = KernelCache(tmp_path / "cache")
    cubin = first.get(src, "sm_90a")
    assert cubin.startswith(b"\x7fELF") and first.compiles == 1
    again = KernelCache(tmp_path / "cache")  # a fresh process would start like this
    assert again.get(src, "sm_90a") == cubin
    assert again.compiles == 0
    # A changed header is a different entry: compiled again.
    (kdir / "helper.cuh").write_text(HELPER.replace("2.0f", "3.0f"))
    (changed,) = load_sources(kdir)
    assert again.get(changed, "sm_90a") != cubin
    assert again.compiles == 1


@needs_nvrtc
@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_corrupted_cache_entry_is_rebuilt(tmp_path, damage):
    src = source()
    cache = KernelCache(tmp_path)
    cubin = cache.get(src, "sm_90a")
    path = cache.entry_path(src, "sm_90a")
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        path.write_bytes(blob[:-100] + bytes([blob[-100] ^ 0xFF]) + blob[-99:])
    else:
        path.write_bytes(b"")
    fresh = KernelCache(tmp_path)
    assert fresh.get(src, "sm_90a") == cubin
    assert fresh.compiles == 1
    assert path.read_bytes() == blob  # the entry was rewritten whole


@needs_nvrtc
def test_compile_error_names_the_kernel_and_shows_the_log(tmp_path):
    kdir = write_kernels(tmp_path, {"broken.cu": 'extern "C" __global__ void k() { undeclared_thing(); }\n'})
    (src,) = load_sources(kdir)
    with pytest.raises(KernelCompileError) as info:
        KernelCache(tmp_path / "cache").get(src, "sm_90a")
    message = str(info.value)
    assert "kernels_cu/broken.cu" in message and "sm_90a" in message
    assert "undeclared_thing" in message and "error" in message  # NVRTC's own log
    assert not list((tmp_path / "cache").glob("*.cubin"))  # nothing cached for a failure


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_every_kernel_compiles(tmp_path, arch):
    """Every kernels_cu/*.cu, for Hopper and Blackwell."""
    sources = load_sources()
    assert {s.name for s in sources} >= {"act_quant", "gemm", "indexer", "kv_cache", "mhc", "moe_combine", "rmsnorm", "router", "sparse_attn"}
    cache = KernelCache(tmp_path)
    for r in build.build_all([arch], cache):
        assert r.compiled and r.size > 0, r
    assert cache.compiles == len(sources)


@needs_nvrtc
def test_the_tools_probes_compile(tmp_path):
    """tools/probes/*.cu (the probes of tools/chain-probe, tools/fp8-sums-probe and
    tools/bandwidth-probe), beside the kernels' common.cuh as the tools compile them, for Hopper."""
    root = Path(__file__).resolve().parents[1]
    probes = sorted((root / "tools" / "probes").glob("*.cu"))
    kdir = write_kernels(tmp_path, {p.name: p.read_text() for p in probes} | {"common.cuh": (build.KERNEL_DIR / "common.cuh").read_text()})
    cache = KernelCache(tmp_path / "cache")
    assert {s.name for s in load_sources(kdir)} >= {"bandwidth", "chain", "fp8_sums"}
    for s in load_sources(kdir):
        assert cache.get(s, "sm_90a")
