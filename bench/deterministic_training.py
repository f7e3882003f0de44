"""What ``clawcomm train --deterministic`` costs: the GPT's median step time
with and without it, same layout, seed and effective batch, the two modes
interleaved run by run so that both see the same load.

    python3 bench/deterministic_training.py --json bench/results/deterministic_training.json \\
        | tee bench/results/deterministic_training.txt

Each run trains the character-level GPT (4 blocks of width 128, 0.8M
parameters) for --steps steps of 32 sequences of 64 characters (8
micro-batches of 4) and keeps the median step time of the second half. The
mode's costs: a copy of each backward pass's gradients into the micro-batch
tree, the data-parallel reduction launched after the last backward rather
than during it, and the exact loss and norm sums (an int64 all-reduce and a
few passes over the gradients). The GPT is CPU-bound on two cores, where
the default mode's overlap hides little: on a machine with a core per rank
the lost overlap would weigh more.
"""

from __future__ import annotations

import argparse
import json
import statistics

from clawcomm.launch import run_ranks
from clawcomm.train import TrainConfig
from clawcomm.train import cli as train_cli
from clawcomm.train.deterministic import ENV

LAYOUTS = [(1, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 3)]  # dp, pp, ZeRO


def _run(rank, world, cfg):
    return train_cli.train_rank(cfg, announce=False)


def _median_step_ms(dp: int, pp: int, zero: int, steps: int, on: bool) -> float:
    cfg = TrainConfig(model="gpt", dp=dp, pp=pp, zero=zero, microbatches=8 // dp,
                      micro_batch_size=4, steps=steps, quiet=True, deterministic=on)  # fmt: skip
    metrics = run_ranks(_run, dp * pp, cfg, env={ENV: "1"} if on else {}, timeout=3600)[0]
    return statistics.median(m["step_ms"] for m in metrics[steps // 2 :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--runs", type=int, default=3, help="interleaved runs of each mode")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    rows = []
    print("| layout | default step (ms) | deterministic step (ms) | ratio (median of runs) |")
    print("| --- | --- | --- | --- |")
    for dp, pp, zero in LAYOUTS:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.runs):
            for on in (False, True):
                times[on].append(_median_step_ms(dp, pp, zero, args.steps, on))
        ratios = [d / o for o, d in zip(times[False], times[True], strict=True)]
        row = dict(dp=dp, pp=pp, zero=zero, default_ms=times[False], deterministic_ms=times[True],
                   ratio=statistics.median(ratios))  # fmt: skip
        rows.append(row)
        name = f"dp {dp} x pp {pp}" + (f" ZeRO-{zero}" if zero else "")
        fmt = lambda xs: "-".join(f"{x:.0f}" for x in (min(xs), max(xs)))  # noqa: E731
        print(f"| {name} | {fmt(times[False])} | {fmt(times[True])} | {row['ratio']:.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python3 bench/deterministic_training.py", "steps": args.steps,
                       "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
