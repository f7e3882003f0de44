"""``dist.shrink_group`` against destroying the group and creating it again
from the survivors, interleaved trial by trial in one run, on one host:

    python3 bench/shrink_bench.py --nproc 8 --trials 10 --json bench/results/shrink_8ranks.json

Each trial builds the whole group over a TCPStore (as torchrun does) and
drops its last rank twice:

- **shrink**: the survivors call ``dist.shrink_group([victim])`` (the
  victim alive, or with ``--mode stuck`` the survivors blocked in an
  all-reduce the victim never joins, ended by ``SHRINK_ABORT``);
- **re-create**: the survivors ``destroy_process_group()`` and
  ``init_process_group`` again, n - 1 ranks, under a fresh store prefix.

Each time runs from the call until the new group's first 8-byte all-reduce
has returned, and a trial's time is the slowest survivor's (the group is
ready when its last member is). The figure is the median over the trials,
with the range. ``--mode dead`` kills the victim (SIGKILL) before the
survivors shrink; a dead rank cannot take part in the next trial, so each
dead trial is a run of its own, and the re-create time of the alive mode
is the comparison. ``--mode engine`` times the engine's own ``Engine.shrink``
(the victim alive) below torch's wrapping.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _barrier(store, key: str, n: int) -> None:
    store.add(key, 1)
    while int(store.add(key, 0)) < n:
        time.sleep(0.001)


def _trial(rank, n, port, mode, trials):
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import SHRINK_ABORT, SHRINK_DEFAULT

    import clawcomm  # noqa: F401  (registers the backend)

    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=datetime.timedelta(seconds=60))
    victim = n - 1
    one = torch.ones(2)
    out = []
    for t in range(trials):
        times = {}
        # Shrink.
        dist.init_process_group(
            "clawcomm", store=dist.PrefixStore(f"{t}/s", store), rank=rank, world_size=n
        )
        dist.all_reduce(one)
        if mode == "engine":
            # The engine's own shrink, below torch: no old group to destroy,
            # no new store connection, nothing to register.
            import numpy as np

            import clawcomm

            eng = clawcomm.engine_of()
            if rank != victim:
                t0 = time.perf_counter()
                child = eng.shrink([victim])
                child.all_reduce(np.ones(2, np.float32))
                times["shrink"] = time.perf_counter() - t0
                del child
            dist.destroy_process_group()
            _barrier(store, f"{t}/after-engine", n)
            out.append(times)
            continue
        pending = None
        if mode == "stuck" and rank != victim:
            pending = dist.all_reduce(torch.ones(1 << 16), async_op=True)
            time.sleep(0.05)
        if mode == "dead" and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "dead":
            time.sleep(0.2)
        if rank != victim:
            t0 = time.perf_counter()
            flags = SHRINK_ABORT if mode == "stuck" else SHRINK_DEFAULT
            group = dist.shrink_group([victim], shrink_flags=flags)
            dist.all_reduce(one, group=group)
            times["shrink"] = time.perf_counter() - t0
            if pending is not None:
                try:
                    pending.wait()
                except RuntimeError:
                    pass
        if mode == "dead":
            dist.destroy_process_group()
            out.append(times)
            continue
        dist.destroy_process_group()
        _barrier(store, f"{t}/after-shrink", n)
        # Re-create.
        dist.init_process_group(
            "clawcomm", store=dist.PrefixStore(f"{t}/r", store), rank=rank, world_size=n
        )
        dist.all_reduce(one)
        if rank != victim:
            t0 = time.perf_counter()
            dist.destroy_process_group()
            dist.init_process_group(
                "clawcomm",
                store=dist.PrefixStore(f"{t}/r2", store),
                rank=rank,
                world_size=n - 1,
            )
            dist.all_reduce(one)
            times["recreate"] = time.perf_counter() - t0
        dist.destroy_process_group()
        _barrier(store, f"{t}/after-recreate", n)
        out.append(times)
    # Rank 0 serves the store: it leaves last.
    store.add("left", 1)
    stay = n - 1 if mode == "dead" else n  # a killed rank never leaves
    while rank == 0 and int(store.add("left", 0)) < stay:
        time.sleep(0.001)
    return out


def _summary(values: list[float]) -> dict:
    return {
        "median_ms": statistics.median(values) * 1e3,
        "min_ms": min(values) * 1e3,
        "max_ms": max(values) * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--trials", type=int, default=10)
    p.add_argument(
        "--mode", choices=["alive", "stuck", "dead", "engine"], nargs="+", default=["alive"]
    )
    p.add_argument("--json")
    args = p.parse_args()

    from clawcomm.launch import RankFailure, run_ranks

    report = {"nproc": args.nproc, "trials": args.trials, "cores": os.cpu_count(), "modes": {}}
    for mode in args.mode:
        per_trial: dict[str, list[float]] = {}
        runs = [args.trials] if mode != "dead" else [1] * args.trials
        for count in runs:
            results = run_ranks(
                _trial,
                args.nproc,
                _free_port(),
                mode,
                count,
                init=False,
                timeout=600,
                allow_failures=(mode == "dead"),
            )
            ranks = [r for r in results if not isinstance(r, RankFailure)]
            for t in range(count):
                for key in ("shrink", "recreate"):
                    got = [r[t][key] for r in ranks if key in r[t]]
                    if got:
                        per_trial.setdefault(key, []).append(max(got))
        row = {k: _summary(v) for k, v in per_trial.items()}
        if "recreate" in row:
            ratios = [
                r / s for r, s in zip(per_trial["recreate"], per_trial["shrink"], strict=True)
            ]
            row["recreate_over_shrink"] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
        report["modes"][mode] = row
        print(mode, json.dumps(row, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
