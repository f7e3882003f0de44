"""The GPT trained by ``clawcomm train`` in every layout and schedule, same
seed and effective batch: the loss curves must lie on top of each other.

    python3 bench/train_bench.py --json bench/results/train_layouts.json \\
        --plot bench/results/train_layouts.png | tee bench/results/train_layouts.txt

Each run trains the character-level GPT (4 blocks of width 128, 0.8M
parameters, on the Python documentation bundled with CPython) for --steps
steps of an effective batch of 32 sequences of 64 characters, AdamW with
warm-up and cosine decay, gradients clipped to norm 1. The table gives the
final loss, the largest difference from the dp1 x pp1 curve over the first
10 steps and over all of them (float32 reordering, amplified as training
goes on), and the median step time, tokens/s and bubble of the second half. This is a
CPU-bound model on two cores: ranks beyond two share the cores, so the
step times say what this machine does, not what the layouts would do on
one core each (bench/pipeline_bench.py measures schedules honestly).
"""

from __future__ import annotations

import argparse
import json
import statistics

from clawcomm.launch import run_ranks
from clawcomm.train import TrainConfig
from clawcomm.train import cli as train_cli

LAYOUTS = [
    # dp, pp, schedule, v
    (1, 1, "1f1b", 1),
    (2, 1, "1f1b", 1),
    (1, 2, "gpipe", 1),
    (1, 2, "1f1b", 1),
    (1, 2, "interleaved", 2),
    (1, 2, "zb1", 1),
    (2, 2, "1f1b", 1),
    (2, 2, "zb1", 1),
    (1, 4, "1f1b", 1),
    (1, 4, "zb1", 1),
]


def _run(rank, world, cfg):
    return train_cli.train_rank(cfg, announce=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="PNG")
    args = p.parse_args()
    runs = []
    for dp, pp, schedule, v in LAYOUTS:
        m = 4
        cfg = TrainConfig(model="gpt", dp=dp, pp=pp, schedule=schedule, virtual_stages=v,
                          microbatches=m, micro_batch_size=32 // (m * dp), steps=args.steps,
                          lr=1e-3, warmup_steps=10, quiet=True)  # fmt: skip
        metrics = run_ranks(_run, dp * pp, cfg, timeout=3600)[0]
        name = f"dp{dp} x pp{pp} {schedule}" + (f" v={v}" if v > 1 else "")
        runs.append({"layout": name, "metrics": metrics})
    ref = [m["loss"] for m in runs[0]["metrics"]]
    print(f"# clawcomm train --model gpt, {args.steps} steps, effective batch 32 x 64 tokens,"
          " seed 0 (2-core machine; CPU-bound: step times are this machine's)")  # fmt: skip
    print(f"# {'layout':<26}{'final loss':>11}{'|diff| 1-10':>12}{'max |diff|':>11}{'step ms':>9}"
          f"{'tokens/s':>10}{'bubble':>8}{'predicted':>10}")  # fmt: skip
    for r in runs:
        ms = r["metrics"]
        tail = ms[len(ms) // 2 :]
        diffs = [abs(a["loss"] - b) for a, b in zip(ms, ref, strict=True)]
        diff, early = max(diffs), max(diffs[:10])
        keys = ("step_ms", "tokens_per_s", "bubble", "bubble_predicted")
        med = {k: statistics.median(x[k] for x in tail) for k in keys}
        r["summary"] = {"final_loss": ms[-1]["loss"], "max_diff": diff, "diff_10": early, **med}
        print(
            f"  {r['layout']:<26}{ms[-1]['loss']:>11.4f}{early:>12.1e}{diff:>11.1e}"
            f"{med['step_ms']:>9.1f}"
            f"{med['tokens_per_s']:>10.0f}{med['bubble']:>8.3f}{med['bubble_predicted']:>10.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4))
        for i, r in enumerate(runs):
            steps = [m["step"] for m in r["metrics"]]
            ax.plot(steps, [m["loss"] for m in r["metrics"]], label=r["layout"],
                    lw=2.5 if i == 0 else 1, ls="-" if i == 0 else "--")  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (mean over the effective batch)")
        ax.set_title("GPT, same seed and effective batch, every layout")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
