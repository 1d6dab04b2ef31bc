"""The GPUs the SM90 engine's CPU tests decide for, as its variant rules read them: 132 SMs on the H100 SXM and the
H200 alike, and the peak DRAM bandwidth the driver's memory clock and bus width give (TB/s)."""

from __future__ import annotations

import torch

from cudnn_moe.arch import SM90
from cudnn_moe.engines.base import GemmEngine
from cudnn_moe.engines.sm90.engine import Sm90GemmEngine

SMS = 132
H100_TBS = 3.35  # 2619 MHz x 2 x 5120 bits
H200_TBS = 4.92  # 3201 MHz x 2 x 6144 bits


def bare_engine(dram_tbs: float = H200_TBS) -> Sm90GemmEngine:
    """An Sm90GemmEngine with no GPU behind it (device "cpu", the SM90 layout) and the GPU facts its variant rules
    read: SMS SMs, ``dram_tbs`` TB/s."""
    engine = Sm90GemmEngine.__new__(Sm90GemmEngine)
    GemmEngine.__init__(engine, torch.device("cpu"), SM90)
    engine.sm_count, engine.dram_tbs = SMS, dram_tbs
    return engine
