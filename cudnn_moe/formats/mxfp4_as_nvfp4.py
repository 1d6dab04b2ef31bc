"""MXFP4 re-encoded exactly with one power-of-two global 2^a per expert: the same E2M1 codes, each 32-value E8M0
block scale 2^j recoded as 2^(j - a), with every recoded scale inside E4M3's exact powers of two (from 2^-9, its
smallest subnormal, to 2^8). That is also an exact NVFP4 form (both 16-value halves of a block take the E4M3 scale
2^(j - a)), and the form the SM90 kernels run MXFP4 tiles in (``form_scales``: one byte per 32 values,
cudnn_moe.engines.sm90.layout).

An expert converts when the exponents j of its nonzero blocks span at most ``E4M3_POW2_SPAN`` (17) binades. Its
shift a is the one nearest 0 that fits them (0 whenever every j lies in [-9, 8]: the recoded scales are then the
MXFP4 scales themselves). A block whose codes are all +-0 contributes nothing whatever its scale: it gets scale byte 0
and does not count in the span (the zero padding of I carries scale byte 0, 2^-127).

Not convertible (``nvfp4_shifts`` says why): a NaN scale byte (255; the format's value is then NaN even
under zero codes), or an exponent above 125 (6 * 2^126 overflows FP32, where the format is decoded).

Then e2m1 * 2^(j - a) * 2^a equals the MXFP4 value e2m1 * 2^j for every element, and a GEMM that multiplies
its FP32 sum by the global computes the MXFP4 GEMM with every product shifted by the power of two 2^-a (the
same sums unless a partial sum leaves FP32's normal range by that shift: |a| <= 118, and a = 0 for weights
whose scales lie in [2^-9, 2^8]).
"""

from __future__ import annotations

import torch

from .blocks import check_codes, check_scales
from .mx import E8M0_BIAS, MX_BLOCK

E4M3_POW2_MIN, E4M3_POW2_MAX = -9, 8  # the powers of two E4M3 holds exactly: 2^-9 (subnormal) .. 2^8
E4M3_POW2_SPAN = E4M3_POW2_MAX - E4M3_POW2_MIN
MAX_EXPONENT = 125  # 6 * 2^125 is the largest MXFP4 value FP32 holds
_E8M0_NAN = 255


_CHUNK_BYTES = 1 << 28  # codes examined at once: bounds the temporaries of a large layer to about 2 x 256 MiB


def _nonzero_blocks(codes: torch.Tensor) -> torch.Tensor:
    """bool [E, R, K/32]: whether a 32-value block of packed E2M1 codes uint8 [E, R, K/2] holds a nonzero code."""
    step = max(1, _CHUNK_BYTES // max(1, codes[0].numel()))
    return torch.cat([
        ((part.reshape(*part.shape[:-1], -1, MX_BLOCK // 2) & 0x77) != 0).any(dim=-1)  # 0x77: both magnitudes
        for part in codes.split(step)
    ])


def _check(name: str, codes: torch.Tensor, scales: torch.Tensor) -> None:
    check_codes(f"{name} codes", codes, torch.uint8)
    if codes.dim() != 3 or codes.shape[-1] % (MX_BLOCK // 2):
        raise ValueError(f"{name} codes must be [E, R, K/2] with K % {MX_BLOCK} == 0, got {tuple(codes.shape)}")
    check_scales(f"{name} scales", scales, (torch.float8_e8m0fnu,),
                 (*codes.shape[:-1], 2 * codes.shape[-1] // MX_BLOCK))


def nvfp4_shifts(codes: torch.Tensor, scales: torch.Tensor, name: str = "weights") -> torch.Tensor | str:
    """Per expert, the shift a of the exact shifted form of MXFP4 weights (module docstring): int32 [E], or why
    they have none (naming ``name`` and the first expert that fails).

    codes: packed E2M1 uint8 [E, R, K/2] (element 2i in the low nibble); scales: float8_e8m0fnu [E, R, K/32].
    Reads the data (a device sync on CUDA): preparation, not the serving path."""
    _check(name, codes, scales)
    exponent = scales.view(torch.uint8).to(torch.int32) - E8M0_BIAS
    counted = _nonzero_blocks(codes)
    experts = exponent.shape[0]
    nan = (scales.view(torch.uint8) == _E8M0_NAN).reshape(experts, -1).any(dim=1)
    flat, counted = exponent.reshape(experts, -1), counted.reshape(experts, -1)
    hi = torch.where(counted, flat, torch.full_like(flat, -E8M0_BIAS - 1)).amax(dim=1)
    lo = torch.where(counted, flat, torch.full_like(flat, E8M0_BIAS + 1)).amin(dim=1)
    empty = ~counted.any(dim=1)
    hi, lo = torch.where(empty, 0, hi), torch.where(empty, 0, lo)
    nan_l, hi_l, lo_l = nan.tolist(), hi.tolist(), lo.tolist()
    for expert in range(experts):
        if nan_l[expert]:
            return f"{name} scales of expert {expert} hold an E8M0 NaN byte (255)"
        if hi_l[expert] > MAX_EXPONENT:
            return (f"{name} scales of expert {expert} reach 2^{hi_l[expert]}, above 2^{MAX_EXPONENT} (the MXFP4 "
                    "values would overflow FP32)")
        if hi_l[expert] - lo_l[expert] > E4M3_POW2_SPAN:
            return (f"{name} scales of expert {expert} span 2^{lo_l[expert]} .. 2^{hi_l[expert]}, more than the "
                    f"{E4M3_POW2_SPAN} binades E4M3 holds exactly")
    return torch.clamp(torch.zeros_like(hi), hi - E4M3_POW2_MAX, lo - E4M3_POW2_MIN).to(torch.int32)


def form_scales(codes: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """The recoded block scales float8_e8m0fnu [E, R, K/32]: 2^(j - shifts[e]) for a nonzero block (a byte in
    [127 - 9, 127 + 8]), byte 0 for an all-zero one. codes, scales as ``nvfp4_shifts``; shifts int32 [E] from it (so
    every recoded exponent lands in E4M3's powers of two). Device work only (no sync)."""
    _check("weights", codes, scales)
    byte = scales.view(torch.uint8).to(torch.int32) - shifts.to(scales.device)[:, None, None]
    return torch.where(_nonzero_blocks(codes), byte, 0).to(torch.uint8).view(torch.float8_e8m0fnu)


def nvfp4_globals(shifts: torch.Tensor) -> torch.Tensor:
    """float32 [E] globals 2^shifts (exact)."""
    return torch.ldexp(torch.ones(shifts.shape, dtype=torch.float32, device=shifts.device), shifts.to(torch.float32))
