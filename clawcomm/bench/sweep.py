"""The measurement loop every runner shares (nccl-tests' method, made robust
to a noisy shared machine).

For each point (collective, reduction, size), every runner gets ``warmup``
untimed calls, then ``repeats`` timed blocks of ``iters`` back-to-back calls
between two clock reads. Blocks of different runners are interleaved
(block 1 of every runner, then block 2 of every runner, ...), so a burst of
noise from elsewhere on the machine hits them alike. A runner's time is its
best block's average per call, taken from the slowest rank. With ``iters=0``
the count is picked per runner and point so a block lasts about
``target_s`` (agreed across ranks: every rank must make the same calls).

Every point is then checked once on fresh inputs: #wrong counts elements
that differ from the locally computed result, and out-of-bounds counts guard
elements written past an output.
"""

from __future__ import annotations

import dataclasses
import gc
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
    # Waits for the device (CUDA: torch.cuda.synchronize), so a timed block
    # ends when the GPU is done, not when the launches are queued.
    device: Callable[[], None] = lambda: None


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
    repeats: int = 3
    target_s: float = 0.04
    pages: str = "huge"  # buffers from 2 MiB up (runners.host_array)
    skew: float = 1.0  # all_to_allv: the popularity exponent (collectives.uneven_splits)


def points(cfg: Config) -> Iterable[tuple]:
    """(collective, redop, size) in the order they are measured."""
    for name in cfg.collectives:
        coll = COLLECTIVES[name]
        if coll.shape == "uneven":
            coll = dataclasses.replace(coll, skew=cfg.skew)
        for redop in cfg.redops if coll.has_redop else ["-"]:
            for size in cfg.sizes:
                yield coll, redop, size


def _record(coll, size, cfg: Config, redop: str, n: int, runner) -> dict:
    count = element_count(coll, size, cfg.dtype, n)
    return {
        "collective": coll.name,
        "variant": runner.name,
        "size": count * DTYPE_BYTES[cfg.dtype],
        "count": count,
        "dtype": cfg.dtype,
        "redop": redop,
        "root": cfg.root if coll.has_root else -1,
    }


def _timed_block(step, iters: int, sync: Sync) -> float:
    sync.barrier()
    collecting = gc.isenabled()
    gc.disable()  # as timeit does: no collector pauses inside a block
    try:
        sync.device()
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        sync.device()
        elapsed = time.perf_counter() - t0
    finally:
        if collecting:
            gc.enable()
    return sync.max(elapsed / iters)


def measure_point(runners: list, coll, size: int, cfg: Config, redop: str, n: int, sync: Sync):
    """One record per runner for one (collective, redop, size)."""
    records, live = [], []
    for runner in runners:
        record = _record(coll, size, cfg, redop, n, runner)
        records.append(record)
        try:
            prepared = runner.prepare(
                coll, record["count"], cfg.dtype, "sum" if redop == "-" else redop, record["root"]
            )
            # A backend that rejects the combination does so here, on every rank.
            prepared.step()
        except Unsupported as e:
            record["error"] = str(e)
            continue
        except (RuntimeError, ValueError) as e:
            record["error"] = str(e).splitlines()[0][:80]
            continue
        for _ in range(cfg.warmup - 1):
            prepared.step()
        iters = cfg.iters
        if iters <= 0:
            per_call = _timed_block(prepared.step, max(1, min(cfg.warmup, 5)), sync)
            iters = int(min(20000, max(3, math.ceil(cfg.target_s / max(per_call, 1e-9)))))
        live.append((record, prepared, iters))
    best = {id(r): math.inf for r, _, _ in live}
    for _ in range(cfg.repeats):
        for record, prepared, iters in live:
            best[id(record)] = min(best[id(record)], _timed_block(prepared.step, iters, sync))
    for record, prepared, iters in live:
        seconds = best[id(record)]
        wrong, oob = prepared.check() if cfg.check else (0, 0)
        algbw = record["size"] / seconds / 1e9
        record.update(
            iters=iters,
            repeats=cfg.repeats,
            time_us=seconds * 1e6,
            algbw=algbw,
            busbw=algbw * coll.busbw_factor(n),
            wrong=sync.sum(wrong),
            oob=sync.sum(oob),
        )
    return records


def warm_up(runners: dict, cfg: Config, n: int, sync: Sync, calls: int = 100) -> None:
    """`calls` small all-reduces on every runner, so that the first point
    does not pay for first-touch page faults, lazy state or cold caches.
    (A fixed count: every rank must make the same calls.)"""
    coll = COLLECTIVES["all_reduce"]
    for runner in runners.values():
        try:
            count = element_count(coll, 4096, cfg.dtype, n)
            prepared = runner.prepare(coll, count, cfg.dtype, "sum", -1)
        except Unsupported:
            continue
        sync.barrier()
        for _ in range(calls):
            prepared.step()


def run_sweep(runners: dict, cfg: Config, n: int, sync: Sync, runner_names, progress=None):
    """Measures every point with the runners `runner_names(collective)`
    names; returns the records (the same on every rank)."""
    warm_up(runners, cfg, n, sync)
    records = []
    for coll, redop, size in points(cfg):
        if progress is not None:
            progress.set_description(f"{coll.name} {size} B", refresh=False)
        names = runner_names(coll.name)
        records += measure_point([runners[r] for r in names], coll, size, cfg, redop, n, sync)
        if progress is not None:
            progress.update(1)
    return records
