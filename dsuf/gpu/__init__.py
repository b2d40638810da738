"""The GPU fast path: CUDA kernels from `kernels_cu/`, compiled at run time with NVRTC.

- build.py    NVRTC compilation and the on-disk CUBIN cache (`dsuf build-kernels`)
- runtime.py  loading CUBINs with the driver API, launching on torch's current stream
- linear.py   FP8 activation quantisation and block-scaled FP8 linears (decode batches; prompt
              chunks through dense.py)
- dense.py    prompt-chunk matmuls: FP8 block-scaled GEMMs (cuBLAS), the FP4 experts' bf16 copy
- gemv.py     bf16-activation GEMVs: the compressors' bf16 projections, wo_a's grouped FP8 weight
- moe.py      the MoE: routed FP4 experts and the FP8 shared expert (decode kernels; prompt chunks)
- norm.py     RMSNorm, alone and fused with the mHC stream collapse
- mhc.py      mHC coefficients (mixes, Sinkhorn) and the stream update
- attention.py  FP8 KV entries (584 bytes) and sparse MQA decode over them, flash-decoding splits
- indexer.py  the lightning indexer at decode: FP4 index-key scores, top-k
- router.py   the MoE router (sqrt-softplus scores, biased top-k or hash routing)
- compressor.py  one decode step of the KV compressors (pooling, norm, RoPE, entry write, state)
- layer.py    a decode layer for a batch of sequences each at its own position, and its caches
- model.py    the GPU worker's model: slots, one CUDA graph per batch bucket, snapshots
- tp.py       tensor parallelism: how the weights split over one host's GPUs, the ranks' group
- collective.py  the ranks' all-reduce and all-gather (CUDA IPC peer memory, or NCCL)
- weights.py  random weights of the real shapes in checkpoint formats (bench, --random-weights)
- bench.py    `dsuf bench`: decode layers end to end against the HBM floor and the reference path
- timeline.py where a CUDA graph replay's time goes (`dsuf bench --model --trace`)

Every kernel reproduces the reference numerics of `dsuf.model.layers` (tests/gpu check each one
against it); where FP8 wgmma sums (sm_90a: the FP4 experts, the FP8 GEMM of up to 8 tokens,
prompt chunks' FP8 GEMMs), about 12 bits of each 32-product step, as DeepSeek's own FP8 GEMMs. Importing this package needs neither a GPU nor NVRTC; using a kernel needs both.
"""
