"""Stock DDP training on the clawcomm backend, launched with torchrun.

    torchrun --nproc_per_node=2 examples/ddp_torchrun.py

Across hosts, run the same command on each host with --nnodes, --node_rank
and --master_addr; ranks on one host talk over shared memory, ranks on
different hosts over TCP.

The only clawcomm-specific lines are `import clawcomm` and the backend name.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import clawcomm  # noqa: F401  (registers the "clawcomm" backend)


def main():
    dist.init_process_group("clawcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(42))
    for _ in range(50):
        x = torch.randn(64, 32, generator=g)
        loss = nn.functional.mse_loss(model(x), x @ w_true)
        opt.zero_grad()
        loss.backward()
        opt.step()
    # Every rank holds the same parameters after DDP training.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g_) for g_ in gathered)
    if rank == 0:
        print(f"rank 0: final loss {loss.item():.4f}; parameters identical on {world} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
