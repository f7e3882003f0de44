"""Reduce-scatter and all-gather against the all-reduce of the same size,
on the raw engine (no torch), the three interleaved block by block in one
group so that each ratio sees one machine's load:

    python3 bench/rs_ag_ratio.py --nproc 2 --sizes 4,16,64 --rounds 3

Per size and round: the all-reduce (in place), the reduce-scatter out of
place (a separate output, as torch's reduce_scatter_tensor and FSDP call
it) and in place (the output is the rank's own chunk of the input), and
the all-gather out of place. Each time is the best of 7 blocks; the ratio
is that time over the all-reduce's in the same round. Buffers are 2
MiB-aligned on huge pages, as ``clawcomm bench`` puts them.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from clawcomm.launch import run_ranks


def _measure(rank, n, size, blocks):
    import torch.distributed as dist

    import clawcomm
    from clawcomm.bench.runners import host_array

    eng = clawcomm.engine_of(dist.group.WORLD)
    count = size // 4
    part = count // n
    a, b = host_array(count, np.float32), host_array(count, np.float32)
    a[:], b[:] = 1, 1
    out = host_array(part, np.float32)
    own = b[rank * part : (rank + 1) * part]
    ops = {
        "all_reduce": lambda: eng.all_reduce(a, "sum", None),
        "reduce_scatter": lambda: eng.reduce_scatter(b, out, "sum", None),
        "reduce_scatter_in_place": lambda: eng.reduce_scatter(b, own, "sum", None),
        "all_gather": lambda: eng.all_gather(out, b, None),
    }
    iters = max(2, (64 << 20) // size)
    best = dict.fromkeys(ops, float("inf"))
    for f in ops.values():
        f()
    for _ in range(blocks):
        for k, f in ops.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                f()
            best[k] = min(best[k], (time.perf_counter() - t0) / iters)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizes", default="4,16,64", help="MiB, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    rows = []
    print("| size | round | all-reduce (us) | RS / AR | RS in place / AR | AG / AR |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in range(args.rounds):
        for mib in (int(s) for s in args.sizes.split(",")):
            got = run_ranks(_measure, args.nproc, mib << 20, 7)
            t = {k: max(g[k] for g in got) for k in got[0]}  # the slowest rank's
            ar = t["all_reduce"]
            row = dict(size_mib=mib, round=r, **{k: v * 1e6 for k, v in t.items()})
            rows.append(row)
            print(f"| {mib} MiB | {r + 1} | {ar * 1e6:.0f} | {t['reduce_scatter'] / ar:.2f} | "
                  f"{t['reduce_scatter_in_place'] / ar:.2f} | {t['all_gather'] / ar:.2f} |",
                  flush=True)  # fmt: skip
    if args.json:
        command = (f"python3 bench/rs_ag_ratio.py --nproc {args.nproc} --sizes {args.sizes} "
                   f"--rounds {args.rounds}")  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"command": command, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
