"""How long a pipeline's handoffs take, with the pipeline group's progress
thread at nice 0 (the trainer's default) against 10 (every group's with
``CLAWCOMM_PROGRESS_NICE=10``).

    python3 bench/pipeline_handoffs.py --json bench/results/pipeline_handoffs.json \\
        | tee bench/results/pipeline_handoffs.txt

Each pair runs ``clawcomm train`` with ``--trace``, nice 10 then nice 0, the
pairs interleaved so that the machine's drift touches both alike. A
handoff on the critical path: a stage's F (or B / I) of a micro-batch
starts after the previous stage's F (the next stage's B / I) of it ended
and after this rank's own previous pass; its latency is the time from the
producer's end to the consumer's start. Steps from the first third on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from clawcomm.bench.report import write_json

LAYOUT = "--model gpt --dp 1 --pp 4 --schedule zb1 --microbatches 8 --micro-batch-size 4"


def handoffs(trace: dict, first_step: int) -> dict[str, list[float]]:
    """Milliseconds of each critical-path handoff, forward and backward."""
    events = trace["traceEvents"]
    steps: dict[int, list[tuple[float, float, int]]] = {}
    for e in events:
        if e.get("ph") == "X" and e["name"].startswith("step "):
            steps.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"], int(e["name"][5:])))
    passes, by_rank = {}, {}
    for e in events:
        m = re.fullmatch(r"([FBI])(\d+) s(\d+)", e.get("name", ""))
        if e.get("ph") != "X" or e.get("cat") != "compute" or not m:
            continue
        step = next((n for a, b, n in steps[e["pid"]] if a <= e["ts"] <= b), None)
        if step is None or step < first_step:
            continue
        passes[(step, m[1], int(m[2]), int(m[3]))] = e
        by_rank.setdefault((e["pid"], step), []).append(e)
    for v in by_rank.values():
        v.sort(key=lambda e: e["ts"])
    out: dict[str, list[float]] = {"F": [], "B": []}
    for (step, kind, mb, s), e in passes.items():
        if kind == "F":
            producer = passes.get((step, "F", mb, s - 1))
        else:  # B or zero-bubble's I: the next stage's input gradient
            producer = passes.get((step, "B", mb, s + 1)) or passes.get((step, "I", mb, s + 1))
        if producer is None:
            continue
        mine = by_rank[(e["pid"], step)]
        i = mine.index(e)
        free = mine[i - 1]["ts"] + mine[i - 1]["dur"] if i else 0.0
        ready = producer["ts"] + producer["dur"]
        if ready >= free:  # the rank waited for this handoff
            out["F" if kind == "F" else "B"].append((e["ts"] - ready) / 1e3)
    return out


def run(nice: int, layout: str, steps: int, nproc: int) -> dict:
    env = dict(os.environ, CLAWCOMM_PROGRESS_NICE=str(nice))
    if nice == 0:
        env.pop("CLAWCOMM_PROGRESS_NICE")  # the trainer's default: its pipeline groups at 0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        cmd = [sys.executable, "-m", "clawcomm.train", "--nproc", str(nproc), *layout.split(),
               "--steps", str(steps), "--trace", path]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        step = re.search(r"median of the second half: step ([0-9.]+) ms", done.stdout + done.stderr)
        with open(path) as f:
            gaps = handoffs(json.load(f), steps // 3)
    return {"nice": nice, "step_ms": float(step[1]) if step else None,
            **{f"{k}_mean_ms": statistics.mean(v) for k, v in gaps.items() if v},
            **{f"{k}_median_ms": statistics.median(v) for k, v in gaps.items() if v},
            "handoffs": sum(map(len, gaps.values()))}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layout", default=LAYOUT, help="clawcomm train's flags for the layout")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--json", help="write the runs here")
    args = p.parse_args()
    rows = []
    print(f"# clawcomm train --nproc {args.nproc} {args.layout} --steps {args.steps}")
    print(f"# {'nice':>4} {'step ms':>8} {'F mean':>7} {'F med':>6} {'B mean':>7} {'B med':>6}")
    for _ in range(args.pairs):
        for nice in (10, 0):
            r = run(nice, args.layout, args.steps, args.nproc)
            rows.append(r)
            print(f"  {nice:>4} {r['step_ms']:8.1f} {r.get('F_mean_ms', 0):7.2f} "
                  f"{r.get('F_median_ms', 0):6.2f} {r.get('B_mean_ms', 0):7.2f} "
                  f"{r.get('B_median_ms', 0):6.2f}", flush=True)  # fmt: skip
    for nice in (10, 0):
        mine = [r for r in rows if r["nice"] == nice]
        print(f"# nice {nice:>2}: step {statistics.median(r['step_ms'] for r in mine):.1f} ms, "
              f"handoff F {statistics.median(r['F_mean_ms'] for r in mine):.2f} ms, "
              f"B {statistics.median(r['B_mean_ms'] for r in mine):.2f} ms "
              "(medians of the runs' means)")  # fmt: skip
    if args.json:
        write_json(args.json, {"args": vars(args), "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
