"""Differential tests: the same inputs through clawcomm (the default group)
and gloo (a second group over the same ranks), in the same processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from clawcomm.launch import run_ranks

SIZES = [1, 7, 1000, 100_003]
OPS = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]


def _random(rank, n, dtype, salt):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g) * 2 + 0.5).to(dtype)  # positive: products stay sane
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def _close(a, b):
    if a.dtype.is_floating_point:
        # Reduction order differs between the two engines.
        return torch.allclose(a, b, rtol=1e-4 if a.element_size() > 2 else 2e-2, atol=1e-6)
    return torch.equal(a, b)


def _compare(rank, ws):
    gloo = dist.new_group(backend="gloo")
    mismatches = []

    def both(name, fn):
        a, b = fn(None), fn(gloo)
        for x, y in zip(a, b, strict=False):
            if not _close(x, y):
                mismatches.append(f"{name}: clawcomm {x.flatten()[:4]} gloo {y.flatten()[:4]}")

    for dtype in [torch.float32, torch.float64, torch.int32, torch.int64]:
        for n in SIZES:
            for op in OPS:
                if op == dist.ReduceOp.PRODUCT and n > 1000:
                    continue

                def ar(group, op=op, n=n, dtype=dtype):
                    t = _random(rank, n, dtype, 1)
                    dist.all_reduce(t, op, group=group)
                    return [t]

                both(f"all_reduce/{dtype}/{n}/{op}", ar)

            def rs(group, n=n, dtype=dtype):
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, _random(rank, n * ws, dtype, 2), group=group)
                return [out]

            def ag(group, n=n, dtype=dtype):
                out = torch.empty(n * ws, dtype=dtype)
                dist.all_gather_into_tensor(out, _random(rank, n, dtype, 3), group=group)
                return [out]

            def bc(group, n=n, dtype=dtype):
                t = _random(rank, n, dtype, 4)
                dist.broadcast(t, ws - 1, group=group)
                return [t]

            def red(group, n=n, dtype=dtype):
                t = _random(rank, n, dtype, 5)
                dist.reduce(t, 0, group=group)
                return [t] if rank == 0 else []

            def a2a(group, n=n, dtype=dtype):
                out = torch.empty(n * ws, dtype=dtype)
                dist.all_to_all_single(out, _random(rank, n * ws, dtype, 6), group=group)
                return [out]

            def ga(group, n=n, dtype=dtype):
                outs = [torch.empty(n, dtype=dtype) for _ in range(ws)] if rank == 0 else None
                dist.gather(_random(rank, n, dtype, 7), outs, dst=0, group=group)
                return outs or []

            def sc(group, n=n, dtype=dtype):
                out = torch.empty(n, dtype=dtype)
                ins = [_random(r, n, dtype, 8) for r in range(ws)] if rank == 0 else None
                dist.scatter(out, ins, src=0, group=group)
                return [out]

            for name, fn in [
                ("reduce_scatter", rs),
                ("all_gather", ag),
                ("broadcast", bc),
                ("reduce", red),
                ("all_to_all", a2a),
                ("gather", ga),
                ("scatter", sc),
            ]:
                both(f"{name}/{dtype}/{n}", fn)
    return mismatches


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_same_results_as_gloo(world_size):
    results = run_ranks(_compare, world_size, timeout=300)
    mismatches = [f"rank {r}: {m}" for r, ms in enumerate(results) for m in ms]
    assert not mismatches, "\n".join(mismatches[:20])


def _gloo_gaps(rank, ws):
    """What gloo gets wrong or lacks, done right by clawcomm."""
    out = {}
    # AVG: gloo does not support it.
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, dist.ReduceOp.AVG)
    out["avg"] = t.tolist()
    # Uneven all_to_all_single: gloo fails with "invalid tensor size".
    send = torch.arange(rank + 1, dtype=torch.float32)  # rank r sends r+1 elements in total
    in_splits = [rank + 1 if j == 0 else 0 for j in range(ws)]
    out_splits = [i + 1 for i in range(ws)] if rank == 0 else [0] * ws
    recv = torch.empty(sum(out_splits))
    dist.all_to_all_single(recv, send, out_splits, in_splits)
    out["uneven"] = recv.tolist()
    return out


def test_what_gloo_lacks():
    results = run_ranks(_gloo_gaps, 3)
    assert results[0]["avg"] == [1.0, 1.0, 1.0]
    assert results[0]["uneven"] == [0.0, 0.0, 1.0, 0.0, 1.0, 2.0]
