"""Sparse COO tensors through all_reduce, as gloo sums them: against the
dense sum computed locally, against gloo in the same ranks, and under DDP
with nn.Embedding(sparse=True) against single-process training."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from clawcomm.launch import run_ranks


def _sparse_input(rank, shape, sparse_dim, nnz, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    idx = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g) for d in range(sparse_dim)])
    values = torch.randint(-5, 6, (nnz, *shape[sparse_dim:]), generator=g).to(dtype)
    return torch.sparse_coo_tensor(idx, values, shape)  # duplicates on purpose: not coalesced


def _sums(rank, ws, shape, sparse_dim, nnz, dtype):
    gloo = dist.new_group(backend="gloo")
    mine = _sparse_input(rank, shape, sparse_dim, nnz, dtype)
    ours, theirs = mine.clone(), mine.clone()
    dist.all_reduce(ours)
    dist.all_reduce(theirs, group=gloo)
    want = sum(_sparse_input(r, shape, sparse_dim, nnz, dtype).to_dense() for r in range(ws))
    return ours.is_sparse, ours.to_dense(), theirs.to_dense(), want


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize(
    "shape,sparse_dim,nnz",
    [((20, 3), 1, 7), ((6, 5), 2, 11), ((50,), 1, 0), ((4, 4, 2), 2, 1)],
    ids=["rows", "entries", "empty", "one"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_sparse_all_reduce_matches_the_dense_sum_and_gloo(
    world_size, shape, sparse_dim, nnz, dtype
):
    for is_sparse, ours, gloo, want in run_ranks(
        _sums, world_size, shape, sparse_dim, nnz, dtype, timeout=60
    ):
        assert is_sparse
        assert torch.equal(ours, want), (ours, want)
        assert torch.equal(ours, gloo)


def _refused(rank, ws):
    errors = []
    for call in (
        lambda: dist.all_reduce(
            _sparse_input(rank, (8, 2), 1, 3, torch.float32), dist.ReduceOp.MAX
        ),
        lambda: dist.all_reduce(_sparse_input(rank, (8, 2 + rank), 1, 3, torch.float32)),
    ):
        try:
            call()
            errors.append("no error")
        except (ValueError, RuntimeError) as e:
            errors.append(str(e))
    return errors


def test_sparse_errors_name_the_op_and_the_problem():
    want = {
        0: "rank 1 passed a sparse tensor of [sparse dims, sizes...] [1, 8, 3], rank 0 [1, 8, 2]",
        1: "rank 0 passed a sparse tensor of [sparse dims, sizes...] [1, 8, 2], rank 1 [1, 8, 3]",
    }
    for rank, (redop, shapes) in enumerate(run_ranks(_refused, 2, timeout=60)):
        assert (
            "clawcomm::allreduce: sparse tensors are summed only (ReduceOp.SUM), got max" in redop
        )
        assert want[rank] in shapes, shapes


def _embedding_ddp(rank, ws):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(40, 8, sparse=True), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 3, 2))  # fmt: skip
    ref = torch.nn.Sequential(torch.nn.Embedding(40, 8, sparse=True), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 3, 2))  # fmt: skip
    ref.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(9)
    for _ in range(4):
        x = torch.randint(0, 40, (4 * ws, 3), generator=g)
        y = torch.randn(4 * ws, 2, generator=g)
        mine = slice(4 * rank, 4 * rank + 4)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    return max(
        (a - b).abs().max().item()
        for a, b in zip(ddp.module.parameters(), ref.parameters(), strict=True)
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_with_a_sparse_embedding_matches_single_process_training(world_size):
    for err in run_ranks(_embedding_ddp, world_size, timeout=120):
        assert err < 1e-5, err
