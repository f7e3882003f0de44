"""What the flight recorder costs: an 8-byte all-reduce on 2 local ranks with
recording on (the default, CLAWCOMM_RECORDER_ENTRIES=1024) and off (0),
alternating on/off runs, best of each; through torch.distributed and through
the raw engine (numpy, below torch's dispatch), where the fixed cost is
smallest and any added cost shows most::

    python3 bench/recorder_bench.py --json bench/results/recorder.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _time(rank, n, iters):
    import numpy as np
    import torch
    import torch.distributed as dist

    import clawcomm

    eng = clawcomm.engine_of()
    t, a = torch.ones(2), np.ones(2, np.float32)
    out = {}
    for name, fn in (("torch", lambda: dist.all_reduce(t)), ("engine", lambda: eng.all_reduce(a))):
        for _ in range(1000):
            fn()
        best = float("inf")
        for _ in range(5):
            eng.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            best = min(best, (time.perf_counter() - t0) / iters)
        out[name] = best
    return out


def main() -> int:
    from clawcomm.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--iters", type=int, default=20000)
    p.add_argument("--json")
    args = p.parse_args()
    best = {"on": {}, "off": {}}
    for _ in range(args.rounds):
        for state, entries in (("on", "1024"), ("off", "0")):
            res = run_ranks(
                _time, 2, args.iters, env={"CLAWCOMM_RECORDER_ENTRIES": entries}, timeout=600
            )
            for k in res[0]:
                v = max(r[k] for r in res)
                best[state][k] = min(best[state].get(k, float("inf")), v)
    lines = []
    for k in ("torch", "engine"):
        on, off = best["on"][k] * 1e6, best["off"][k] * 1e6
        lines.append(
            f"8-byte all-reduce via {k}: {off:.3f} us without recording, {on:.3f} us with: "
            f"{(on - off) / off:+.1%}"
        )
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"command": " ".join(sys.argv), "best_seconds": best, "table": lines}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
