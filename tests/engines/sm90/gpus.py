"""The GPUs the SM90 engine's CPU tests decide for, as its variant rules read them: 132 SMs on the H100 SXM and the
H200 alike, and the peak DRAM bandwidth the driver's memory clock and bus width give (TB/s)."""

from __future__ import annotations

from cudnn_moe.engines.sm90.engine import Sm90GemmEngine

SMS = 132
H100_TBS = 3.35  # 2619 MHz x 2 x 5120 bits
H200_TBS = 4.92  # 3201 MHz x 2 x 6144 bits


def bare_engine(dram_tbs: float = H200_TBS) -> Sm90GemmEngine:
    """An Sm90GemmEngine with no device behind it: the GPU facts its variant rules read, nothing else."""
    engine = Sm90GemmEngine.__new__(Sm90GemmEngine)
    engine.sm_count, engine.dram_tbs = SMS, dram_tbs
    return engine
