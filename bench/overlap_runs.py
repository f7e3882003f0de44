"""DataParallel's overlap on a model whose backward waits, as the median of
several whole runs of bench/data_parallel_bench.py (issue 25 §3: at least
70% on "wait8", in both ways of zeroing gradients). On a shared 2-core VM
one run's figure moves by +-10 points from run to run, so one run says
little; each run here is a fresh set of ranks, with the setups interleaved
as in that bench (best of --repeats rounds of --steps steps).

    python3 bench/overlap_runs.py --json bench/results/overlap_runs.json
"""

from __future__ import annotations

import argparse
import json
import statistics

from data_parallel_bench import _rank

from clawcomm.launch import run_ranks

SETUPS = ("dp-overlap", "dp-after", "dp-auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="wait8")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per run, best kept (3)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        result = run_ranks(
            _rank, 2, [args.model], args.steps, args.repeats, ["zero", "none"], SETUPS,
            timeout=3600,
        )[0][args.model]  # fmt: skip
        runs.append(result["modes"])
        cells = "  ".join(
            f"{mode}: {rows['dp-overlap']['overlap']:.0%} / auto {rows['dp-auto']['overlap']:.0%}"
            for mode, rows in result["modes"].items()
        )
        print(f"run {i + 1}: overlap {cells}", flush=True)
    summary = {}
    print(f"# {args.model}, 2 ranks: median over {args.runs} runs")
    print(f"# {'zero_grad':<10}{'setup':<12}{'overlap':>8}{'step ms':>9}{'runs (overlap)':>30}")
    for mode in ("zero", "none"):
        for setup in SETUPS:
            overlaps = [r[mode][setup]["overlap"] for r in runs]
            steps = [r[mode][setup]["step_ms"] for r in runs]
            summary.setdefault(mode, {})[setup] = {
                "overlap_median": statistics.median(overlaps),
                "step_ms_median": statistics.median(steps),
                "overlaps": overlaps,
                "choices": [r[mode][setup].get("choice") for r in runs],
            }
            each = " ".join(f"{o:.0%}" for o in overlaps)
            print(f"  {mode:<10}{setup:<12}{statistics.median(overlaps):>8.0%}"
                  f"{statistics.median(steps):>9.1f}   {each}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "runs": runs}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
