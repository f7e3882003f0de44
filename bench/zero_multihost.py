"""ZeRO-2 across namespace hosts with shaped links: dense against int8
gradients and int8 parameters (ZeRO++'s qgZ and qwZ), the GPT at dp 4 on
2 hosts x 2 ranks, same seed and batches.

    python3 bench/zero_multihost.py --steps 300 --rate 1gbit \\
        --json bench/results/zero_multihost.json | tee bench/results/zero_multihost.txt

Each host is a network namespace (clawcomm.launch.netns) whose link is
limited to --rate in each direction; its ranks run ``clawcomm train`` under
torchrun. Bytes across hosts are what the hosts' links sent (the kernel's
counters: everything, rendezvous and setup included), per step; the step
time is the median of the second half; the loss is the last step's. Needs
root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from clawcomm.launch.netns import Cluster, failed, unavailable

RUNS = [
    ("dense", []),
    ("int8 gradients + int8 parameters", ["--compression", "int8", "--param-compression", "int8"]),
]


def _sent(cluster: Cluster, host: int) -> int:
    """Bytes the host's link has sent."""
    counter = "/sys/class/net/eth0/statistics/tx_bytes"
    out = subprocess.run(
        ["ip", "netns", "exec", cluster.names[host], "cat", counter],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rate", default="1gbit", help="each host's link, tc syntax")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"zero_multihost: {why}", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="clawcomm-zero-multihost-")
    rows = []
    print(f"# GPT 0.81M, dp 4 = 2 hosts x 2 ranks, links {args.rate}, --zero 2, {args.steps} steps")
    print(f"# {'run':<34}{'final loss':>11}{'step ms':>9}{'MB/step across hosts':>22}")
    with Cluster(2, rate=args.rate) as cluster:
        for name, extra in RUNS:
            metrics = os.path.join(work, f"{len(rows)}.jsonl")
            before = sum(_sent(cluster, h) for h in range(2))
            train = ["-m", "clawcomm.train", "--model", "gpt", "--dp", "4", "--zero", "2",
                     "--steps", str(args.steps), "--quiet", "--metrics", metrics,
                     *extra]  # fmt: skip
            runs = cluster.torchrun(train, 2, timeout=args.timeout)
            if failed(runs):
                return 1
            across = (sum(_sent(cluster, h) for h in range(2)) - before) / args.steps
            steps = [m for m in map(json.loads, open(metrics)) if "loss" in m]
            step_ms = statistics.median(m["step_ms"] for m in steps[len(steps) // 2 :])
            row = dict(run=name, final_loss=steps[-1]["loss"], step_ms=step_ms,
                       across_bytes_per_step=across, losses=[m["loss"] for m in steps])  # fmt: skip
            rows.append(row)
            print(f"  {name:<34}{row['final_loss']:>11.4f}{step_ms:>9.1f}{across / 1e6:>22.2f}")
    dense, small = rows
    print(f"# int8: {dense['across_bytes_per_step'] / small['across_bytes_per_step']:.2f}x fewer "
          f"bytes across hosts, {dense['step_ms'] / small['step_ms']:.2f}x the step rate, loss "
          f"{(small['final_loss'] / dense['final_loss'] - 1) * 100:+.2f}%")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
