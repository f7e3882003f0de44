"""torchrun whose workers are forked: ``python -m clawcomm.launch.forkrun``
takes torchrun's rendezvous flags (those ``netns.Cluster.torchrun`` passes)
and ``-m MODULE ARGS``, imports the module's package (and torch._dynamo)
once, then runs torch's elastic agent with ``start_method="fork"``, so that
each worker starts with them imported instead of importing them itself.

    python -m clawcomm.launch.forkrun --nnodes 2 --nproc-per-node 2 \\
        --rdzv-endpoint 10.99.0.1:29400 --rdzv-id job1 -m clawcomm.train --steps 5

Why: on the 2-core reference machines each worker of ``torchrun -m
clawcomm.train`` spends about 2 s of CPU importing torch and clawcomm and
2 s more on the torch._dynamo import an optimizer's construction makes, so
4 ranks on 2 namespace hosts took 13.7 s to train one step, against 6.8 s
forked (and 4.9 s for ``clawcomm train --nproc 4``, which forks on one
host). The plan's trial on namespace hosts and ``clawcomm plan --check
--hosts`` launch with it (``Cluster.torchrun(..., fork=True)``). A worker
that fails makes the agent exit non-zero, as torchrun does.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import runpy
import sys


def _worker(module: str, argv: list[str]) -> None:
    """One rank: ``python -m module argv`` in this (forked) process."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:  # torch read its thread count at import, before ``main`` set this
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # the module's own exit: a failure only if non-zero
        if e.code not in (None, 0):
            raise


def _preload(module: str) -> None:
    """Imports what ``-m module`` will need without running it: a package
    itself (``-m`` runs its ``__main__``), else the package around the module."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise SystemExit(f"forkrun: no module named {module!r}")
    if spec.submodule_search_locations is not None:
        importlib.import_module(module)
    elif "." in module:
        importlib.import_module(module.rpartition(".")[0])


def parse(argv: list[str]) -> tuple[argparse.Namespace, str, list[str]]:
    """(torchrun's flags, the module, its arguments)."""
    if "-m" not in argv:
        raise SystemExit("forkrun: usage: ... -m MODULE [ARGS]")
    at = argv.index("-m")
    if at + 1 >= len(argv):
        raise SystemExit("forkrun: -m needs a module")
    p = argparse.ArgumentParser(prog="python -m clawcomm.launch.forkrun")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--rdzv-backend", default="c10d")
    p.add_argument("--rdzv-endpoint", default="localhost:29400")
    p.add_argument("--rdzv-id", default="forkrun")
    p.add_argument("--rdzv-conf", default="", help="KEY=VALUE[,KEY=VALUE]")
    p.add_argument("--local-addr", default=None)
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--monitor-interval", type=float, default=0.2)
    return p.parse_args(argv[:at]), argv[at + 1], argv[at + 2 :]


def main(argv: list[str] | None = None) -> int:
    args, module, rest = parse(sys.argv[1:] if argv is None else argv)
    if args.nproc_per_node > 1:  # as torchrun sets it for its workers, before torch starts here
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch._dynamo  # noqa: F401  (an optimizer's construction imports it: once, here)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _preload(module)
    conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if kv)
    config = LaunchConfig(
        min_nodes=args.nnodes, max_nodes=args.nnodes, nproc_per_node=args.nproc_per_node,
        run_id=args.rdzv_id, rdzv_endpoint=args.rdzv_endpoint, rdzv_backend=args.rdzv_backend,
        rdzv_configs=conf, max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval, start_method="fork", local_addr=args.local_addr,
    )  # fmt: skip
    elastic_launch(config, _worker)(module, rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
