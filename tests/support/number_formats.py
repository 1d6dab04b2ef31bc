"""The number-format helpers of kernels_cuda/common.cuh (float_to_e4m3, float_to_e2m1, float_to_bf16 and the
decoders), checked built for the host (tests/kernels/test_kernels_compile.py) and on the device
(tests/kernels/test_kernels_gpu.py) with the same inputs against the same torch statements."""

from __future__ import annotations

import math

import torch

from cudnn_moe.formats import decode_e2m1, encode_e2m1
from cudnn_moe.formats.blocks import to_e4m3


def format_inputs() -> torch.Tensor:
    """float32 [N]: every finite E4M3 value, the E2M1 grid at several scales, the midpoints (ties) of both
    and the floats just around each, wide-range random values, specials (+-0, 448..480, inf, subnormals), NaN."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[e4m3.isfinite() & (e4m3 >= 0)].sort().values
    e2m1 = decode_e2m1(torch.arange(8, dtype=torch.uint8))
    grids = [e4m3, *(e2m1 * 2.0**p for p in range(-3, 4))]
    base = torch.cat([g for grid in grids for g in (grid, (grid[1:] + grid[:-1]) / 2)])
    near = torch.cat([base, torch.nextafter(base, torch.tensor(math.inf)), torch.nextafter(base, torch.tensor(0.0))])
    gen = torch.Generator().manual_seed(0)
    exponents = torch.randint(-24, 12, (20000,), generator=gen).float()
    randoms = (torch.rand(20000, generator=gen) + 1.0) * torch.exp2(exponents)
    specials = torch.tensor([0.0, 448.0, 464.0, 479.0, 480.0, 1e30, math.inf, 2.0**-10, 2.0**-10 * 1.0001, 1e-40])
    values = torch.cat([near, randoms, specials])
    return torch.cat([values, -values, torch.tensor([math.nan])])


def check_format_helpers(
    x: torch.Tensor, e4m3: torch.Tensor, e2m1: torch.Tensor, bf16: torch.Tensor, decoded: torch.Tensor
) -> None:
    """Compare helper outputs with torch and the project's codecs.

    x float32 [N]; e4m3, e2m1 uint8 [N] and bf16 int16 [N] (bits) are float_to_e4m3 / float_to_e2m1 /
    float_to_bf16 of x; decoded float32 [65536, 3] holds, for every 16-bit pattern i, bf16_to_float(i),
    e4m3_to_float(i & 0xFF) and e2m1_to_float(i & 0xF).
    """
    nan = x.isnan()
    finite = x[~nan]
    assert torch.equal(e4m3[~nan], to_e4m3(finite).view(torch.uint8))
    assert torch.equal(e2m1[~nan], encode_e2m1(finite))
    assert torch.equal(bf16[~nan], finite.to(torch.bfloat16).view(torch.int16))
    assert bool((e4m3[nan] == 0x7E).all()) and bool((e2m1[nan] == 0).all())  # never the E4M3 NaN code
    assert bool(bf16[nan].view(torch.bfloat16).isnan().all())

    patterns = torch.arange(65536, dtype=torch.int32)
    signed = torch.where(patterns >= 32768, patterns - 65536, patterns).to(torch.int16)
    want_bf16 = signed.view(torch.bfloat16).float()
    assert torch.equal(decoded[:, 0].contiguous().view(torch.int32), want_bf16.view(torch.int32))
    want_e4m3 = (patterns & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).float()
    torch.testing.assert_close(decoded[:, 1], want_e4m3, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(decoded[:, 2], decode_e2m1((patterns & 0xF).to(torch.uint8)))
