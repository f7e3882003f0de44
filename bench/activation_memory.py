"""Activation memory per rank and step time of ``--activation-checkpoint``
none, selective and full, at tp 1 and with tensor and sequence parallelism,
on the GPT.

    python3 bench/activation_memory.py --json runs/activation_memory.json

Activation memory is counted exactly rather than read from the resident
set: a ``TorchDispatchMode`` around the step's pipeline runs notes every
tensor that an op creates while autograd records (the forward passes, and
the forward that a recomputation runs again inside backward), and a
finalizer on its storage notes when it is freed; the figure is the peak of
those bytes alive at once on the rank that holds the most. Gradients and
the optimizer's state, made with autograd off, are not activations and are
not counted. The step time is the median of the second half of the steps
(compute-bound: the layers compute on this machine's CPU cores).

Per row: mode, tp, peak activation MB per rank, its share of tp 1 with no
recomputation, the median step time, the losses' largest difference from
the run with no recomputation at the same tp (0: identical training), and
the parameters, gradients and AdamW state a rank holds (MB, the fullest
rank's, from the trainer's metrics).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from clawcomm.launch import run_ranks
from clawcomm.train import TrainConfig, Trainer, models
from clawcomm.train.data import global_batches
from clawcomm.train.recompute import LiveActivations


def _config(args, mode: str, tp: int) -> TrainConfig:
    return TrainConfig(model="gpt", dim=args.dim, layers=args.layers, heads=args.heads,
                       seq_len=args.seq_len, tp=tp, microbatches=args.microbatches,
                       micro_batch_size=args.micro_batch_size, steps=args.steps,
                       activation_checkpoint=mode, lr_decay="none", quiet=True)  # fmt: skip


def _rank(rank: int, world: int, cfg: TrainConfig) -> dict:
    model, loss_fn, make_opt, ds, tokens, sample = models.build(cfg)
    tr = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    run, peaks = tr.executor.run, []

    def counted(*a, **kw):
        counter = LiveActivations()
        with counter:
            out = run(*a, **kw)
        peaks.append(counter.peak)
        return out

    tr.executor.run = counted
    metrics = tr.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)
    tr.close()
    half = metrics[len(metrics) // 2 :]
    last = metrics[-1]  # (the rank that holds the most, as every rank reports it)
    return dict(
        peak=max(peaks),
        step_ms=statistics.median(m["step_ms"] for m in half),
        losses=[m["loss"] for m in metrics],
        state=(last["param_bytes"], last["grad_bytes"], last["optim_bytes"]),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    print(f"# gpt: dim {args.dim}, {args.layers} blocks, {args.heads} heads, {args.seq_len} "
          f"tokens, {args.microbatches} x {args.micro_batch_size} samples per step; sequence "
          f"parallel at tp > 1")  # fmt: skip
    print(f"# {'mode':<10}{'tp':>3}{'act MB/rank':>12}{'of tp 1 none':>13}{'step ms':>9}"
          f"{'max |dloss|':>12}{'params':>8}{'grads':>7}{'adamw':>7}")  # fmt: skip
    rows, base = [], None
    for tp in args.tp:
        ref = None
        for mode in ("none", "selective", "full"):
            ranks = run_ranks(_rank, tp, _config(args, mode, tp), timeout=1800)
            peak = max(r["peak"] for r in ranks) / 2**20
            losses = ranks[0]["losses"]
            ref = ref or losses
            base = base or peak
            d = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
            state = [b / 2**20 for b in ranks[0]["state"]]
            row = dict(mode=mode, tp=tp, activation_mb=peak, share=peak / base,
                       step_ms=ranks[0]["step_ms"], max_loss_diff=d, param_mb=state[0],
                       grad_mb=state[1], optim_mb=state[2])  # fmt: skip
            rows.append(row)
            print(f"  {mode:<10}{tp:>3}{peak:>12.1f}{peak / base:>13.2f}"
                  f"{row['step_ms']:>9.1f}{d:>12.1e}{state[0]:>8.2f}{state[1]:>7.2f}"
                  f"{state[2]:>7.2f}", flush=True)  # fmt: skip
    if args.json:
        from clawcomm.bench.report import write_json

        write_json(
            args.json,
            {"command": " ".join(["python3", *sys.argv]), "args": vars(args), "runs": rows},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
