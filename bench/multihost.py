"""All-reduce across namespace hosts with shaped links: the flat ring
against the hierarchical all-reduce (and gloo), as nccl-tests tables.

    python3 bench/multihost.py --hosts 2 --ranks-per-host 2 --rate 1gbit \\
        --json bench/results/multihost_2x2_1gbit.json

Each host is a network namespace (clawcomm.launch.netns) whose link is limited to
--rate in each direction; each runs its ranks under torchrun, which runs
``clawcomm bench``. Needs root and iproute2. The printed summary compares
the hierarchical all-reduce's speed-up over the flat ring with its
byte-count bound: per host link, the ring moves 2(n-1)/n N and the
hierarchical all-reduce 2(m-1)/m N (n ranks, m hosts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from clawcomm.launch.netns import Cluster, failed, unavailable


def bound(hosts: int, per_host: int) -> float:
    n = hosts * per_host
    return (2 * (n - 1) / n) / (2 * (hosts - 1) / hosts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="each host's link, tc syntax ('none': unshaped)")
    p.add_argument("-b", "--minbytes", default="1M")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", default="4")
    p.add_argument("--algo", default="ring,hierarchical,auto")
    p.add_argument("-o", "--op", default="all_reduce", help="collectives (clawcomm bench -o)")
    p.add_argument("--skew", default="1", help="all_to_allv's (clawcomm bench --skew)")
    p.add_argument("--compare", default="gloo", help="'' for none")
    p.add_argument("--repeats", default="2")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", metavar="FILE", help="write the bench's records here")
    p.add_argument("--plot", metavar="FILE")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"multihost: {why}", file=sys.stderr)
        return 2
    out = args.json or os.path.join(tempfile.mkdtemp(prefix="clawcomm-multihost-"), "bench.json")
    out = os.path.abspath(out)
    bench = ["-m", "clawcomm.cli", "bench", "-b", args.minbytes, "-e", args.maxbytes,
             "-f", args.stepfactor, "-w", "1", "--repeats", args.repeats, "--algo", args.algo,
             "-o", args.op, "--skew", args.skew,
             "--json", out, "--quiet"]  # fmt: skip
    if args.compare:
        bench += ["--compare", args.compare]
    if args.plot:
        bench += ["--plot", os.path.abspath(args.plot)]
    rate = None if args.rate == "none" else args.rate
    with Cluster(args.hosts, rate=rate) as cluster:
        runs = cluster.torchrun(bench, args.ranks_per_host, timeout=args.timeout)
    if failed(runs):
        return 1
    print(runs[0].output.split("*" * 41)[-1].strip())
    summarize(out, args.hosts, args.ranks_per_host, args.rate)
    return 0


def summarize(path: str, hosts: int, per_host: int, rate: str) -> None:
    with open(path) as f:
        records = json.load(f)["records"]
    by = {(r["variant"], r["size"]): r for r in records if "time_us" in r}
    if not any(v == "clawcomm/ring" for v, _ in by):
        return  # other variants (the all-to-all's): the table above says it
    b = bound(hosts, per_host)
    print(f"\n{hosts} hosts x {per_host} ranks, links {rate}: hierarchical over ring "
          f"(bound {b:.2f}x, target 90% = {0.9 * b:.2f}x)")  # fmt: skip
    for size in sorted({s for _, s in by}):
        ring, hier = by.get(("clawcomm/ring", size)), by.get(("clawcomm/hierarchical", size))
        if ring and hier:
            speedup = ring["time_us"] / hier["time_us"]
            ring_ms, hier_ms = ring["time_us"] / 1e3, hier["time_us"] / 1e3
            print(f"  {size:>12} B  ring {ring_ms:9.1f} ms  hierarchical {hier_ms:9.1f} ms  "
                  f"{speedup:.2f}x = {speedup / b:.0%} of the bound")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
