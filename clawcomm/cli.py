"""The ``clawcomm`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clawcomm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="all-reduce on local ranks, checked against gloo")
    demo.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (default 2)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from clawcomm import demo as demo_mod

        return demo_mod.run(args.nproc)
    return 2


if __name__ == "__main__":
    sys.exit(main())
