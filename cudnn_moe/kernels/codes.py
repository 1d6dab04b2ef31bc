"""Constants the CUDA sources share with Python, defined here only.

Every kernel module is compiled with ``cuda_defines()`` as ``-D`` options, so the ``.cu`` files use
these names without defining them (``kernels_cuda/common.cuh`` stops the build when one is
missing). ``tests/kernels/test_kernel_codes.py`` checks that every such name a source uses is defined here.
"""

from __future__ import annotations

import enum

from ..activations import ActivationKind


class RoutingFormat(enum.IntEnum):
    """How the stage kernel reads routing (``ROUTING_*`` in CUDA)."""

    PACKED = 0  # int32 [T, k]: signed expert id in bits 31..16, BF16 weight bits in 15..0
    FP32 = 1  # ids int32/int64 [T, k] + weights float32 [T, k]
    BF16 = 2  # ids int32/int64 [T, k] + weights bfloat16 [T, k]


class TokenLayout(enum.IntEnum):
    """How a GEMM engine reads its token operand, and so how permute and activation write it
    (``TOKENS_*`` in CUDA).

    NVFP4_LINEAR: packed E2M1 uint8 [R, K/2] + E4M3 scales [R, K/16] row-major.
    NVFP4_SWIZZLED_128X4: the same codes, scales in 128x4 tiles of the R x K/16 matrix.
    BF16_FRAGMENTS: decoded BF16 [R, K], columns in the SM90 token-fragment order
    (``cudnn_moe.engines.sm90.layout``; the mma.sync kernels).
    BF16_ROWS: decoded BF16 [R, K], natural column order (the SM90 wgmma kernel's gathered token rows).
    BF16_TILED: decoded BF16 in R x K storage (R % 8 == 0, K % 64 == 0) as K / 64 planes of R rows x 64 columns,
    row r of plane p at element (p R + r) 64 holding its 16-byte chunk j (columns 64 p + 8 j ..) at position
    j ^ (r % 8): a wgmma B tile's 128-byte swizzled shared-memory image, so the SM90 wgmma kernel copies a tile's
    rows of one plane in one bulk copy (``cudnn_moe.engines.sm90.layout.to_tiled_rows``; the second GEMM's tokens).
    """

    NVFP4_LINEAR = 0
    NVFP4_SWIZZLED_128X4 = 1
    BF16_FRAGMENTS = 2
    BF16_ROWS = 3
    BF16_TILED = 4

    @property
    def is_bf16(self) -> bool:
        """Decoded BF16 values in R x K storage (any of the three orders), no scales."""
        return self in (TokenLayout.BF16_FRAGMENTS, TokenLayout.BF16_ROWS, TokenLayout.BF16_TILED)

    @property
    def row_multiple(self) -> int:
        """The row count R of a buffer in this layout must be a multiple of this (8 for the tiled planes)."""
        return 8 if self is TokenLayout.BF16_TILED else 1


class IntermediateCode(enum.IntEnum):
    """What the activation stage makes of the activation before the second GEMM reads it (``INTER_*`` in CUDA;
    the activation kernel and the GEMMs' activation epilogues take it as an int).

    BF16: rounded to BF16 (nearest even); BF16 token layouts only.
    NVFP4: requantized to NVFP4 per 16 values with global scale one (E4M3 scale e4m3(amax / 6), E2M1 codes); in the
    NVFP4 layouts its codes and scales, in the BF16 layouts their exact decoded values.
    MXFP8: quantized to MXFP8 per 32 values (``cudnn_moe.formats.quantize_mxfp8``: E8M0 scale 2^clamp(floor(log2
    amax) - 8, -127, 127), E4M3 elements), held as the BF16 values element x scale; BF16 layouts only. Those are exact
    for every block whose amax is at least 2^-109 (its scale 2^-117 or more); below that an element under BF16's
    normal range is rounded to nearest even (the MX pair on the SM90 engine).
    """

    BF16 = 0
    NVFP4 = 1
    MXFP8 = 2


class LowLatencyWeightCode(enum.IntEnum):
    """Weight decoder a low-latency kernel module is compiled for (``LL_WEIGHTS_*``; the module's own
    choice arrives as ``-DLL_WEIGHTS=<value>``, see cudnn_moe.engines.cuda_cores.kernels)."""

    BF16 = 0
    FP16 = 1
    NVFP4 = 2  # E2M1 codes, E4M3 scales per 16, FP32 global per expert
    MXFP4 = 3  # E2M1 codes, E8M0 scales per 32
    MXINT4 = 4  # two's-complement INT4 codes, BF16 scales per 32
    FP8 = 5  # E4M3 codes, one FP32 scale per expert (as the global)
    FP8_BLOCK = 6  # E4M3 codes, FP32 scales per 128 x 128 block (DeepSeek FP8)
    MXFP8 = 7  # E4M3 codes, E8M0 scales per 32 (with MXFP8 tokens only)


class LowLatencyInputCode(enum.IntEnum):
    """Token input of a low-latency kernel module (``LL_INPUT_*``; chosen by ``-DLL_INPUT=<value>``)."""

    BF16 = 0
    FP16 = 1
    NVFP4 = 2  # packed E2M1 codes + linear E4M3 scales per 16 (global one), decoded exactly
    FP8 = 3  # E4M3 codes [T, H] of the per-tensor FP8 format (its input scale folded into the weights' factor)
    FP8_BLOCK = 4  # E4M3 codes [T, H] with FP32 scales [T, H/128], one per 128 values (DeepSeek FP8)
    MXFP8 = 5  # E4M3 codes [T, H] with E8M0 scales [T, H/32], one per 32 values (the MX pairs; MXFP8 intermediate)


SORT_THREADS = 1024  # threads of the single moe_sort block
SORT_MAX_EXPERTS = 512  # local experts one moe_sort block handles
SORT_WARP_SLOTS = 64  # most slots one warp sorts alone (two per lane: kernels_cuda/sort.cuh sort_slots_warp)
ROW_THREADS = 128  # threads per block of the row-wise glue kernels
LL_THREADS = 256  # threads per block of the low-latency GEMM kernels (eight warps)
LL_MAX_SLOTS = 256  # most routed slots (tokens x top_k) one low-latency call holds: 8 x 32
LL_MMA_STAGES = 4  # k64 steps in each warp's shared-memory ring of the tensor-core low-latency kernels
LL_MMA_WARP_ROWS = 32  # weight rows one warp of those kernels covers (two m16 tiles)
SM90_ROWS_STEP_K = 128  # K per ring step of the SM90 decode kernel's row-major NVFP4 form (K must be a multiple)
# The power of two an MXFP4 tile's scale byte carries beyond its block's scale 2^(j - a) (layout.py, MXFP4 tiles): the
# byte is the BF16 exponent field of 2^(j - a + 118), the multiplier that takes a placed code (E2M1 x 2^-126) to
# E2M1 x 2^(j - a - 8), which is where the NVFP4 tiles' products land too.
MXFP4_TILE_SCALE_POW2 = 118
# NVFP4 tiles store a block's E4M3 scale s as a code c whose BF16 multiplier s x 2^MXFP4_TILE_SCALE_POW2 has the bits
# 16 c + NVFP4_TILE_SCALE_BASE (layout.py, scale tiles): the base is the BF16 of 2^109, E4M3's least scale 2^-9 times
# 2^118, and the codes of the 126 positive scales run 0 .. 142 with their three mantissa bits in bits 4..6.
NVFP4_TILE_SCALE_BASE = (127 - 9 + MXFP4_TILE_SCALE_POW2) << 7


def cuda_defines() -> tuple[str, ...]:
    """The ``-DNAME=value`` options every kernel module is compiled with."""
    values = {f"ACT_{kind.name}": int(kind) for kind in ActivationKind}
    values.update({f"ROUTING_{fmt.name}": int(fmt) for fmt in RoutingFormat})
    values.update({f"TOKENS_{layout.name}": int(layout) for layout in TokenLayout})
    values.update({f"INTER_{code.name}": int(code) for code in IntermediateCode})
    values.update({f"LL_WEIGHTS_{fmt.name}": int(fmt) for fmt in LowLatencyWeightCode})
    values.update({f"LL_INPUT_{kind.name}": int(kind) for kind in LowLatencyInputCode})
    values.update(SORT_THREADS=SORT_THREADS, SORT_MAX_EXPERTS=SORT_MAX_EXPERTS, SORT_WARP_SLOTS=SORT_WARP_SLOTS,
                  LL_THREADS=LL_THREADS, LL_MAX_SLOTS=LL_MAX_SLOTS, LL_MMA_STAGES=LL_MMA_STAGES,
                  LL_MMA_WARP_ROWS=LL_MMA_WARP_ROWS, SM90_ROWS_STEP_K=SM90_ROWS_STEP_K,
                  MXFP4_TILE_SCALE_POW2=MXFP4_TILE_SCALE_POW2, NVFP4_TILE_SCALE_BASE=NVFP4_TILE_SCALE_BASE)
    return tuple(f"-D{name}={value}" for name, value in sorted(values.items()))
