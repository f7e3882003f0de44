"""clawcomm's ZeRO-3 (``clawcomm train --zero 3 --reshard-after-forward``)
against torch's FSDP2 (``fully_shard``, ``reshard_after_forward=True``), in
one run, on the same GPT, seed, batches and settings, at dp 2 and 4, over the
clawcomm backend and over gloo.

    python3 bench/zero_vs_fsdp.py --json bench/results/zero_vs_fsdp.json \\
        | tee bench/results/zero_vs_fsdp.txt

Both shard parameters, gradients and AdamW's state over the ranks and
gather a layer's parameters for its forward and again for its backward:
FSDP2 wraps each transformer block, and the root the rest (the embedding
and the output layer, which share a weight); clawcomm gathers each of the
model's layers (the embedding, each block, the head). One micro-batch per
replica and step (an effective batch of 32 sequences of 64 tokens), AdamW
at a constant learning rate, gradients clipped to norm 1.

Per run: the median step time of the second half, the final loss, the
highest peak resident set of the ranks from the third step on (the kernel's
VmHWM, reset after two steps: the same process start-up, data and model on
both sides, so the difference is what training holds; clawcomm's first step,
which learns the reducer's layout, holds the whole gradient as stage 0
does, FSDP2's does not), and the tensor bytes a rank holds between steps (parameters,
gradients and optimizer state: FSDP2's local shards; clawcomm's
``param_bytes + grad_bytes + optim_bytes``). Ratios: FSDP2's step time over
clawcomm's (above 1: clawcomm faster) and clawcomm's resident set over
FSDP2's (at most 1: clawcomm holds no more). Step times are this machine's
(2 cores: 4 ranks share them).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from clawcomm.launch import run_ranks
from clawcomm.train import TrainConfig


def _config(dp: int, steps: int) -> TrainConfig:
    return TrainConfig(model="gpt", dim=256, layers=6, heads=4, seq_len=64, dp=dp, zero=3,
                       reshard_after_forward=True, microbatches=1, micro_batch_size=32 // dp,
                       steps=steps, lr=1e-3, lr_decay="none", warmup_steps=0,
                       quiet=True)  # fmt: skip


WARM = 2  # steps before the resident set's peak is reset


def _reset_peak_rss() -> None:
    """The kernel's peak resident set (VmHWM) back to the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _ours(rank, world, cfg):
    from clawcomm.train import Trainer, models
    from clawcomm.train.data import global_batches

    model, loss_fn, make_opt, ds, tokens, sample = models.build(cfg)
    trainer = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    seen = []

    def log(m):
        seen.append(m)
        if len(seen) == WARM:
            _reset_peak_rss()

    metrics = trainer.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False,
                          log=log)  # fmt: skip
    rss = _peak_rss_mb()
    trainer.close()
    last = metrics[-1]
    held = last["param_bytes"] + last["grad_bytes"] + last["optim_bytes"]
    return [m["loss"] for m in metrics], [m["step_ms"] for m in metrics], rss, held


def _fsdp(rank, world, cfg):
    """FSDP2 over the same batches, the same loss normalisation (summed
    over tokens, divided by the effective batch's: FSDP2 averages
    gradients over the ranks, hence the factor world)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from clawcomm.train import models
    from clawcomm.train.data import global_batches

    model, loss_fn, _, ds, _, _ = models.build(cfg)
    for block in list(model)[1:-1]:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    per = cfg.effective_batch // world
    losses, times = [], []
    for step, (x, y) in zip(
        range(cfg.steps), global_batches(ds, cfg.effective_batch, cfg.seed), strict=False
    ):
        if step == WARM:
            _reset_peak_rss()
        t0 = time.perf_counter()
        xi, yi = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = loss_fn(model(xi), yi)
        (loss * (world / y.numel())).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=False)
        total = loss.detach().clone()
        dist.all_reduce(total)
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(total) / y.numel())

    def local(t):
        t = getattr(t, "_local_tensor", t)  # a DTensor's shard
        return t.numel() * t.element_size()

    held = sum(local(p) + (local(p.grad) if p.grad is not None else 0) for p in model.parameters())
    held += sum(local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return losses, times, _peak_rss_mb(), held


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--backends", nargs="+", default=["clawcomm", "gloo"])
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    rows = []
    n = sum(p.numel() for p in {id(q): q for q in _model(_config(2, 1)).parameters()}.values())
    print(f"# GPT {n / 1e6:.2f}M (dim 256, 6 blocks, 64 tokens), {args.steps} steps, "
          "effective batch 32, one micro-batch per replica, AdamW lr 1e-3, clip 1 "
          "(2-core machine)")  # fmt: skip
    print(f"# {'dp':>3} {'backend':<9}{'run':<42}{'step ms':>9}{'final loss':>11}"
          f"{'RSS MB':>9}{'held MB':>9}")  # fmt: skip
    for dp in args.dp:
        cfg = _config(dp, args.steps)
        for backend in args.backends:
            got = {}
            for name, fn in (("torch FSDP2 (reshard_after_forward=True)", _fsdp),
                             ("clawcomm --zero 3 --reshard-after-forward", _ours)):  # fmt: skip
                results = run_ranks(fn, dp, cfg, backend=backend, timeout=3600)
                losses, times = results[0][0], results[0][1]
                rss, held = max(r[2] for r in results), max(r[3] for r in results)
                step = statistics.median(times[len(times) // 2 :])
                got[name] = (step, losses[-1], rss)
                rows.append(dict(dp=dp, backend=backend, run=name, step_ms=step,
                                 final_loss=losses[-1], rss_mb=rss, held_bytes=held,
                                 losses=losses))  # fmt: skip
                print(f"  {dp:>3} {backend:<9}{name:<42}{step:>9.1f}{losses[-1]:>11.4f}"
                      f"{rss:>9.1f}{held / 1e6:>9.2f}")  # fmt: skip
            (ts, tl, tr), (os_, ol, or_) = got.values()
            print(f"  {dp:>3} {backend:<9}{'ratios':<42}{ts / os_:>8.2f}x{ol - tl:>+11.4f}"
                  f"{or_ / tr:>8.2f}x   (FSDP2/clawcomm time; loss difference; clawcomm/FSDP2 "
                  "RSS)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": rows}, f, indent=1)


def _model(cfg):
    from clawcomm.train import models

    return models.build(cfg)[0]


if __name__ == "__main__":
    main()
