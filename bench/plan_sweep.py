"""The planner against measurement: for each scenario (a model on a world
of ranks, on one host or on namespace hosts with shaped links), plan, then
train the plan's first layout and the best-predicted layout of every other
shape (dp, pp, schedule) for a few steps each, and report how the first
choice compares with the fastest measured and how the predicted order
agrees with the measured one (Spearman). issue 29's targets: the first
within 10% of the fastest in at least 90% of scenarios, Spearman >= 0.8,
planning under 15 s.

    python3 bench/plan_sweep.py --json bench/results/plan_sweep.json \\
        | tee bench/results/plan_sweep.txt
    python3 bench/plan_sweep.py --scenarios gpt-4,wait-4 --steps 12

The GPT computes on the CPU; the waiting model's layers sleep as layers on
an accelerator would (docs/trainer.md), so on 2 cores only the GPT's ranks
fight for cores. Namespace-host scenarios (``@2x1gbit``: 2 hosts, links
shaped to 1 Gbit/s) need root and iproute2; their hosts share this
machine's cores, so the plan is told each host has cores / hosts. A
``+wire`` scenario also searches the gradients' wire (none, bf16, int8:
``clawcomm plan --search-compression``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from clawcomm.train import plan
from clawcomm.train.config import TrainConfig
from clawcomm.train.plan_check import measure, shapes, spearman, table

SCENARIOS = ["gpt-2", "gpt-4", "wait-4", "gpt-4@2x1gbit", "wait-4@2x1gbit"]


WIRES = ["none", "bf16", "int8"]


def parse(name: str) -> tuple[str, int, int, str | None]:
    """'gpt-4@2x1gbit+wire' -> ('gpt', 4 ranks, 2 hosts, '1gbit')."""
    head, _, where = name.removesuffix("+wire").partition("@")
    model, _, ranks = head.partition("-")
    hosts, rate = 1, None
    if where:
        h, _, rate = where.partition("x")
        hosts = int(h)
    return model, int(ranks), hosts, rate or None


def run_scenario(name: str, args, progress) -> dict:
    model, world, hosts, rate = parse(name)
    cfg = TrainConfig(model=model, global_batch=args.global_batch, quiet=True)
    cores = max(1, (os.cpu_count() or 1) // hosts)
    t0 = time.perf_counter()
    wires = WIRES if name.endswith("+wire") else None
    preds, _, _ = plan.plan(cfg, world, cores=cores, cost=plan.cost_model(None, rate), hosts=hosts,
                            compressions=wires)  # fmt: skip
    plan_s = time.perf_counter() - t0
    chosen = shapes(preds, args.layouts)
    rows = []
    if hosts == 1:
        for p in chosen:
            rows.append((p, measure(cfg, p.cand, args.steps, world)))
            progress.update()
    else:
        from clawcomm.testing.netns import Cluster, failed

        with Cluster(hosts, rate=rate) as cluster:

            def launch(train_args):
                runs = cluster.torchrun(["-m", "clawcomm.train", *train_args], world // hosts,
                                        timeout=args.timeout)  # fmt: skip
                if failed(runs):
                    raise RuntimeError(f"{name}: a host failed")

            for p in chosen:
                rows.append((p, measure(cfg, p.cand, args.steps, world, launch)))
                progress.update()
    measured = [m for _, m in rows]
    first_ratio = measured[0] / min(measured)
    rho = spearman([p.step_ms for p, _ in rows], measured)
    print(f"# {name}: {model}, {world} ranks on {hosts} host(s)"
          + (f", links {rate}" if rate else "") + f"; planned in {plan_s:.1f} s")  # fmt: skip
    print(table(rows), flush=True)
    return {
        "scenario": name, "model": model, "ranks": world, "hosts": hosts, "link": rate,
        "plan_s": plan_s, "first_over_fastest": first_ratio, "spearman": rho,
        "layouts": [{"layout": p.cand.name(), "flags": p.cand.flags(), "predicted_ms": p.step_ms,
                     "measured_ms": m} for p, m in rows],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="MODEL-RANKS[@HOSTSxRATE], comma-separated")  # fmt: skip
    p.add_argument("--layouts", type=int, default=8, help="layouts measured per scenario (8)")
    p.add_argument("--steps", type=int, default=20, help="steps per layout (20)")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    names = args.scenarios.split(",")
    if any(parse(n)[2] > 1 for n in names):
        from clawcomm.testing.netns import unavailable

        why = unavailable()
        if why:
            print(f"plan_sweep: namespace hosts: {why}; run single-host scenarios only")
            return 2
    from tqdm import tqdm

    results = []
    with tqdm(total=len(names) * args.layouts, unit="layout", file=sys.stderr) as progress:
        for name in names:
            results.append(run_scenario(name, args, progress))
    within = sum(r["first_over_fastest"] <= 1.10 for r in results)
    print(f"# {'scenario':<18} {'first / fastest':>15} {'Spearman':>9} {'plan s':>7}")
    for r in results:
        print(f"  {r['scenario']:<18} {r['first_over_fastest']:15.2f} {r['spearman']:9.2f} "
              f"{r['plan_s']:7.1f}")  # fmt: skip
    print(
        f"# first choice within 10% of the fastest measured: {within} of {len(results)}; "
        f"Spearman >= 0.8: {sum(r['spearman'] >= 0.8 for r in results)} of {len(results)}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "scenarios": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
