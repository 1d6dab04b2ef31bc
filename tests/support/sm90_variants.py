"""The SM90 GEMM kernel variants the CPU tests compile and emulate and the GPU tests run."""

from __future__ import annotations

from cudnn_moe.engines.sm90 import kernels as sm90

# _WIDE's CTAs held to six an SM (min_blocks: 80 registers), two ring steps: GEMM1's one-wave form.
SIX_CTAS_AN_SM = sm90.DecodeVariant(mt=2, wm=4, wk=1, nt=1, prefetch=2, min_blocks=6)
DECODE_VARIANTS = [
    sm90.DecodeVariant(),
    sm90.DecodeVariant(mt=2, wm=2, wk=2, nt=1, prefetch=4),
    sm90.DecodeVariant(mt=1, wm=2, wk=4, nt=2, prefetch=4),
    sm90.DecodeVariant(mt=1, wm=1, wk=8, nt=4, prefetch=2),
    sm90.DecodeVariant(mt=2, wm=4, wk=2, nt=1, prefetch=3),
    sm90.DecodeVariant(mt=4, wm=2, wk=1, nt=1, prefetch=2),  # four m16 blocks a warp, held to 128 registers
    SIX_CTAS_AN_SM,
]
# The first prefill variants share the 128 x 128 CTA tile; the others change the tile or decode the
# weights once per CTA (adec).
BASIC_PREFILL_VARIANTS = [sm90.PrefillVariant(), sm90.PrefillVariant(3), sm90.PrefillVariant(4, min_blocks=1),
                          sm90.PrefillVariant(stmatrix=False)]
OTHER_PREFILL_VARIANTS = [
    sm90.PrefillVariant(feature_block=256, tile_rows=64),
    sm90.PrefillVariant(feature_block=128, tile_rows=64, min_blocks=4),
    sm90.PrefillVariant(feature_block=64, tile_rows=128, min_blocks=4),
    sm90.PrefillVariant(feature_block=256, tile_rows=128, min_blocks=1),
    sm90.PrefillVariant(3, adec=True),
    sm90.PrefillVariant(3, 1, adec=True),
    sm90.PrefillVariant(4, 1, adec=True),
    sm90.PrefillVariant(3, 1, feature_block=256, adec=True),
]
PREFILL_VARIANTS = BASIC_PREFILL_VARIANTS + OTHER_PREFILL_VARIANTS
# The wgmma kernel (sm_90a): both token tiles, both CTA widths, shallow and deep rings, two CTAs per SM; natural
# rows and the tiled planes (the engine's choices read tiled tokens).
WGMMA_VARIANTS = [sm90.WgmmaVariant(), sm90.WgmmaVariant(64), sm90.WgmmaVariant(128, 2, 4, 2),
                  sm90.WgmmaVariant(64, 2, 6, 2), sm90.WgmmaVariant(128, 4, 3),
                  sm90.WgmmaVariant(128, 2, 4, 2, tiled_tokens=True), sm90.WgmmaVariant(64, 2, 6, 2, tiled_tokens=True),
                  sm90.WgmmaVariant(128, 4, 5, tiled_tokens=True)]
