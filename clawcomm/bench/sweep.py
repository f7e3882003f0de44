"""The measurement loop every runner shares (nccl-tests' method).

For each point: ``warmup`` untimed calls, then ``iters`` back-to-back calls
between two clock reads; the time reported is the average per call, taken
from the slowest rank. With ``iters=0`` the count is picked per point so a
measurement lasts about ``target_s`` (agreed across ranks, since every rank
must make the same number of calls). Every point is then checked once on
fresh inputs: #wrong counts elements that differ from the locally computed
result, and out-of-bounds counts guard elements written past an output.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from clawcomm.bench.collectives import COLLECTIVES, DTYPE_BYTES, element_count
from clawcomm.bench.runners import Unsupported


@dataclass
class Sync:
    """Cross-rank helpers over a control channel that is never timed."""

    barrier: Callable[[], None]
    max: Callable[[float], float]
    sum: Callable[[int], int]


@dataclass
class Config:
    collectives: list[str]
    sizes: list[int]
    dtype: str
    redops: list[str]
    root: int
    warmup: int
    iters: int  # 0: auto
    check: bool
    target_s: float = 0.1


def points(cfg: Config, runner_names: Callable[[str], list[str]]) -> Iterable[tuple]:
    """(collective, redop, size, runner name) in the order they are measured.
    Sizes are the outer loop of the runners, so every backend sees the
    machine in the same state for a given size."""
    for name in cfg.collectives:
        coll = COLLECTIVES[name]
        for redop in cfg.redops if coll.has_redop else ["-"]:
            for size in cfg.sizes:
                for runner in runner_names(name):
                    yield coll, redop, size, runner


def measure(runner, coll, size, cfg: Config, redop: str, n: int, sync: Sync) -> dict:
    count = element_count(coll, size, cfg.dtype, n)
    root = cfg.root if coll.has_root else -1
    record = {
        "collective": coll.name,
        "variant": runner.name,
        "size": count * DTYPE_BYTES[cfg.dtype],
        "count": count,
        "dtype": cfg.dtype,
        "redop": redop,
        "root": root,
    }
    try:
        prepared = runner.prepare(coll, count, cfg.dtype, redop if redop != "-" else "sum", root)
    except Unsupported as e:
        record["error"] = str(e)
        return record
    try:
        prepared.step()  # a backend that rejects the combination does so here, on every rank
    except (RuntimeError, ValueError) as e:
        record["error"] = str(e).splitlines()[0][:80]
        return record
    for _ in range(cfg.warmup - 1):
        prepared.step()
    iters = cfg.iters
    if iters <= 0:
        probe = max(1, min(cfg.warmup, 5))
        sync.barrier()
        t0 = time.perf_counter()
        for _ in range(probe):
            prepared.step()
        per_call = sync.max((time.perf_counter() - t0) / probe)
        iters = int(min(20000, max(5, math.ceil(cfg.target_s / max(per_call, 1e-9)))))
    sync.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        prepared.step()
    seconds = sync.max((time.perf_counter() - t0) / iters)
    wrong, oob = prepared.check() if cfg.check else (0, 0)
    algbw = record["size"] / seconds / 1e9
    record.update(
        iters=iters,
        time_us=seconds * 1e6,
        algbw=algbw,
        busbw=algbw * coll.busbw_factor(n),
        wrong=sync.sum(wrong),
        oob=sync.sum(oob),
    )
    return record


def warm_up(runners: dict, cfg: Config, n: int, sync: Sync) -> None:
    """A few hundred small all-reduces (or the first collective) on every
    runner, so that the first measured point does not pay for first-touch
    page faults, lazy connection state or cold caches."""
    coll = COLLECTIVES["all_reduce"]
    for runner in runners.values():
        try:
            prepared = runner.prepare(
                coll, element_count(coll, 4096, cfg.dtype, n), cfg.dtype, "sum", -1
            )
        except Unsupported:
            continue
        sync.barrier()
        deadline = time.perf_counter() + 0.05
        for _ in range(500):
            prepared.step()
            if time.perf_counter() > deadline:
                break
        sync.barrier()


def run_sweep(runners: dict, cfg: Config, n: int, sync: Sync, runner_names, progress=None):
    """Measures every point; returns the records (the same on every rank)."""
    warm_up(runners, cfg, n, sync)
    records = []
    for coll, redop, size, name in points(cfg, runner_names):
        if progress is not None:
            progress.set_description(f"{name} {coll.name} {size} B", refresh=False)
        records.append(measure(runners[name], coll, size, cfg, redop, n, sync))
        if progress is not None:
            progress.update(1)
    return records
