"""The ``ll_mma`` engine: the low-latency layer of the FP8 weight formats (FP8 weight-only, per-tensor FP8,
DeepSeek FP8) and of the MX pairs (MXFP4 or MXFP8 weights with MXFP8 tokens) with tensor-core dot products, a
candidate next to the CUDA-core engine for the same calls.

It is the CUDA-core engine's driver (cudnn_moe.engines.cuda_cores.engine: the same launches, workspaces, prepared
weight records and rounding points) with the tensor-core tactic (cudnn_moe.engines.ll_mma.kernels). The
registry lists it after the CUDA-core engine, so "auto" keeps the CUDA cores; a config asks for it with
``engine="ll_mma"`` (and a tuner may time both). Numerics: as the CUDA-core engine's, rounding point for rounding
point (cudnn_moe.low_latency.reference): only the FP32 summation order inside each GEMM differs (the MX pairs: the
per-32 E8M0 scale products multiply FP32 partial sums of exactly one 32-value block, as on the CUDA cores). Its
kernels read row-major weights: an MXFP4 pair stored as SM90 tiles (prepared for SM90) runs on the sm90 and
cuda_cores engines instead (``check`` says so).

Architectures: mma.sync.m16n8k16 with BF16 / FP16 operands (SM80 on), cvt.rn.f16x2.e4m3x2 (SM89 on), cp.async
(SM80 on) and fma.rn.bf16x2 (SM80 on) are valid PTX on SM90, SM100, SM103, SM107 and SM120, so it declares
those, the FP8 formats' architectures (the kernels compile for sm_90a, sm_100a and sm_120a in the CPU tests).
"""

from __future__ import annotations

from ...arch import SM90, SM100, SM103, SM107, SM120
from ..base import MX_PAIRS, OP_LOW_LATENCY, Request, Service, Support, WeightFormat
from ..cuda_cores.engine import MAX_TOKENS, CudaCoresEngine
from .kernels import MMA, UNIT

FORMATS = frozenset({WeightFormat.FP8_WEIGHT_ONLY.value, WeightFormat.FP8_PER_TENSOR.value,
                     WeightFormat.DEEPSEEK_FP8.value, *(f.value for f in MX_PAIRS)})


class LlMmaEngine(CudaCoresEngine):
    """The low-latency FP8 formats and MX pairs on tensor cores (see the module docstring)."""

    name = "ll_mma"
    tactic = MMA
    services = (Service(OP_LOW_LATENCY, FORMATS, frozenset({SM90, SM100, SM103, SM107, SM120}), max_tokens=MAX_TOKENS),)

    @classmethod
    def check(cls, request: Request) -> Support:
        if request.tiled:
            return Support(False, "the ll_mma kernels read row-major weights; these are stored as SM90 tiles (the "
                                  "sm90 and cuda_cores engines read those)")
        for shape in request.shapes:
            if shape.k % UNIT:
                return Support(False, f"the ll_mma kernels need each GEMM's K to be a multiple of {UNIT}, got {shape.k}")
        return Support(True)
