"""Recovery from a killed rank: torchrun restarts the group and the job
resumes from its last checkpoint, ending with the uninterrupted run's loss.

    python3 examples/recovery.py                   # GPT, 4 local ranks, dp 2 x pp 2
    python3 examples/recovery.py --layout 2x1 --zero 3 --model mlp
    python3 examples/recovery.py --model mlp --steps 16 --kill-at-step 7

1. The uninterrupted job: ``clawcomm train`` on spawned ranks.
2. The same job under ``torchrun --max-restarts 1``, with a checkpoint every
   ``--every`` steps, in which rank 1 SIGKILLs itself after ``--kill-at-step``
   (``--kill-rank``/``--kill-at-step``, the trainer's fault drill, first
   attempt only). The survivors fail at once (a dead peer is an error on
   every rank, never a hang), torchrun restarts all ranks, and each resumes
   from ``latest`` and finishes.
3. The final losses are compared (the same float: a resumed run is exact),
   and the time from the kill to training again is split into detection
   (kill -> the last survivor's error), restart (-> every new rank's group
   is up), load (the checkpoint) and the rest (-> the first step done),
   from the events each rank writes to ``<checkpoint dir>/events.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def _losses(path: str) -> dict[int, float]:
    out = {}
    with open(path) as f:
        for line in f:
            m = json.loads(line)
            out[m["step"]] = m["loss"]  # a resumed attempt rewrites replayed steps
    return out


def _split(events_path: str) -> dict[str, float]:
    events = [json.loads(line) for line in open(events_path)]
    kill = next(e for e in events if e["event"] == "killed")
    failed = [e for e in events if e["event"] == "failed" and e["attempt"] == 0]
    # Ranks torchrun ended (SIGTERM, 0.1 s after it saw the death) before
    # they reached a collective and heard of it themselves.
    ended = [e for e in events if e["event"] == "terminated" and e["attempt"] == 0]
    stopped = {e["rank"]: e["time"] for e in ended}
    stopped.update({e["rank"]: e["time"] for e in failed})
    ready = [e for e in events if e["event"] == "group_ready" and e["attempt"] == 1]
    loaded = [e for e in events if e["event"] == "resumed" and e["attempt"] == 1]
    first = [e for e in events if e["event"] == "first_step" and e["attempt"] == 1]
    t0 = kill["time"]
    detected = max(stopped.values(), default=float("nan"))
    restarted = max(e["time"] for e in ready)
    return {
        "detection_s": detected - t0,
        "survivors_failed": len(failed),  # with the engine's error
        "survivors_stopped": len(stopped),  # with it, or ended by torchrun first
        "restart_s": restarted - detected,
        "load_s": max(e["load_s"] for e in loaded),
        "to_first_step_s": max(e["time"] for e in first) - t0,
        "resumed_from_step": loaded[0]["step"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt", choices=("gpt", "mlp"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps (5)")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-at-step", type=int, default=12)
    p.add_argument("--dir", help="work folder (default: a temporary one)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (0)")
    p.add_argument("--layout", default="2x2", help="dp x pp (2x2: 4 ranks)")
    args = p.parse_args(argv)
    try:
        dp, pp = (int(x) for x in args.layout.split("x"))
    except ValueError:
        p.error(f"--layout {args.layout!r} is not DPxPP (2x2, say)")
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        return run(args, args.dir, dp, pp)
    with tempfile.TemporaryDirectory(prefix="clawcomm-recovery-") as work:  # nothing left behind
        return run(args, work, dp, pp)


def run(args, work: str, dp: int, pp: int) -> int:
    ckpt = os.path.join(work, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    common = [
        "--dp", str(dp), "--pp", str(pp), "--model", args.model, "--steps", str(args.steps),
        "--microbatches", "4", "--micro-batch-size", "4", "--zero", str(args.zero), "--quiet",
    ]  # fmt: skip
    if args.model == "gpt":
        common += ["--dim", "64", "--layers", "2"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    whole = os.path.join(work, "whole.jsonl")
    print("1. the uninterrupted run", flush=True)
    first = subprocess.run(
        [sys.executable, "-m", "clawcomm.train", *common, "--metrics", whole],
        check=True, env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    for line in first.stdout.splitlines():
        if args.dir or work not in line:  # a temporary folder's files are gone at the end
            print(line, flush=True)
    torn = os.path.join(work, "recovered.jsonl")
    print("2. under torchrun --max-restarts 1, rank", args.kill_rank, "killed", flush=True)
    t = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(dp * pp),
            "--max-restarts",
            "1",
            "--monitor-interval",
            "0.1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:0",
            "-m",
            "clawcomm.train",
            *common,
            "--metrics",
            torn,
            "--checkpoint-dir",
            ckpt,
            "--checkpoint-every",
            str(args.every),
            "--resume",
            "--kill-rank",
            str(args.kill_rank),
            "--kill-at-step",
            str(args.kill_at_step),
        ],  # fmt: skip
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        return 1
    a, b = _losses(whole), _losses(torn)
    split = _split(os.path.join(ckpt, "events.jsonl"))
    same = a[args.steps] == b[args.steps]
    print(
        f"3. final loss uninterrupted {a[args.steps]!r}, recovered {b[args.steps]!r}: "
        f"{'identical' if same else 'DIFFERENT'}; the torchrun job took {time.time() - t:.1f} s"
    )
    print(
        f"   kill -> every survivor stopped ({split['survivors_stopped']}; "
        f"{split['survivors_failed']} with the engine's error, the rest ended by torchrun): "
        f"{split['detection_s']:.2f} s detection\n"
        f"   -> every new rank's group up: {split['restart_s']:.2f} s restart\n"
        f"   checkpoint of step {split['resumed_from_step']} loaded in {split['load_s']:.2f} s\n"
        f"   kill -> first step done again: {split['to_first_step_s']:.2f} s"
    )
    if not args.dir:
        print("   (the runs' metrics and checkpoints were in a temporary folder: --dir keeps them)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"final_loss": [a[args.steps], b[args.steps]], "identical": same, **split},
                f,
                indent=1,
            )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
