"""One torch collective on 2 local ranks, A/B between variants (a checkout
and/or CLAWCOMM_* settings), in alternating runs, with the median of each.

On the 2-core reference machine one run of a point can take 1.5-5x another
for seconds at a time (docs/benchmarks.md, the slow mode), so a single
`clawcomm bench` run cannot tell two variants 20% apart. Here each variant
runs ``--rounds`` times, in alternating order (A B, B A, ...), each run a
fresh pair of processes timing 40 blocks of about 20 ms; a run reports the
median block, and the variant the median of its runs.

    python3 bench/op_ab.py --op all_gather --bytes 2M \\
        --variant . --variant ".|CLAWCOMM_SINGLE_COPY_BYTES=4194304"
    python3 bench/op_ab.py --op sendrecv --bytes 4M --variant /tmp/base --variant .

A variant is a checkout (built in place) and optional settings, joined by
`|`. Sizes are per rank: each rank's input (all-gather's output is n times
that; reduce-scatter's is 1/n).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

OPS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "sendrecv"]


def _one_run(op: str, nbytes: int, blocks: int) -> list[float]:
    """Runs in the child: times `op` on 2 ranks, returns rank 0's blocks (us)."""
    import time

    import numpy as np
    import torch
    import torch.distributed as dist

    from clawcomm.bench.runners import host_array
    from clawcomm.launch import run_ranks

    def body(rank, n):
        count = nbytes // 4
        inp = torch.from_numpy(host_array(count, np.float32)).fill_(rank)
        out = torch.from_numpy(host_array(count * n, np.float32))
        part = torch.from_numpy(host_array(count // n, np.float32))
        nxt, prv = (rank + 1) % n, (rank - 1) % n

        def step():
            if op == "all_reduce":
                dist.all_reduce(inp)
            elif op == "reduce_scatter":
                dist.reduce_scatter_tensor(part, inp)
            elif op == "all_gather":
                dist.all_gather_into_tensor(out, inp)
            elif op == "broadcast":
                dist.broadcast(inp, 0)
            elif op == "all_to_all":
                dist.all_to_all_single(out[:count], inp)
            else:
                received = dist.irecv(out[:count], src=prv)
                dist.isend(inp, dst=nxt).wait()
                received.wait()

        for _ in range(5):
            step()
        iters = max(1, int(0.02 / max(nbytes / 10e9, 1e-5)))
        times = []
        for _ in range(blocks):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                step()
            times.append((time.perf_counter() - start) / iters * 1e6)
        return times

    return run_ranks(body, 2)[0]


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--op", choices=OPS, required=True)
    p.add_argument("--bytes", type=_bytes, required=True, help="per rank (4M, 512K, ...)")
    p.add_argument("--variant", action="append", required=True, help="CHECKOUT[|NAME=VALUE...]")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(statistics.median(_one_run(args.op, args.bytes, args.blocks)))
        return
    runs: dict[str, list[float]] = {v: [] for v in args.variant}
    for r in range(args.rounds):
        for v in args.variant if r % 2 == 0 else args.variant[::-1]:
            checkout, *settings = v.split("|")
            env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
            env.update(s.split("=", 1) for s in settings)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--op", args.op]
            cmd += ["--bytes", str(args.bytes), "--variant", v, "--blocks", str(args.blocks)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{v}: {done.stderr[-2000:]}")
            runs[v].append(float(done.stdout.split()[-1]))
    print(f"{args.op}, {args.bytes} B per rank, 2 ranks: median of {args.rounds} runs (us)")
    for v, times in runs.items():
        each = " ".join(f"{t:.0f}" for t in times)
        print(f"  {statistics.median(times):8.1f}  {v}  [{each}]")


if __name__ == "__main__":
    main()
