"""The mesh all-reduces (csrc/algorithms/mesh_all_reduce.cc) beyond the
collectives sweep's 1-4 ranks: 5 to 9 ranks, awkward counts, and the same
bits on every rank. One-shot folds the inputs in rank order, so its float
sums equal that fold computed here exactly; two-shot reduces each chunk on
one rank, so every rank holds the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from clawcomm.launch import run_ranks

COUNTS = [0, 1, 5, 1000, 262147]  # 262147 floats: past the 1 MiB inline size


def _input(count: int, rank: int) -> torch.Tensor:
    # Magnitudes that differ by orders, so the order of a float sum shows.
    g = torch.Generator().manual_seed(1000 * count + rank)
    return torch.randn(count, generator=g) * 10.0 ** torch.randint(-3, 4, (count,), generator=g)


def _mesh(rank, ws):
    from clawcomm import backend_of

    algo = backend_of().all_reduce_algorithm(8)
    failures = []
    for count in COUNTS:
        inputs = [_input(count, r) for r in range(ws)]
        fold = inputs[0].clone()
        for t in inputs[1:]:
            fold += t
        got = inputs[rank].clone()
        dist.all_reduce(got)
        everyone = [torch.empty_like(got) for _ in range(ws)]
        dist.all_gather(everyone, got)
        if not all(torch.equal(e, got) for e in everyone):
            failures.append(f"{algo} {count}: ranks disagree")
        if algo == "oneshot" and not torch.equal(got, fold):
            failures.append(f"oneshot {count}: not the rank-order fold")
        if not torch.allclose(got, fold, rtol=1e-5, atol=1e-3):
            failures.append(f"{algo} {count}: {got[:4]} != {fold[:4]}")
        ints = torch.arange(count, dtype=torch.int64) * (rank + 1)
        dist.all_reduce(ints, dist.ReduceOp.MAX)
        if not torch.equal(ints, torch.arange(count, dtype=torch.int64) * ws):
            failures.append(f"{algo} {count}: int64 max")
    return algo, failures


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
@pytest.mark.parametrize("world_size", [5, 6, 7, 8, 9])
def test_mesh_all_reduce_gives_every_rank_the_same_bits(world_size, algo):
    env = {"CLAWCOMM_ALGO": f"all_reduce:{algo}"}
    results = run_ranks(_mesh, world_size, env=env, timeout=300)
    assert {r[0] for r in results} == {algo}
    failures = [f"rank {r}: {f}" for r, (_, fs) in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:20])
