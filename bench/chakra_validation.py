"""The Chakra round trip against measured steps on namespace hosts: the GPT at
dp 2 x pp 2 (1f1b) on 2 hosts x 2 ranks with shaped links, dense and with
compressed data-parallel reduction, and the same layout with layers that
wait (as on an accelerator) instead of computing.

    python3 bench/chakra_validation.py --rate 1gbit --keep bench/results/chakra \\
        --json bench/results/chakra_validation.json | tee bench/results/chakra_validation.txt

Each run is ``clawcomm train --chakra DIR`` under torchrun on two network
namespaces (clawcomm.launch.netns) whose links are limited to --rate; its
last step becomes a Chakra trace (one file per rank), which
``clawcomm simulate --chakra DIR`` replays with the cost model calibrated
on the same links (--cost-model; bench/model_validation.py made the default one
at 1 Gbit/s). The replay is compared with the step the trace recorded and
with the run's median step (second half), then projected with every
data-parallel group over 64 and 512 hosts (weak scaling: the work per rank
as recorded). Pipeline stage 0 is host 0's two ranks, stage 1 host 1's: the
activations and their gradients cross the link, the data-parallel
reductions stay inside a host. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile

from clawcomm import chakra
from clawcomm.cost_model import CostModel
from clawcomm.launch.netns import Cluster, failed, unavailable
from clawcomm.simulate.replay import replay

RUNS = [
    ("dense", []),
    ("top-k 1%", ["--compression", "topk:0.01"]),
    # Layers that sleep as on an accelerator (4 ms each way per layer), with
    # 4 MiB of weights per layer: compute that leaves the cores to the
    # communication, and reductions that take longer.
    ("wait", ["--model", "wait", "--wait-width", "1024"]),
]
PROJECT = (64, 512)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="each host's link, tc syntax")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--cost-model", default="bench/results/model_validation/model.json")
    p.add_argument("--keep", metavar="DIR", help="copy each run's trace to DIR/<run>/")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"chakra_validation: {why}", file=sys.stderr)
        return 2
    model = CostModel.load(args.cost_model)
    work = tempfile.mkdtemp(prefix="clawcomm-chakra-")
    atexit.register(shutil.rmtree, work, True)  # (--keep copies what is worth keeping)
    rows = []
    print(f"# dp 2 x pp 2 (1f1b), 2 hosts x 2 ranks, links {args.rate}, {args.steps} steps; "
          f"cost model {args.cost_model}")  # fmt: skip
    head = f"# {'run':<10}{'measured':>10}{'median':>9}{'replayed':>10}{'error':>8}"
    print(head + "".join(f"{f'{h} hosts':>11}" for h in PROJECT) + "   (step, ms)")
    with Cluster(2, rate=args.rate) as cluster:
        for name, extra in RUNS:
            tag = name.split()[0].replace("-", "")
            folder, metrics = os.path.join(work, tag), os.path.join(work, f"{tag}.jsonl")
            train = ["-m", "clawcomm.train", "--model", "gpt", "--dp", "2", "--pp", "2",
                     "--schedule", "1f1b", "--steps", str(args.steps), "--quiet",
                     "--metrics", metrics, "--chakra", folder, *extra]  # fmt: skip
            runs = cluster.torchrun(train, 2, timeout=1800)
            if failed(runs):
                return 1
            steps = [m for m in map(json.loads, open(metrics)) if "loss" in m]
            last, median = (
                steps[-1]["step_ms"],
                statistics.median(m["step_ms"] for m in steps[len(steps) // 2 :]),
            )
            trace = chakra.read(folder)
            result = replay(trace, model)
            projected = {h: replay(trace, model, project_hosts=h).step * 1e3 for h in PROJECT}
            predicted = result.step * 1e3
            err = predicted / last - 1
            shares = {k: v * 1e3 for k, v in result.share().items()}
            rows.append(dict(run=name, measured_ms=last, median_ms=median, predicted_ms=predicted,
                             error=err, projected_ms=projected,
                             critical_path_ms=shares))  # fmt: skip
            print(f"  {name:<10}{last:>10.1f}{median:>9.1f}{predicted:>10.1f}{err:>+8.1%}"
                  + "".join(f"{projected[h]:>11.1f}" for h in PROJECT))  # fmt: skip
            if args.keep:
                dest = os.path.join(args.keep, tag)
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(folder, dest)
    for row in rows:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in row["critical_path_ms"].items() if v > 0.05)
        print(f"# {row['run']}: critical path (ms): {parts}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
