"""Engines behind one seam (``base``: what an engine declares and does), the one registry and choice
(``registry``), and the engines: ``sm90`` (our NVFP4 grouped GEMMs for Hopper), ``cudnn`` (cuDNN frontend
graphs), ``cuda_cores`` (the low-latency whole-layer kernels) and ``ll_mma`` (those kernels with tensor-core dot
products, for the FP8 formats). Import from those modules; this package imports nothing, so the weight records
below the engines can import the registry without a cycle."""
