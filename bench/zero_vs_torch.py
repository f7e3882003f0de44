"""clawcomm's ZeRO-1 (``clawcomm train --zero 1``) against torch's own
``ZeroRedundancyOptimizer`` under DDP, in one run, on the same GPT, seed,
batches and settings, over the clawcomm backend and over gloo.

    python3 bench/zero_vs_torch.py --json bench/results/zero_vs_torch.json \\
        | tee bench/results/zero_vs_torch.txt

Both train the GPT (0.81M parameters) at dp 2 with an effective batch of 32
sequences in 4 micro-batches per replica (DDP under ``no_sync`` for the
first three), AdamW at a constant learning rate, gradients clipped to norm
1. Per rank: the median step time of the second half, the final loss, and
the optimizer state's bytes on the rank that holds the most
(``ZeroRedundancyOptimizer`` shards whole parameters, clawcomm flat
buckets). Ratios: torch's step time over clawcomm's (above 1: clawcomm
faster) and clawcomm's optimizer bytes over torch's (at most 1: clawcomm
holds no more). Step times are this machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from clawcomm.launch import run_ranks
from clawcomm.train import TrainConfig
from clawcomm.train import cli as train_cli


def _config(steps: int) -> TrainConfig:
    return TrainConfig(model="gpt", dp=2, zero=1, microbatches=4, micro_batch_size=4,
                       steps=steps, lr=1e-3, lr_decay="none", warmup_steps=0,
                       quiet=True)  # fmt: skip


def _state_bytes(optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )


def _ours(rank, world, cfg):
    metrics = train_cli.train_rank(cfg, announce=False)
    return [m["loss"] for m in metrics], [m["step_ms"] for m in metrics], metrics[-1]["optim_bytes"]


def _torch(rank, world, cfg):
    """DDP + ZeroRedundancyOptimizer over the same batches, the same loss
    normalisation (summed over tokens, divided by the effective batch's)."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from clawcomm.train import models
    from clawcomm.train.data import global_batches

    model, loss_fn, _, ds, _, _ = models.build(cfg)
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=cfg.lr,
        weight_decay=cfg.weight_decay,
    )  # fmt: skip
    per = cfg.effective_batch // world
    losses, times = [], []
    for _, (x, y) in zip(
        range(cfg.steps), global_batches(ds, cfg.effective_batch, cfg.seed), strict=False
    ):
        t0 = time.perf_counter()
        xs = x[rank * per : (rank + 1) * per].chunk(cfg.microbatches)
        ys = y[rank * per : (rank + 1) * per].chunk(cfg.microbatches)
        total = torch.zeros(())
        for i, (xi, yi) in enumerate(zip(xs, ys, strict=True)):
            scale = world / y.numel()  # DDP averages over ranks: the mean over every token
            if i < len(xs) - 1:
                with ddp.no_sync():
                    loss = loss_fn(ddp(xi), yi)
                    (loss * scale).backward()
            else:
                loss = loss_fn(ddp(xi), yi)
                (loss * scale).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=False)
        dist.all_reduce(total)
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(total) / y.numel())
    return losses, times, _state_bytes(opt.optim)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    cfg = _config(args.steps)
    rows = []
    print(f"# GPT 0.81M, dp 2, {args.steps} steps, effective batch 32 in 4 micro-batches per"
          " replica, AdamW lr 1e-3, clip 1 (2-core machine)")  # fmt: skip
    print(f"# {'backend':<9}{'run':<36}{'step ms':>9}{'final loss':>11}{'optim MB':>10}")
    for backend in ("clawcomm", "gloo"):
        got = {}
        for name, fn in (("torch DDP + ZeroRedundancyOptimizer", _torch),
                         ("clawcomm train --zero 1", _ours)):  # fmt: skip
            results = run_ranks(fn, 2, cfg, backend=backend, timeout=3600)
            losses, times, _ = results[0]
            optim = max(r[2] for r in results)
            step = statistics.median(times[len(times) // 2 :])
            got[name] = (step, losses[-1], optim)
            rows.append(dict(backend=backend, run=name, step_ms=step, final_loss=losses[-1],
                             optim_bytes=optim, losses=losses))  # fmt: skip
            print(f"  {backend:<9}{name:<36}{step:>9.1f}{losses[-1]:>11.4f}{optim / 1e6:>10.2f}")
        (ts, tl, to), (os_, ol, oo) = got.values()
        print(
            f"  {backend:<9}{'ratios':<36}{ts / os_:>8.2f}x{ol - tl:>+11.4f}{oo / to:>9.2f}x"
            "   (torch/clawcomm time; loss difference; clawcomm/torch memory)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
