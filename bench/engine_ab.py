"""A/B timing of clawcomm's engine between two checkouts, in one run.

Used to show that a refactor costs nothing: each checkout (built in place)
times the same collectives on 2 local ranks through its own engine
(``clawcomm.engine_of()``, below torch's dispatch), alternating A, B, A, B,
and the best of every case is kept::

    git worktree add /tmp/base <commit> && (cd /tmp/base && python3 setup.py build_ext --inplace)
    python3 bench/engine_ab.py --a /tmp/base --b . --json bench/results/engine_ab.json

Cases: dense all-reduce (auto: tree below the crossover, ring above), the
bfloat16-wire all-reduce, all-gather; 8 B to 64 MiB per rank. Then the same
engine under torch: all-reduce through torch.distributed (the adapter), and
the median step of ``clawcomm train``'s MLP at dp 2 and at pp 2 (1f1b).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SIZES = [8, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _work(rank, n):
    import numpy as np

    import clawcomm

    eng = clawcomm.engine_of()
    out = {}
    for nbytes in SIZES:
        x = np.ones(max(1, nbytes // 4), np.float32)
        g = np.empty(x.size * n, np.float32)
        for name, fn in [
            ("all_reduce", lambda x=x: eng.all_reduce(x)),
            ("all_reduce bf16 wire", lambda x=x: eng.all_reduce_16bit_wire(x, "bfloat16")),
            ("all_gather", lambda x=x, g=g: eng.all_gather(x, g)),
        ]:
            iters = max(3, min(2000, (32 << 20) // nbytes))
            for _ in range(3):
                fn()
            best = float("inf")
            for _ in range(5):
                eng.barrier()
                t = time.perf_counter()
                for _ in range(iters):
                    fn()
                best = min(best, (time.perf_counter() - t) / iters)
            out[f"{name} {nbytes}"] = best
    out.update(_torch_cases())
    return out


def _torch_cases() -> dict[str, float]:
    """The same engine under torch: all-reduce through torch.distributed
    (the adapter), and the trainer's median step (mlp, dp 2 and pp 2)."""
    import statistics

    import torch
    import torch.distributed as dist

    out = {}
    for nbytes in (8, 64 << 10, 16 << 20):
        t = torch.ones(max(1, nbytes // 4))
        iters = max(3, min(2000, (32 << 20) // nbytes))
        best = float("inf")
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t)
            best = min(best, (time.perf_counter() - t0) / iters)
        out[f"torch all_reduce {nbytes}"] = best
    try:
        from clawcomm.train.models import build
    except ImportError:  # checkouts from before the trainer's split
        from clawcomm.train.cli import build
    from clawcomm.train.config import TrainConfig
    from clawcomm.train.data import global_batches
    from clawcomm.train.trainer import Trainer

    for layout in ({"dp": 2}, {"pp": 2, "schedule": "1f1b"}):
        cfg = TrainConfig(model="mlp", steps=40, microbatches=4, micro_batch_size=8,
                          quiet=True, **layout)  # fmt: skip
        model, loss, opt, ds, _, _ = build(cfg)
        trainer = Trainer(model, loss, opt, cfg)
        steps = trainer.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)
        trainer.close()
        name = "trainer step " + " ".join(f"{k}{v}" for k, v in layout.items() if k != "schedule")
        out[name] = statistics.median(m["step_ms"] for m in steps[10:]) / 1e3
    return out


def _child():
    from clawcomm.launch import run_ranks

    res = run_ranks(_work, 2, timeout=900)
    print(json.dumps({k: max(r[k] for r in res) for k in res[0]}))


def _run(checkout: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child"],
        env=env,
        cwd=os.path.abspath(checkout),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", help="baseline checkout (built in place)")
    p.add_argument("--b", help="checkout to compare (built in place)")
    p.add_argument("--rounds", type=int, default=2, help="A, B alternations (2)")
    p.add_argument("--json", help="write both sets of timings here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child()
        return
    if not (args.a and args.b):
        p.error("--a and --b are required")
    runs = {"a": [], "b": []}
    for _ in range(args.rounds):
        for side in ("a", "b"):
            runs[side].append(_run(getattr(args, side)))
    best = {s: {k: min(r[k] for r in runs[s]) for k in runs[s][0]} for s in runs}
    lines = [f"{'case':30s} {'A us':>10s} {'B us':>10s} {'B/A':>6s}"]
    for k in best["a"]:
        a, b = best["a"][k] * 1e6, best["b"][k] * 1e6
        lines.append(f"{k:30s} {a:10.1f} {b:10.1f} {b / a:6.2f}")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"a": args.a, "b": args.b, "best_seconds": best, "table": lines}, f, indent=1)


if __name__ == "__main__":
    main()
