"""The test suite, one package: folders mirror cudnn_moe (ops/fused, ops/aligned, ops/low_latency, pipeline, engines/
sm90|cudnn|cuda_cores, kernels, formats, cache) plus cli, packaging, distributed and benchmarks; the modules share
helpers through tests.support only. Being packages, the folders never appear on sys.path themselves (pytest puts
the checkout's root there), so a folder such as tests/engines/cudnn cannot pose as the cuDNN frontend ``cudnn``."""
