"""Data-parallel training with clawcomm.parallel.DataParallel, under torchrun.

    torchrun --nproc_per_node=2 examples/data_parallel.py
    torchrun --nproc_per_node=2 examples/data_parallel.py --compression topk:0.01 --accumulation 4

Each rank trains on its own shard. Gradients are averaged in buckets whose
reduction starts while backward is still running; with --accumulation N
they are summed locally over N micro-batches and reduced once, so each
micro-batch's loss is divided by N to train on the mean over the effective
batch (ranks x N micro-batches).
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn

import clawcomm  # noqa: F401  (registers the "clawcomm" backend)
from clawcomm.parallel import DataParallel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--compression", default=None, help="a spec: fp16, topk:0.01, ...")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    dist.init_process_group("clawcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # different initial weights: DataParallel broadcasts rank 0's
    model = DataParallel(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)),
        compression=args.compression,
        accumulation_steps=args.accumulation,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(42))
    for _ in range(args.steps):
        for _ in range(args.accumulation):  # backward reduces on the last one only
            x = torch.randn(64, 32, generator=g)
            loss = nn.functional.mse_loss(model(x), x @ w_true)
            (loss / args.accumulation).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g_) for g_ in gathered)
    if rank == 0:
        print(f"rank 0: final loss {loss.item():.4f}; parameters identical on {world} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
