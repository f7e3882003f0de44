"""The cost model against measured times on namespace hosts with shaped links.

    python3 bench/model_validation.py --rate 1gbit --out bench/results/model_validation

1. Calibrates the model's building blocks on 2 hosts x 2 ranks
   (``clawcomm bench --calibrate``: ping-pong over shared memory and over
   the shaped link, the reduction kernel) -> OUT/model.json.
2. Measures every collective and all-reduce algorithm with ``clawcomm
   bench`` on 2 hosts x 2 ranks, 4 x 2 and 8 x 1 -> OUT/measured_<h>x<k>.json.
3. Predicts each measured point with clawcomm.cost_model (and the event
   simulator) and prints the table and the geometric-mean error: the
   geometric mean over points of max(pred/meas, meas/pred), minus 1.

Needs root and iproute2 (clawcomm.launch.netns). About 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from clawcomm.cost_model import ALGORITHMS, CostModel, Topology, choose, predict
from clawcomm.launch.netns import Cluster, unavailable
from clawcomm.simulate.messages import simulate

LAYOUTS = [(2, 2), (4, 2), (8, 1)]
OPS = "all_reduce,all_gather,reduce_scatter,broadcast"


def _torchrun(hosts, per_host, rate, argv, timeout=1200):
    with Cluster(hosts, rate=rate) as cluster:
        runs = cluster.torchrun(argv, per_host, timeout=timeout)
    for r in runs:
        if r.returncode != 0:
            raise RuntimeError(f"host {r.host} exited with {r.returncode}:\n{r.output[-3000:]}")
    return runs


def measure(out: str, rate: str, sizes: tuple[str, str]) -> None:
    os.makedirs(out, exist_ok=True)
    model_path = os.path.join(out, "model.json")
    if not os.path.exists(model_path):
        print("calibrating on 2 hosts x 2 ranks ...", flush=True)
        runs = _torchrun(2, 2, rate, ["-m", "clawcomm.cli", "bench", "--calibrate", model_path])
        print(runs[0].output.strip().splitlines()[-4:])
    for hosts, per_host in LAYOUTS:
        path = os.path.join(out, f"measured_{hosts}x{per_host}.json")
        if os.path.exists(path):
            continue
        algos = "ring,tree,hierarchical" if per_host > 1 else "ring,tree"
        print(f"measuring {hosts} x {per_host} ...", flush=True)
        _torchrun(hosts, per_host, rate,
                  ["-m", "clawcomm.cli", "bench", "-o", OPS, "--algo", algos, "-b", sizes[0],
                   "-e", sizes[1], "-f", "4", "-w", "1", "--repeats", "2", "--quiet",
                   "--json", path])  # fmt: skip


def ran(collective: str, name: str, size: int, topology: Topology) -> str:
    """The algorithm a run with CLAWCOMM_ALGO=name ran (csrc/algorithms/
    selection.cc): the one it names if the collective has it and the topology
    can run it (else the ring), otherwise auto's pick by the engine's
    built-in model (these runs set no CLAWCOMM_COST_MODEL)."""
    if name in ALGORITHMS[collective]:
        if predict(collective, name, size, topology, CostModel()) == math.inf:
            return "ring"
        return name
    return choose(collective, size, topology, CostModel())


def compare(out: str) -> tuple[str, float, float]:
    from clawcomm.simulate.messages import simulates

    model = CostModel.load(os.path.join(out, "model.json"))
    lines = [f"{'topology':>6} {'collective':>15} {'algorithm':>17} {'size':>10} {'measured':>11} "
             f"{'model':>11} {'simulated':>11} {'error':>7}"]  # fmt: skip
    logs, sim_logs, by_topology = [], [], {}
    for hosts, per_host in LAYOUTS:
        with open(os.path.join(out, f"measured_{hosts}x{per_host}.json")) as f:
            records = json.load(f)["records"]
        topology = Topology(hosts, per_host)
        mine = by_topology.setdefault(f"{hosts} x {per_host}", [])
        for r in records:
            if "time_us" not in r:
                continue
            coll = r["collective"]
            algo = ran(coll, r["variant"].split("/")[-1], r["size"], topology)
            measured = r["time_us"] / 1e6
            predicted = predict(coll, algo, r["size"], topology, model)
            err = max(predicted / measured, measured / predicted) - 1
            logs.append(math.log1p(err))
            mine.append(math.log1p(err))
            sim = "-"
            if simulates(coll, algo):
                simulated = simulate(coll, algo, r["size"], topology, model)
                sim_logs.append(math.log(max(simulated / measured, measured / simulated)))
                sim = f"{simulated * 1e3:.2f}ms"
            lines.append(f"{hosts}x{per_host:<4} {coll:>15} {algo:>17} {r['size']:>10} "
                         f"{measured * 1e3:>9.2f}ms {predicted * 1e3:>9.2f}ms "
                         f"{sim:>11} {err:>6.1%}")  # fmt: skip
    geo = math.exp(sum(logs) / len(logs)) - 1
    sim_geo = math.exp(sum(sim_logs) / len(sim_logs)) - 1
    for name, v in by_topology.items():
        lines.append(f"# {name}: geometric-mean error over {len(v)} points: "
                     f"{math.exp(sum(v) / len(v)) - 1:.1%}")  # fmt: skip
    lines.append(f"# geometric-mean error over {len(logs)} points: model {geo:.1%}, "
                 f"event simulator {sim_geo:.1%} (its {len(sim_logs)} points)")  # fmt: skip
    return "\n".join(lines), geo, sim_geo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--out", default="bench/results/model_validation")
    p.add_argument("-b", "--minbytes", default="256K")
    p.add_argument("-e", "--maxbytes", default="16M")
    p.add_argument("--compare-only", action="store_true", help="reuse the measured files")
    args = p.parse_args(argv)
    if not args.compare_only:
        why = unavailable()
        if why:
            print(f"model_validation: {why}", file=sys.stderr)
            return 2
        measure(args.out, args.rate, (args.minbytes, args.maxbytes))
    text, _, _ = compare(args.out)
    print(text)
    with open(os.path.join(args.out, "comparison.txt"), "w") as f:
        f.write(f"# python3 bench/model_validation.py --rate {args.rate} --out {args.out}\n")
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
