"""The body of every bench rank that runs torch.distributed backends.

It runs on ranks spawned by ``clawcomm bench`` or started by torchrun, in a
process group whose default backend is clawcomm. It builds one group per
variant (clawcomm per all-reduce algorithm, gloo, clawcomm's raw engine),
and a gloo control group for barriers and agreement that is never timed.
"""

from __future__ import annotations

import os
import sys

from clawcomm.bench.runners import EngineRunner, TorchRunner
from clawcomm.bench.sweep import Config, Sync, points, run_sweep


def clawcomm_name(algo: str, algos: list[str]) -> str:
    return "clawcomm" if algos == ["auto"] else f"clawcomm/{algo}"


def reference_algo(algos: list[str]) -> str:
    return "auto" if "auto" in algos else algos[0]


def rank_main(rank: int, world_size: int, options: dict):
    """Returns every record on rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist

    import clawcomm

    cfg = Config(**options["config"])
    algos: list[str] = options["algos"]
    compare: list[str] = options["compare"]

    control = dist.new_group(backend="gloo")
    runners = {}
    previous = os.environ.get("CLAWCOMM_ALGO")
    for algo in algos:
        os.environ["CLAWCOMM_ALGO"] = algo
        group = dist.new_group(backend="clawcomm")
        runners[clawcomm_name(algo, algos)] = TorchRunner(
            clawcomm_name(algo, algos), group, "clawcomm"
        )
    if previous is None:
        os.environ.pop("CLAWCOMM_ALGO", None)
    else:
        os.environ["CLAWCOMM_ALGO"] = previous
    reference = clawcomm_name(reference_algo(algos), algos)
    if "raw" in compare:
        runners["raw"] = EngineRunner("raw", clawcomm.engine_of(runners[reference].group))
    if "gloo" in compare:
        runners["gloo"] = TorchRunner("gloo", control, "gloo")

    def runner_names(collective: str) -> list[str]:
        # The all-reduce algorithm only matters to all_reduce.
        names = [clawcomm_name(a, algos) for a in algos] if collective == "all_reduce" else []
        names = names or [reference]
        return names + [c for c in ("raw", "gloo") if c in compare]

    def agree(value, op):
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=op, group=control)
        return t.item()

    sync = Sync(
        barrier=lambda: dist.barrier(group=control),
        max=lambda v: agree(v, dist.ReduceOp.MAX),
        sum=lambda v: int(agree(v, dist.ReduceOp.SUM)),
    )
    progress = None
    if rank == 0 and options.get("progress", True):
        from tqdm import tqdm

        total = sum(1 for _ in points(cfg))
        progress = tqdm(total=total, file=sys.stderr, unit="pt", leave=False, dynamic_ncols=True)
    try:
        records = run_sweep(runners, cfg, world_size, sync, runner_names, progress)
    finally:
        if progress is not None:
            progress.close()
    return records if rank == 0 else None
