"""The body of every bench rank that runs torch.distributed backends.

It runs on ranks spawned by ``clawcomm bench`` or started by torchrun, in a
process group whose default backend is clawcomm. It builds one group per
variant (clawcomm per all-reduce algorithm, gloo, clawcomm's raw engine),
and a gloo control group for barriers and agreement that is never timed.
"""

from __future__ import annotations

import os
import sys

from clawcomm.bench.collectives import DETERMINISTIC
from clawcomm.bench.runners import EngineRunner, TorchRunner, set_pages
from clawcomm.bench.sweep import Config, Sync, points, run_sweep


def clawcomm_name(algo: str, algos: list[str]) -> str:
    return "clawcomm" if algos == ["auto"] else f"clawcomm/{algo}"


def names_algorithm(value: str, collective: str) -> bool:
    """Whether the CLAWCOMM_ALGO value `value` (one --algo item) chooses
    `collective`'s algorithm: auto, op:name for it, or a bare name it has;
    "deterministic" chooses the reductions'."""
    from clawcomm import _C

    op = {"sendrecv": "send", "all_to_allv": "all_to_all"}.get(collective, collective)
    if value == "auto":
        return True
    if value == DETERMINISTIC:
        return op in ("all_reduce", "reduce_scatter", "reduce")
    if ":" in value:
        return value.split(":", 1)[0] == op
    return (op, value) in _C._algorithm_table()


def reference_algo(algos: list[str]) -> str:
    """The --algo variant the others are divided by: the first given, so
    that the table's columns read in the order the command gave them."""
    return algos[0]


def d2d_copy_gbps(nbytes: int = 256 << 20, repeats: int = 10) -> float:
    """This GPU's device-to-device copy (GB/s of bytes copied): the ceiling
    the CUDA kernels are measured against, taken in the same run."""
    import torch

    src = torch.ones(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return nbytes / best / 1e9


def engine_floor_s(engine, sync: Sync, calls: int = 1000) -> float:
    """The raw engine's 8-byte all-reduce (two float32, one call into C++,
    no torch): the best of three batches of ``calls``, seconds a call, the
    slowest rank's. The floor every table's torch path is measured against."""
    import time

    import numpy as np

    buf = np.zeros(2, np.float32)
    for _ in range(min(calls, 200)):
        engine.all_reduce(buf, "sum", None)
    best = float("inf")
    for _ in range(3):
        sync.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            engine.all_reduce(buf, "sum", None)
        best = min(best, (time.perf_counter() - t0) / calls)
    return sync.max(best)


class _Failed:
    """A variant that could not be set up: every point shows n/a and why."""

    def __init__(self, name: str, why: str):
        self.name = name
        self.why = why

    def prepare(self, *args):
        from clawcomm.bench.runners import Unsupported

        raise Unsupported(self.why)


def rank_main(rank: int, world_size: int, options: dict):
    """Returns {"records": [...], ...} on rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist

    import clawcomm

    cfg = Config(**options["config"])
    set_pages(cfg.pages)
    algos: list[str] = options["algos"]
    compare: list[str] = options["compare"]
    device = options.get("device", "cpu")
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())

    control = dist.new_group(backend="gloo")
    runners = {}
    previous = os.environ.get("CLAWCOMM_ALGO")
    for algo in algos:
        os.environ["CLAWCOMM_ALGO"] = "auto" if algo == DETERMINISTIC else algo
        os.environ["CLAWCOMM_DETERMINISTIC"] = "1" if algo == DETERMINISTIC else "0"
        group = dist.new_group(backend="clawcomm")
        runners[clawcomm_name(algo, algos)] = TorchRunner(
            clawcomm_name(algo, algos), group, "clawcomm", device
        )
    os.environ.pop("CLAWCOMM_DETERMINISTIC", None)
    if previous is None:
        os.environ.pop("CLAWCOMM_ALGO", None)
    else:
        os.environ["CLAWCOMM_ALGO"] = previous
    reference = clawcomm_name(reference_algo(algos), algos)
    if "raw" in compare:
        runners["raw"] = EngineRunner("raw", clawcomm.engine_of(runners[reference].group))
    if "gloo" in compare:
        runners["gloo"] = TorchRunner("gloo", control, "gloo", device)
    if "nccl" in compare:
        try:
            nccl = dist.new_group(backend="nccl")
            dist.barrier(group=nccl)  # NCCL connects lazily: fail here, not mid-sweep
            runners["nccl"] = TorchRunner("nccl", nccl, "nccl", device)
        except Exception as e:  # e.g. "Duplicate GPU detected": several ranks on one GPU
            runners["nccl"] = _Failed("nccl", f"NCCL: {str(e).splitlines()[0][:60]}")

    def runner_names(collective: str) -> list[str]:
        # A variant runs the collectives whose algorithm it names (the
        # others would repeat auto's); the reference runs them all.
        names = [clawcomm_name(a, algos) for a in algos if names_algorithm(a, collective)]
        if reference not in names:
            names = [reference] + names
        return names + [c for c in ("raw", "gloo", "nccl") if c in compare]

    def agree(value, op):
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=op, group=control)
        return t.item()

    sync = Sync(
        barrier=lambda: dist.barrier(group=control),
        max=lambda v: agree(v, dist.ReduceOp.MAX),
        sum=lambda v: int(agree(v, dist.ReduceOp.SUM)),
        device=torch.cuda.synchronize if device == "cuda" else (lambda: None),
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
    # Each pair's single-copy threshold (the reader measures it at setup):
    # what the sizes in the table travelled by.
    mine = clawcomm.engine_of(runners[reference].group)
    floor = engine_floor_s(mine, sync) if device == "cpu" else None
    pairs = {(rank, p): mine.single_copy_from(p) for p in range(world_size) if p != rank}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, pairs, group=control)
    if rank != 0:
        return None
    result = {
        "records": records,
        "single_copy": {k: v for g in gathered for k, v in g.items()},
        "engine_floor_s": floor,
    }
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        result["d2d_GBps"] = d2d_copy_gbps()
    return result
