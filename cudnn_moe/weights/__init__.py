"""Prepared-weight records every engine and op reads: ``nvfp4`` (the NVFP4 pipeline's activation packs and
per-expert weights in an engine's layout, and the one quantize-and-pack helper) and ``low_latency`` (the
low-latency op's formats, payloads kept bit-exact with zero padding). Pure torch; nothing is imported here,
so engines can import the records without importing the ops."""
