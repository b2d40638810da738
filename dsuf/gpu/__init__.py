"""The GPU fast path: CUDA kernels from `kernels_cu/`, compiled at run time with NVRTC.

- build.py    NVRTC compilation and the on-disk CUBIN cache (`dsuf build-kernels`)
- runtime.py  loading CUBINs with the driver API, launching on torch's current stream
- linear.py   FP8 activation quantisation and block-scaled FP8 linears (decode batches)
- moe.py      the decode MoE: routed FP4 experts and the FP8 shared expert
- norm.py     RMSNorm, alone and fused with the mHC stream collapse

Every kernel reproduces the reference numerics of `dsuf.model.layers` (tests/gpu check each one
against it). Importing this package needs neither a GPU nor NVRTC; using a kernel needs both.
"""
