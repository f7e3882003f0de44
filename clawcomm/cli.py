"""The ``clawcomm`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clawcomm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from clawcomm.bench import cli as bench_cli

    bench = sub.add_parser(
        "bench",
        help="nccl-tests-style bandwidth tables, against gloo and MPI",
        description=bench_cli.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_cli.add_arguments(bench)
    from clawcomm.experiments import compression as compression_experiment

    experiment = sub.add_parser("experiment", help="training experiments on local ranks")
    kinds = experiment.add_subparsers(dest="experiment", required=True)
    comp = kinds.add_parser(
        "compression",
        help="train a small model once per gradient compressor",
        description=compression_experiment.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compression_experiment.add_arguments(comp)
    from clawcomm.train import cli as train_cli

    train = sub.add_parser(
        "train",
        help="data- and pipeline-parallel training on local ranks (or under torchrun)",
        description=train_cli.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train_cli.add_arguments(train)
    from clawcomm import flight

    flight_parser = sub.add_parser(
        "flight",
        help="read the flight records of a failed job: which ranks are missing from which op",
        description=flight.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flight.add_arguments(flight_parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench_cli.run(args, argv[1:])
    if args.command == "experiment":
        return compression_experiment.run(args)
    if args.command == "train":
        return train_cli.run(args)
    if args.command == "flight":
        return flight.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
