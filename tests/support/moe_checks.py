"""Comparison of GPU MoE outputs with the float64 reference, shared by the GPU tests.

Tolerance: relative L2 error per token row <= ROW_TOL and over the whole output <= TOTAL_TOL.
The reference rounds both GEMM outputs to BF16 as the GPU does, so what remains is FP32 vs
float64 accumulation order (it can move a BF16 rounding by one ulp, and rarely an E2M1 code of
the intermediate by one step) and the final BF16 rounding. A wrong block scale or global scale
(>= 2x), a swapped nibble order, a dropped slot or a wrong expert each put at least one row far
above ROW_TOL.
"""

from __future__ import annotations

import torch

ROW_TOL = 0.02
TOTAL_TOL = 0.005


def check_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Assert no NaN, exact zeros where the reference is zero, and both tolerances."""
    assert not torch.isnan(got).any(), "NaN in the output (unwritten or poisoned element)"
    got, ref = got.double(), ref.double().to(got.device)
    if ref.numel() == 0:
        assert got.numel() == 0
        return
    assert ref.abs().max() > 0, "reference is all zeros: the case tests nothing"
    err = (got - ref).norm(dim=-1)
    scale = ref.norm(dim=-1)
    live = scale > 0
    assert torch.all(err[~live] == 0), "rows that must be zero are not"
    row_err = (err[live] / scale[live]).max().item() if live.any() else 0.0
    total = ((got - ref).norm() / ref.norm()).item()
    assert row_err <= ROW_TOL and total <= TOTAL_TOL, f"worst row {row_err:.3e}, total {total:.3e}"
