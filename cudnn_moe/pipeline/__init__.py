"""The pipeline every op runs on: the executor (token buckets, the stage chain its engine declares, CUDA
graphs), the call cache (checked signatures), workspaces of layer engines, their ordering across streams,
and the capture-safe lifetimes of it all (the warm-before-capture rule is cudnn_moe.capture). Import from
the modules; this package imports nothing."""
