"""Command line: ``python -m inductor_attn {demo,...}``."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inductor_attn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile a small transformer block and show which kernels ran")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args.device)
    return 2


if __name__ == "__main__":
    sys.exit(main())
