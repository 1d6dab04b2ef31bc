"""Command line: ``python -m cudnn_moe demo`` (see ``--help``)."""

from __future__ import annotations

import argparse
from dataclasses import fields

from .demo import DemoShape, run_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cudnn-moe", description="cudnn-moe: NVFP4 MoE layers on cuDNN graphs")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="quantize a random MoE layer, run the float reference, and the GPU op when a GPU is present",
    )
    defaults = DemoShape()
    for f in fields(DemoShape):
        demo.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)),
                          default=getattr(defaults, f.name), help=f"default: {getattr(defaults, f.name)}")
    args = parser.parse_args(argv)
    if args.command == "demo":
        try:
            run_demo(DemoShape(**{f.name: getattr(args, f.name) for f in fields(DemoShape)}))
        except ValueError as error:
            parser.exit(2, f"cudnn-moe demo: error: {error}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
