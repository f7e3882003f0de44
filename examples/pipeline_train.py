"""Your own nn.Sequential trained over a dp x pp grid with clawcomm.train.

    torchrun --nproc-per-node 4 examples/pipeline_train.py --dp 2 --pp 2 --schedule zb1
    torchrun --nproc-per-node 2 examples/pipeline_train.py --pp 2 --compression topk:0.05

Every rank builds the same model from the same seed; the trainer cuts it
into stages (balanced by parameter count), keeps this rank's, and runs the
schedule. The loss sums over a micro-batch; the trainer divides by the
number of samples in the effective batch. At the end every rank checks that
its data-parallel replicas hold the same weights.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn

import clawcomm  # noqa: F401  (registers the "clawcomm" backend)
from clawcomm.train import TrainConfig, Trainer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--compression", default="")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()

    dist.init_process_group("clawcomm")
    torch.manual_seed(0)
    # A regression task: y = sin(x @ w / 4), 16 inputs; six layers to cut.
    model = nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
        nn.Linear(64, 64), nn.Linear(64, 1),
    )  # fmt: skip
    cfg = TrainConfig(dp=args.dp, pp=args.pp, schedule=args.schedule, microbatches=4,
                      micro_batch_size=8, steps=args.steps, lr=0.01, compression=args.compression,
                      quiet=True)  # fmt: skip
    trainer = Trainer(
        model,
        loss_fn=lambda out, y: ((out - y) ** 2).sum(),  # summed; the trainer divides
        optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.lr),
        config=cfg,
    )
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))

    def batches():  # the whole effective batch, the same on every rank
        g = torch.Generator().manual_seed(2)
        while True:
            x = torch.randn(cfg.effective_batch, 16, generator=g)
            yield x, torch.sin(x @ w / 4)

    metrics = trainer.fit(batches(), progress=False)
    if dist.get_rank() == 0:
        print(trainer.describe())
        print(f"loss {metrics[0]['loss']:.4f} -> {metrics[-1]['loss']:.4f}")
    # Replicas of a stage must agree exactly.
    for p_ in trainer.params:
        ref = p_.detach().clone()
        if trainer.dp_group is not None:
            dist.broadcast(ref, dist.get_global_rank(trainer.dp_group, 0), group=trainer.dp_group)
        assert torch.equal(ref, p_), "replicas diverged"
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"], "did not learn"
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"replicas identical on {dist.get_world_size()} ranks (dp {args.dp} x pp {args.pp})")
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
