"""The ``clawcomm`` command line."""

from __future__ import annotations

import argparse
import sys


def plain(text: str | None) -> str | None:
    """A docstring as a terminal shows it: reStructuredText's ``literal``
    quotes and ``::`` dropped."""
    if text is None:
        return None
    return text.replace("``", "").replace("::\n", ":\n")


def _add(sub, name: str, help: str, module) -> None:
    """A subcommand whose parser and description are `module`'s."""
    p = sub.add_parser(
        name,
        help=help,
        description=plain(module.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(p)


def version() -> str:
    """``clawcomm 0.1.0 (torch 2.13.0+cpu; engine without CUDA)``: what a bug
    report needs to say."""
    import clawcomm
    from clawcomm import _C

    try:
        import torch

        torch_version = f"torch {torch.__version__}"
    except ModuleNotFoundError:
        torch_version = "no torch"
    cuda = "with CUDA kernels" if hasattr(_C, "cuda") else "without CUDA"
    return f"clawcomm {clawcomm.__version__} ({torch_version}; engine {cuda})"


def main(argv: list[str] | None = None) -> int:
    from clawcomm import flight
    from clawcomm.bench import cli as bench_cli
    from clawcomm.experiments import compression as compression_experiment
    from clawcomm.plan import cli as plan_cli
    from clawcomm.simulate import cli as simulate_cli
    from clawcomm.train import cli as train_cli
    from clawcomm.train import tokens

    parser = argparse.ArgumentParser(prog="clawcomm", description=__doc__)
    parser.add_argument("--version", action="version", version=version(),
                        help="clawcomm's version, its torch and its build")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    _add(sub, "bench", "nccl-tests-style bandwidth tables, against gloo and MPI", bench_cli)
    experiment = sub.add_parser("experiment", help="training experiments on local ranks")
    kinds = experiment.add_subparsers(dest="experiment", required=True)
    _add(
        kinds,
        "compression",
        "train a small model once per gradient compressor",
        compression_experiment,
    )
    _add(
        sub,
        "train",
        "data- and pipeline-parallel training on local ranks (or under torchrun)",
        train_cli,
    )
    _add(sub, "plan", "the layout for a model on a world, predicted, explained and checked",
         plan_cli)  # fmt: skip
    _add(sub, "tokenize", "turn a text file into token files for clawcomm train --data", tokens)
    _add(
        sub,
        "flight",
        "read the flight records of a failed job: which ranks are missing from which op",
        flight,
    )
    _add(
        sub,
        "simulate",
        "predict collectives and a training step's communication at any scale from a model",
        simulate_cli,
    )
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench_cli.run(args, argv[1:])
    if args.command == "experiment":
        return compression_experiment.run(args)
    if args.command == "train":
        return train_cli.run(args)
    if args.command == "plan":
        return plan_cli.run(args)
    if args.command == "tokenize":
        return tokens.run(args)
    if args.command == "flight":
        return flight.run(args)
    if args.command == "simulate":
        return simulate_cli.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
