"""The SM90 engine: NVFP4 grouped GEMMs on Hopper with weights and tokens decoded exactly to BF16 in
registers and BF16 tensor-core MMA (kernels_cuda/sm90/); layouts in layout.py."""

from .engine import Sm90GemmEngine

__all__ = ["Sm90GemmEngine"]
