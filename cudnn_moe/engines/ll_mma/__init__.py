"""The tensor-core low-latency engine for the FP8 weight formats and the MX pairs: the CUDA-core engine's driver and kernels
(kernels_cuda/low_latency/ll_moe.cu) with the dot products on mma.sync (``engine``: what it serves; ``kernels``:
its tactic, the build option and the work split)."""
