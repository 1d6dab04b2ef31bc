"""Command line: ``python -m cudnn_moe demo`` and ``python -m cudnn_moe prebuild`` (see ``--help``)."""

from __future__ import annotations

import argparse
from dataclasses import fields

from .activations import ACTIVATION_NAMES
from .demo import DemoShape, run_demo
from .prebuild import preset_summary
from .prebuild import add_arguments as add_prebuild_arguments
from .prebuild import run_prebuild


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cudnn-moe", description="cudnn-moe: fused NVFP4 MoE layers (SM90 kernels or cuDNN graphs)",
        epilog=f"presets (prebuild --preset): {preset_summary()}. activations: {', '.join(ACTIVATION_NAMES)}.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="quantize a random MoE layer, run the float reference, and the GPU op when a GPU is present",
    )
    defaults = DemoShape()
    for f in fields(DemoShape):
        demo.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)),
                          default=getattr(defaults, f.name), help=f"default: {getattr(defaults, f.name)}")
    prebuild = commands.add_parser(
        "prebuild",
        help="build a layer's token buckets (or tune its low-latency engine choice) into the persistent cache "
             "before serving; list, verify or clear it",
        description="Build every token bucket of the given layer shapes on this GPU so that serving starts from "
        "the cache, or with --low-latency FORMAT measure which engine runs their low-latency calls fastest and "
        "store that, or manage the cache directory (--list/--verify/--clear need no GPU). Exit status: 0 ok, "
        "1 a build or tuning failed, a cache entry is bad or there is no usable GPU, 2 bad arguments.",
    )
    add_prebuild_arguments(prebuild)
    args = parser.parse_args(argv)
    if args.command == "prebuild":
        return run_prebuild(args)
    if args.command == "demo":
        try:
            run_demo(DemoShape(**{f.name: getattr(args, f.name) for f in fields(DemoShape)}))
        except ValueError as error:
            parser.exit(2, f"cudnn-moe demo: error: {error}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
