"""``clawcomm demo``: all-reduce on local ranks, checked and timed against gloo.

Spawns ``nproc`` local ranks. Each joins a clawcomm group and a gloo group
over the same ranks, checks that float32 all-reduce gives the exact expected
sum on both, and times both on the same buffers. The busbw column uses
nccl-tests' all-reduce factor 2(n-1)/n. The full benchmark (``clawcomm
bench``) replaces this with the issue that builds it.
"""

from __future__ import annotations

import time

SIZES = [8, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _time_allreduce(t, group, iters):
    import torch.distributed as dist

    for _ in range(3):
        dist.all_reduce(t, group=group)
    dist.barrier(group=group)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        dist.all_reduce(t, group=group)
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2]  # median


def _body(rank, ws):
    import torch
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    rows = []
    for nbytes in SIZES:
        n = max(1, nbytes // 4)
        row = {"bytes": n * 4}
        for name, group in (("clawcomm", None), ("gloo", gloo)):
            t = torch.full((n,), float(rank + 1))
            dist.all_reduce(t, group=group)
            want = float(ws * (ws + 1) // 2)
            ok = bool((t == want).all())
            iters = 200 if n * 4 <= (1 << 20) else 10
            t.fill_(1.0)
            seconds = _time_allreduce(t, group, iters)
            # Every rank uses the slowest rank's time, like nccl-tests.
            worst = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(worst, dist.ReduceOp.MAX)
            row[name] = (worst.item(), ok)
        rows.append(row)
    return rows


def run(nproc: int = 2) -> int:
    from clawcomm.testing import run_ranks

    rows = run_ranks(_body, nproc, timeout=600, pg_timeout=300)[0]
    factor = 2 * (nproc - 1) / nproc
    print(f"# clawcomm demo: float32 all_reduce (sum) on {nproc} local ranks, median time")
    print(
        f"# {'size (B)':>10} {'clawcomm us':>12} {'busbw GB/s':>11} {'gloo us':>10} "
        f"{'busbw GB/s':>11} {'speedup':>8} {'correct':>8}"
    )
    all_ok = True
    for row in rows:
        (tc, okc), (tg, okg) = row["clawcomm"], row["gloo"]
        bus_c = row["bytes"] * factor / tc / 1e9
        bus_g = row["bytes"] * factor / tg / 1e9
        all_ok &= okc and okg
        print(
            f"  {row['bytes']:>10} {tc * 1e6:>12.1f} {bus_c:>11.2f} {tg * 1e6:>10.1f} "
            f"{bus_g:>11.2f} {tg / tc:>7.1f}x {'yes' if okc and okg else 'NO':>8}"
        )
    return 0 if all_ok else 1
