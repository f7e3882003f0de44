"""What a group split from another costs to set up, against the same groups
made by dist.new_group (a rendezvous over the store), in one run (issue 25
§6).

Per world size, every rank makes the same layout of groups (two halves:
ranks 0..n/2-1 and n/2..n-1) --rounds times each way, interleaved:

  new_group     dist.new_group for each half, as torch users do (every rank
                calls it for every group; each group connects through the
                store: token, hosts, addresses, connected).
  split_group   clawcomm.split_group([lower, upper]): one call, over the
                parent's connections (csrc/comm/split.cc), no store round
                trips.
  engine_split  the same split one layer down, on the world's engine
                (clawcomm.engine_of().split(color)): no torch ProcessGroup
                around it.

then one all-reduce on the new group, and destroys it. The table gives the
median and the best setup time of the slowest rank, milliseconds.

    python3 bench/split_bench.py --json bench/results/split_bench.json
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

WAYS = ["new_group", "split_group", "engine_split"]


def _worker(rank: int, world: int, rounds: int) -> dict[str, list[float]]:
    halves = [list(range(world // 2)), list(range(world // 2, world))]
    mine = halves[0] if rank in halves[0] else halves[1]
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            dist.barrier()
            t0 = time.perf_counter()
            if way == "new_group":
                groups = [dist.new_group(h) for h in halves]
                group = groups[halves.index(mine)]
            elif way == "split_group":
                group = clawcomm.split_group(halves)
            else:
                engine = clawcomm.engine_of().split(halves.index(mine))
            times[way].append(time.perf_counter() - t0)
            if way == "engine_split":
                t = np.ones(1, np.float32)
                engine.all_reduce(t)
                assert t[0] == len(mine)
                del engine
                dist.barrier()
                continue
            t = torch.ones(1)
            dist.all_reduce(t, group=group)
            assert t.item() == len(mine)
            dist.barrier()
            if way == "new_group":
                for g in groups:
                    dist.destroy_process_group(g)
            else:
                dist.destroy_process_group(group)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        per_rank = run_ranks(_worker, world, args.rounds, timeout=600)
        for way in WAYS:
            # Each round's slowest rank, then the median and best over rounds.
            slowest = [max(r[way][i] for r in per_rank) * 1e3 for i in range(args.rounds)]
            rows.append(
                {
                    "world": world,
                    "way": way,
                    "median_ms": round(statistics.median(slowest), 2),
                    "best_ms": round(min(slowest), 2),
                }
            )
    print(f"{'world':>5}  {'way':<12} {'median ms':>10} {'best ms':>8}")
    for r in rows:
        print(f"{r['world']:>5}  {r['way']:<12} {r['median_ms']:>10} {r['best_ms']:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "rows": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
