"""torch's ``_time_estimator`` on clawcomm against the measured time of the
same call, one collective at a time, on one host:

    python3 bench/time_estimate_bench.py --nproc 2 --json bench/results/time_estimate_2ranks.json

1. Calibrates the cost model on this machine (``clawcomm bench
   --calibrate``; ``--model FILE`` takes one already written).
2. On ``--nproc`` ranks with ``CLAWCOMM_COST_MODEL`` set to it, for each
   operation and size: the estimate of one call (``_time_estimator``,
   nothing moves), then the measured time of the same call through
   ``torch.distributed``: the median over ``--blocks`` blocks of the mean of
   a block, the slowest rank's, after a warm-up.
3. Prints estimate / measured per point, and how many are within 15%.

The estimate is the cost model's (csrc/algorithms/costs.cc,
docs/algorithms.md): whatever the model leaves out shows here, as it does
in ``clawcomm plan``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]


def _measure(rank, n, ops, sizes, blocks):
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _time_estimator

    def call(op, nbytes):
        count = nbytes // 4
        big = torch.ones(count)
        part = torch.ones(count // n)
        out = torch.empty(count)
        return {
            "all_reduce": lambda: dist.all_reduce(big),
            "all_gather": lambda: dist.all_gather_single(out, part),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, big),
            "broadcast": lambda: dist.broadcast(big, src=0),
            "all_to_all": lambda: dist.all_to_all_single(out, big),
        }[op]

    rows = []
    for op in ops:
        for nbytes in sizes:
            f = call(op, nbytes)
            with _time_estimator(device=torch.device("cpu")) as cm:
                f()
            iters = max(3, min(200, (256 << 20) // nbytes))
            for _ in range(3):
                f()
            times = []
            for _ in range(blocks):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    f()
                times.append((time.perf_counter() - t0) / iters)
            measured = torch.tensor([statistics.median(times)])
            dist.all_reduce(measured, op=dist.ReduceOp.MAX)
            rows.append(
                {
                    "op": op,
                    "bytes": nbytes,
                    "estimate_us": cm.estimated_time,
                    "measured_us": float(measured) * 1e6,
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", help="a model file from clawcomm bench --calibrate (default: new)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()

    from clawcomm.launch import run_ranks

    def size(text: str) -> int:
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)

    model = args.model
    if model is None:
        model = os.path.join(tempfile.mkdtemp(prefix="clawcomm-estimate-"), "model.json")
        subprocess.run(
            [sys.executable, "-m", "clawcomm.cli", "bench", "--calibrate", model], check=True
        )
    with open(model) as f:
        calibrated = json.load(f)
    rows = run_ranks(
        _measure,
        args.nproc,
        args.ops.split(","),
        [size(s) for s in args.sizes.split(",")],
        args.blocks,
        env={"CLAWCOMM_COST_MODEL": model},
        timeout=1800,
    )[0]
    within = 0
    print(f"{'op':<15}{'bytes':>10}{'estimate us':>14}{'measured us':>14}{'ratio':>8}")
    for r in rows:
        r["ratio"] = r["estimate_us"] / r["measured_us"]
        within += abs(r["ratio"] - 1) <= 0.15
        print(
            f"{r['op']:<15}{r['bytes']:>10}{r['estimate_us']:>14.1f}"
            f"{r['measured_us']:>14.1f}{r['ratio']:>8.2f}"
        )
    print(f"{within} of {len(rows)} within 15%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"nproc": args.nproc, "model": calibrated, "rows": rows, "within_15pct": within},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
