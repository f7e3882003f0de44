"""What each ZeRO stage holds per rank, against ZeRO's formula: the GPT
trained by ``clawcomm train`` at dp 1, 2 and 4 x ``--zero 0|1|2|3`` (3: its
default at pp 1, resharding after forward; 3k: 3 with
``--no-reshard-after-forward``), same seed and effective batch.

    python3 bench/zero_memory.py --json bench/results/zero_memory.json \\
        | tee bench/results/zero_memory.txt

Per rank (the rank that holds the most), from the step's metrics: parameter,
gradient and optimizer-state bytes once the step's gradients are reduced
(``param_bytes``, ``grad_bytes``, ``optim_bytes``), and the most parameter
and gradient bytes held during the step (``param_peak_bytes``,
``grad_peak_bytes``), of the last step and of the first (step 1, which
learns the reducer's bucket order and, at stage 3, lays the shards out
anew). ZeRO (Rajbhandari et al.) gives, for Psi parameters in
float32 with AdamW: optimizer state 8 Psi at stage 0 and 8 Psi / dp from
stage 1; gradients 4 Psi, 4 Psi / dp from stage 2; parameters 4 Psi, 4 Psi /
dp at stage 3 between uses, plus the layers gathered while they compute (the
peak: every layer kept across the micro-batches by default, about two
resharding after forward). The check column says whether each sharded
figure is within 5% of its formula (1/dp of stage 0's at the same dp; stage
1 keeps the full gradient buffer beside its shard, so its gradients are
checked against 1 + 1/dp), and at stage 3 that step 1 held no more
parameters than the last step.
The final losses must agree (float32 reordering). RS, AG and AR ms: the
step's data-parallel reduce-scatters, all-gathers and all-reduces, as long
as they ran on the rank where they ran longest (the engine's ``busy_us``,
start to end of each collective, waiting for late peers included; medians
of the second half), beside the all-reduce that stage 0 makes. Step times
are this machine's (ranks beyond its cores share them).
"""

from __future__ import annotations

import argparse
import json
import statistics

from clawcomm.launch import run_ranks
from clawcomm.parallel.zero import model_state_bytes
from clawcomm.train import TrainConfig
from clawcomm.train import cli as train_cli

MB = 1e6


def _run(rank, world, cfg):
    return train_cli.train_rank(cfg, announce=False)


def _expected(stage: int, dp: int) -> dict:
    """Each figure as a fraction of stage 0's at the same dp (the sharded
    ones: parameters only at stage 3)."""
    held, whole = model_state_bytes(1, dp, stage), model_state_bytes(1, dp, 0)
    keys = ["optim_bytes", "grad_bytes"] + (["param_bytes"] if stage == 3 else [])
    return {k: held[k] / whole[k] for k in keys}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    keys = ("param_bytes", "param_peak_bytes", "grad_bytes", "grad_peak_bytes", "optim_bytes")
    firsts = ("param_peak_bytes", "grad_peak_bytes")
    runs, failed = [], 0
    print(f"# clawcomm train --model gpt --dp D --zero Z --steps {args.steps} (effective batch 32,"
          " 4 micro-batches): MB per rank")  # fmt: skip
    print(f"# {'dp':>3}{'zero':>5}{'params':>9}{'peak':>9}{'grads':>9}{'peak':>9}{'optim':>9}"
          f"{'p peak1':>9}{'g peak1':>9}{'RS ms':>7}{'AG ms':>7}{'AR ms':>7}{'step ms':>9}"
          f"{'final loss':>11}  check (fraction of stage 0's)")  # fmt: skip
    for dp in args.dp:
        base = None
        for label in ("0", "1", "2", "3", "3k") if dp > 1 else ("0",):
            stage = int(label[0])
            cfg = TrainConfig(model="gpt", dp=dp, zero=stage, microbatches=4,
                              reshard_after_forward=False if label == "3k" else None,
                              micro_batch_size=32 // (4 * dp), steps=args.steps, lr=1e-3,
                              warmup_steps=2, quiet=True)  # fmt: skip
            metrics = run_ranks(_run, dp, cfg, timeout=3600)[0]
            last = metrics[-1]
            row = {k: last[k] for k in keys}
            row.update({f"first_{k}": metrics[0][k] for k in firsts})
            half = metrics[len(metrics) // 2 :]
            row["step_ms"] = statistics.median(m["step_ms"] for m in half)
            for kind in ("reduce_scatter", "all_gather", "all_reduce"):
                row[f"dp_ms_{kind}"] = statistics.median(m[f"dp_ms_{kind}"] for m in half)
            row["final_loss"] = last["loss"]
            base = base or row
            checks = []
            for key, frac in _expected(stage, dp).items() if stage else ():
                got = row[key] / base[key]
                ok = abs(got / frac - 1) <= 0.05
                failed += not ok
                checks.append(
                    f"{key.split('_')[0]} {got:.3f} (want {frac:.3f}) {'ok' if ok else 'MISS'}"
                )
            if stage == 3:  # step 1 (learning, laying out anew) held no more than the last
                first = row["first_param_peak_bytes"] / row["param_peak_bytes"]
                failed += first > 1.01
                checks.append(f"step 1 {first:.3f} of the last {'ok' if first <= 1.01 else 'MISS'}")
            runs.append({"dp": dp, "zero": label, **row, "checks": checks})
            print(
                f"  {dp:>3}{label:>5}{row['param_bytes'] / MB:>9.2f}"
                f"{row['param_peak_bytes'] / MB:>9.2f}{row['grad_bytes'] / MB:>9.2f}"
                f"{row['grad_peak_bytes'] / MB:>9.2f}{row['optim_bytes'] / MB:>9.2f}"
                + "".join(f"{row['first_' + k] / MB:>9.2f}" for k in firsts)
                + f"{row['dp_ms_reduce_scatter']:>7.1f}{row['dp_ms_all_gather']:>7.1f}"
                f"{row['dp_ms_all_reduce']:>7.1f}{row['step_ms']:>9.1f}{row['final_loss']:>11.4f}"
                f"  {'; '.join(checks)}"
            )
    print(f"# {'every check passed' if not failed else f'{failed} checks missed'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
