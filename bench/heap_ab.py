"""What keeping the heap buys a CPU rank (``clawcomm train --keep-heap``, the
default) against glibc's default malloc (``--no-keep-heap``): the GPT's
step in each layout, both ways, in interleaved pairs so that the machine's
drift touches both alike.

    python3 bench/heap_ab.py --json bench/results/heap_ab.json | tee bench/results/heap_ab.txt

Each run is ``clawcomm train`` for --steps steps (its figure: the median
step of the second half) and its page faults, from its process tree's
``ru_minflt`` (the ranks, their launcher and the start-up: every run
imports torch alike). A layout's ratio is the median over the pairs of
kept / default.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import sys

from clawcomm.bench.report import write_json
from clawcomm.plan.check import measure
from clawcomm.plan.search import Candidate
from clawcomm.train.config import TrainConfig

LAYOUTS = [  # world, then dp, pp, schedule, v, micro-batches, micro-batch size, ZeRO
    (2, Candidate(2, 1, "1f1b", 1, 1, 16, 0)),
    (2, Candidate(1, 2, "gpipe", 1, 4, 8, 0)),
    (2, Candidate(1, 2, "1f1b", 1, 4, 8, 0)),
    (2, Candidate(1, 2, "zb1", 1, 4, 8, 0)),
    (2, Candidate(1, 2, "interleaved", 2, 4, 8, 0)),
    (4, Candidate(4, 1, "1f1b", 1, 1, 8, 2)),
    (4, Candidate(1, 4, "gpipe", 1, 8, 4, 0)),
    (4, Candidate(1, 4, "zb1", 1, 4, 8, 0)),
]


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt


def run(cfg, cand, steps: int, world: int) -> tuple[float, int]:
    before = faults()
    ms = measure(cfg, cand, steps, world)
    return ms, faults() - before


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pairs", type=int, default=5, help="kept/default pairs per layout (5)")
    p.add_argument("--steps", type=int, default=40, help="steps a run (40)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    from tqdm import tqdm

    base = TrainConfig(model="gpt", global_batch=32, quiet=True)
    rows = []
    print(f"# {'layout':<34} {'ranks':>5} {'kept ms':>8} {'default ms':>10} {'ratio':>6} "
          f"{'faults kept':>11} {'default':>8}")  # fmt: skip
    with tqdm(total=len(LAYOUTS) * args.pairs * 2, unit="run", file=sys.stderr) as bar:
        for world, cand in LAYOUTS:
            runs = {True: [], False: []}
            for _ in range(args.pairs):
                for keep in (True, False):
                    cfg = dataclasses.replace(base, keep_heap=keep)
                    runs[keep].append(run(cfg, cand, args.steps, world))
                    bar.update()
            pairs = list(zip(runs[True], runs[False], strict=True))
            ratio = statistics.median(k[0] / d[0] for k, d in pairs)
            med = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
            flt = {k: statistics.median(r[1] for r in v) for k, v in runs.items()}
            rows.append({"layout": cand.name(), "ranks": world, "ratio": ratio,
                         "kept_ms": med[True], "default_ms": med[False],
                         "kept_faults": flt[True], "default_faults": flt[False],
                         "pairs_ms": [[k[0], d[0]] for k, d in pairs]})  # fmt: skip
            tqdm.write(f"  {cand.name():<34} {world:>5} {med[True]:8.1f} {med[False]:10.1f} "
                       f"{ratio:6.3f} {flt[True]:11.0f} {flt[False]:8.0f}")  # fmt: skip
    print(f"# kept / default, median over layouts: "
          f"{statistics.median(r['ratio'] for r in rows):.3f}")  # fmt: skip
    if args.json:
        write_json(args.json, {"args": vars(args), "layouts": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
