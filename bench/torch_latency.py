"""Where a small all-reduce's time goes on the CPU, through torch.distributed
and around it, layer by layer, in one run (issue 25 §2).

Per world size (2 and 4 ranks by default; 4 ranks on a 2-core machine
share the cores), every rank times back-to-back blocking calls on one
float32 value (4 bytes; torch's minimum), the layers interleaved over
--rounds rounds, each the best of three batches of --calls calls; the table
gives the median and the best over rounds of the slowest rank's time (on a
shared VM the same call's time can double from one batch to the next; the
best is the figure least touched by neighbours):

  fake          torch's no-op backend ("fake",
                torch.testing._internal.distributed.fake_pg): the Python
                call, c10d's dispatch, a Work and its wait, nothing moved.
                The floor of any backend reached through torch.distributed.
  clawcomm x1   a one-rank clawcomm group: the same call through our
                adapter and engine with no peer to wait for.
  engine        the group's engine called directly (clawcomm.engine_of:
                pybind11, no torch dispatch, no Work).
  clawcomm      the whole group through torch.distributed.
  gloo          torch's gloo backend over the same ranks.

So "clawcomm x1 - fake" is what our adapter and engine add per call with
nothing to wait for, and "clawcomm - engine" is torch's dispatch plus our
adapter on a real group.

    python3 bench/torch_latency.py --json bench/results/torch_latency.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

import clawcomm
from clawcomm.launch import run_ranks

LAYERS = ["fake", "clawcomm x1", "engine", "clawcomm", "gloo"]


def _best(fn, calls: int) -> float:
    """Best of three batches of `calls` calls, seconds a call (after a warm-up)."""
    for _ in range(min(calls, 200)):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _worker(rank: int, world: int, calls: int, rounds: int) -> dict[str, list[float]]:
    # imported for its side effect: it registers the "fake" backend
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

    fake = dist.new_group(backend="fake")
    gloo = dist.new_group(backend="gloo")
    alone = None
    for r in range(world):  # every rank takes part in creating every group
        g = dist.new_group([r], backend="clawcomm")
        if r == rank:
            alone = g
    x = torch.zeros(1)
    arr = np.zeros(1, np.float32)
    engine = clawcomm.engine_of()
    fns = {
        "fake": lambda: dist.all_reduce(x, group=fake),
        "clawcomm x1": lambda: dist.all_reduce(x, group=alone),
        "engine": lambda: engine.all_reduce(arr),
        "clawcomm": lambda: dist.all_reduce(x),
        "gloo": lambda: dist.all_reduce(x, group=gloo),
    }
    out: dict[str, list[float]] = {k: [] for k in LAYERS}
    for _ in range(rounds):
        for k in LAYERS:
            dist.barrier()
            out[k].append(_best(fns[k], calls) * 1e6)
    return out


def measure(world: int, calls: int, rounds: int) -> dict[str, dict[str, float]]:
    """Per layer: the median and the best over rounds of the slowest rank."""
    per_rank = run_ranks(_worker, world, calls, rounds, timeout=900)
    out = {}
    for k in LAYERS:
        slowest = [max(r[k][i] for r in per_rank) for i in range(rounds)]
        out[k] = {"median": statistics.median(slowest), "best": min(slowest)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worlds", default="2,4", help="world sizes (2,4)")
    ap.add_argument("--calls", type=int, default=5000, help="calls per batch (5000)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (5)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    rows = {}
    print(f"# us per blocking 4-byte all-reduce of the slowest rank, over {args.rounds} rounds: "
          "median (best)")  # fmt: skip
    print(f"# {'ranks':>5s} " + " ".join(f"{k:>15s}" for k in LAYERS) + "  clawcomm - fake")
    for w in (int(s) for s in args.worlds.split(",")):
        row = measure(w, args.calls, args.rounds)
        rows[str(w)] = row
        cells = " ".join(f"{row[k]['median']:7.2f} ({row[k]['best']:5.2f})" for k in LAYERS)
        above = row["clawcomm"]["median"] - row["fake"]["median"]
        print(f"  {w:5d} {cells}  {above:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python3 bench/torch_latency.py", "us": rows,
                       "calls": args.calls, "rounds": args.rounds}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
