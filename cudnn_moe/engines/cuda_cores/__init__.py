"""The CUDA-core engine: the low-latency op's whole layer in two launches of kernels_cuda/low_latency/ll_moe.cu
(``engine``: what it serves and runs; ``kernels``: the launch wrappers)."""
