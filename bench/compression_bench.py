"""Compression speed on this machine, in one run:

1. top-k selection of 1% of 16M float32 values (sampled and exact) against
   one memcpy of the same 64 MiB;
2. a 64 MiB float32 all-reduce on 2 ranks over a transport (TCP by default),
   dense against compressed (top-k 1% with and without fp16 values, fp16),
   each the best of --repeats, selection and scatter included.

    python3 bench/compression_bench.py                      # TCP, 2 ranks
    python3 bench/compression_bench.py --transport shm --json bench/results/compression_shm.json

With --rank/--world/--store it is one rank of a job started by hand, for
example one per network namespace joined by a rate-limited veth pair (see
bench/README.md); rank 0 prints the all-reduce table.

Prints a table and optionally writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from clawcomm import _C
from clawcomm.compression import CompressorState, compressed_all_reduce
from clawcomm.launch import run_ranks

SPECS = ["none", "fp16", "topk:0.01", "topk:0.01+fp16"]


def best_of(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def selection(numel: int, repeats: int) -> dict:
    x = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    dst = np.empty_like(x)
    memcpy = best_of(lambda: np.copyto(dst, x), repeats)
    out = {"memcpy_ms": memcpy * 1e3}
    for method in ("sampled", "exact"):
        times = []
        for _ in range(repeats):
            acc = x.copy()
            t0 = time.perf_counter()
            _C.compress.topk(acc, numel // 100, method, 1)
            times.append(time.perf_counter() - t0)
        out[f"{method}_ms"] = min(times) * 1e3
        out[f"{method}_vs_memcpy"] = min(times) / memcpy
    return out


def _all_reduce_times(rank, n, numel, repeats):
    import torch.distributed as dist

    grad = torch.from_numpy(np.random.default_rng(rank).standard_normal(numel).astype(np.float32))
    out = {}
    for spec in SPECS:
        state = CompressorState()
        t = grad.clone()
        compressed_all_reduce(t, spec, state)  # warm-up, and the residual exists
        best = float("inf")
        for _ in range(repeats):
            t.copy_(grad)
            dist.barrier()
            t0 = time.perf_counter()
            compressed_all_reduce(t, spec, state)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            best = min(best, float(elapsed))
        out[spec] = best * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--transport", default="tcp", choices=("tcp", "shm"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--mib", type=int, default=64, help="gradient size in MiB (64)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--rank", type=int, help="this process is one rank (with --world, --store)")
    p.add_argument("--world", type=int)
    p.add_argument("--store", help="a FileStore path every rank can reach")
    args = p.parse_args()
    if args.rank is not None:
        import datetime

        import torch.distributed as dist

        import clawcomm  # noqa: F401

        store = dist.FileStore(args.store, args.world)
        dist.init_process_group(
            "clawcomm", store=store, rank=args.rank, world_size=args.world,
            timeout=datetime.timedelta(seconds=600),
        )  # fmt: skip
        times = _all_reduce_times(args.rank, args.world, (args.mib << 20) // 4, args.repeats)
        if args.rank == 0:
            print(
                f"# {args.mib} MiB float32 all-reduce, {args.world} ranks, best of {args.repeats}"
            )
            for spec in SPECS:
                print(f"  {spec:<18} {times[spec]:9.2f} ms {times[spec] / times['none']:9.2%}")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"args": vars(args), "all_reduce_ms": times}, f, indent=1)
        dist.destroy_process_group()
        return
    sel = selection(16 << 20, args.repeats)
    print("# top-k selection of 1% of 16M float32 values (64 MiB), best of", args.repeats)
    print(f"#   memcpy {sel['memcpy_ms']:.2f} ms")
    for m in ("sampled", "exact"):
        print(f"#   {m:8s} {sel[m + '_ms']:.2f} ms = {sel[m + '_vs_memcpy']:.2f}x memcpy")
    numel = (args.mib << 20) // 4
    times = run_ranks(
        _all_reduce_times, args.nproc, numel, args.repeats,
        env={"CLAWCOMM_TRANSPORT": args.transport}, timeout=1800, pg_timeout=600,
    )[0]  # fmt: skip
    print(f"# {args.mib} MiB float32 all-reduce, {args.nproc} ranks over {args.transport}, "
          f"best of {args.repeats} (slowest rank)")  # fmt: skip
    print("# compressor         time (ms)   vs dense")
    for spec in SPECS:
        print(f"  {spec:<18} {times[spec]:9.2f} {times[spec] / times['none']:9.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "selection": sel, "all_reduce_ms": times}, f, indent=1)


if __name__ == "__main__":
    main()
