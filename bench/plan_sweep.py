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
``+wire`` scenario also searches the gradients' wire (none, bf16, int8,
topk:0.01, powersgd:4: ``clawcomm plan --search-compression``), a ``+sync`` one the
sync method (every-step, local-sgd:8: ``--search-sync``).

Each layout is measured ``--rounds`` times, the layouts in turn, and its
figure is the median (``clawcomm.plan.check.measure_rounds``); the rounds' agreement
with one another (Spearman between rounds) is printed beside the plan's, as
the most any prediction can show on this machine, and so is how many of
the pairs of layouts the rounds tell apart (one's range below the
other's: ``clawcomm.plan.check.separated``) the plan orders the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from clawcomm.plan import search as plan
from clawcomm.plan.check import (
    grid,
    measure_rounds,
    namespace_cores,
    on_hosts,
    pairs_right,
    retest,
    shapes,
    spearman,
    table,
)
from clawcomm.train.config import TrainConfig

SCENARIOS = ["gpt-2", "gpt-4", "wait-4", "gpt-4@2x1gbit", "wait-4@2x1gbit"]


WIRES = ["none", "bf16", "int8", "topk:0.01", "powersgd:4"]
SYNCS = ["every-step", "local-sgd:8"]


def parse(name: str) -> tuple[str, int, int, str | None]:
    """'gpt-4@2x1gbit+wire' -> ('gpt', 4 ranks, 2 hosts, '1gbit')."""
    head, _, where = name.partition("+")[0].partition("@")
    model, _, ranks = head.partition("-")
    hosts, rate = 1, None
    if where:
        h, _, rate = where.partition("x")
        hosts = int(h)
    return model, int(ranks), hosts, rate or None


def run_scenario(name: str, args, progress) -> dict:
    model, world, hosts, rate = parse(name)
    cfg = TrainConfig(model=model, global_batch=args.global_batch, quiet=True)
    cores = namespace_cores(hosts)
    t0 = time.perf_counter()
    extras = name.split("+")[1:]
    preds, _, _ = plan.plan(cfg, world, cores=cores, cost=plan.cost_model(None, rate), hosts=hosts,
                            compressions=WIRES if "wire" in extras else None,
                            syncs=SYNCS if "sync" in extras else None,
                            trial_on_hosts=hosts > 1, link=rate)  # fmt: skip
    plan_s = time.perf_counter() - t0
    chosen = grid(preds, args.grid) if args.grid else shapes(preds, args.layouts)
    if len(chosen) != args.layouts:  # the grid's size is the plan's to say
        progress.total += (len(chosen) - args.layouts) * args.rounds
        progress.refresh()
    if hosts == 1:
        runs = measure_rounds(cfg, chosen, args.steps, world, args.rounds, None, progress)
    else:
        with on_hosts(hosts, rate, world, args.timeout) as launch:
            runs = measure_rounds(cfg, chosen, args.steps, world, args.rounds, launch, progress)
    rows = list(zip(chosen, runs, strict=True))
    measured = [statistics.median(r) for r in runs]
    first_ratio = measured[0] / min(measured)
    rho = spearman([p.step_ms for p in chosen], measured)
    self_rho = retest(runs) if args.rounds > 1 else None
    right, told = pairs_right([p.step_ms for p in chosen], runs)
    which = f"; the plan's first and its grid at {args.grid} micro-batches" if args.grid else ""
    links = f", links {rate}" if rate else ""
    print(f"# {name}: {model}, {world} ranks on {hosts} host(s){links}; planned in {plan_s:.1f} s"
          + which)  # fmt: skip
    print(table(rows), flush=True)
    return {
        "scenario": name, "model": model, "ranks": world, "hosts": hosts, "link": rate,
        "plan_s": plan_s, "grid": args.grid, "first_over_fastest": first_ratio, "spearman": rho,
        "spearman_between_rounds": self_rho, "pairs_told_apart": told, "pairs_plan_right": right,
        "layouts": [{"layout": p.cand.name(), "flags": p.cand.flags(), "predicted_ms": p.step_ms,
                     "measured_ms": m, "rounds_ms": r}
                    for p, m, r in zip(chosen, measured, runs, strict=True)],
    }  # fmt: skip


def rescore(r: dict) -> dict:
    """A stored scenario with the figures its rounds give counted anew (a
    sweep stored before ``pairs_right``)."""
    runs = [lay["rounds_ms"] for lay in r["layouts"]]
    right, told = pairs_right([lay["predicted_ms"] for lay in r["layouts"]], runs)
    return {**r, "pairs_told_apart": told, "pairs_plan_right": right}


def summary(results: list[dict]) -> None:
    """The sweep's table of scenarios, and the issue's targets counted."""
    within = sum(r["first_over_fastest"] <= 1.10 for r in results)
    print(f"# {'scenario':<22} {'first / fastest':>15} {'Spearman':>9} {'rounds':>7} "
          f"{'pairs right':>11} {'plan s':>7}")  # fmt: skip
    for r in results:
        own = r["spearman_between_rounds"]
        pairs = f"{r['pairs_plan_right']}/{r['pairs_told_apart']}"
        print(f"  {r['scenario']:<22} {r['first_over_fastest']:15.2f} {r['spearman']:9.2f} "
              f"{'-' if own is None else format(own, '.2f'):>7} {pairs:>11} "
              f"{r['plan_s']:7.1f}")  # fmt: skip
    right = sum(r["pairs_plan_right"] for r in results)
    told = sum(r["pairs_told_apart"] for r in results)
    print(
        f"# first choice within 10% of the fastest measured: {within} of {len(results)}; "
        f"Spearman >= 0.8: {sum(r['spearman'] >= 0.8 for r in results)} of {len(results)}; "
        f"of the pairs of layouts the rounds tell apart, the plan orders {right} of {told} "
        "the same way"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="MODEL-RANKS[@HOSTSxRATE], comma-separated")  # fmt: skip
    p.add_argument("--layouts", type=int, default=8, help="layouts measured per scenario (8)")
    p.add_argument("--grid", type=int, default=0, metavar="M",
                   help="measure the trainer's layout sweep instead of the plan's picks: the "
                        "plan's first, then every dp x pp and schedule at M micro-batches, no "
                        "ZeRO (bench/train_bench.py's layouts at M = 4)")  # fmt: skip
    p.add_argument("--steps", type=int, default=40, help="steps per layout and round (40)")
    p.add_argument("--rounds", type=int, default=3,
                   help="measurements of each layout, the layouts in turn (3)")  # fmt: skip
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--rescore", metavar="FILE",
                   help="measure nothing: a stored sweep's --json summed up anew")  # fmt: skip
    args = p.parse_args(argv)
    if args.rescore:
        with open(args.rescore) as f:
            summary([rescore(r) for r in json.load(f)["scenarios"]])
        return 0
    names = args.scenarios.split(",")
    if any(parse(n)[2] > 1 for n in names):
        from clawcomm.launch.netns import unavailable

        why = unavailable()
        if why:
            print(f"plan_sweep: namespace hosts: {why}; run single-host scenarios only")
            return 2
    from tqdm import tqdm

    results = []
    total = len(names) * args.layouts * args.rounds
    with tqdm(total=total, unit="layout", file=sys.stderr) as progress:
        for name in names:
            results.append(run_scenario(name, args, progress))
    summary(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "scenarios": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
