"""torchft's DDP on clawcomm: two replica groups train; one is killed, the
other goes on, and the dead one, restarted, heals from the live one.

    python examples/torchft_ddp.py --demo                 # the whole story, one command
    python examples/torchft_ddp.py --lighthouse HOST:PORT --replica-id 0   # one replica group

torchft (``pip install torchft==0.2.0``) runs a Lighthouse that keeps the
quorum of replica groups; each group's Manager joins it every step, and the
process group between the groups (here clawcomm's, through
``clawcomm.torchft_group.ProcessGroupClawcomm``) is reconfigured whenever
the quorum changes. A group that comes back takes the model and optimizer
state from a live one (torchft's checkpoint transfer) before its first step.

``--demo`` starts a Lighthouse and two replica groups of one rank each,
SIGKILLs group 1 at step ``--kill-at``, restarts it two seconds later, and
prints one JSON line: each group's steps and times, and whether their
final weights are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch
from torch import nn


def replica(args) -> None:
    """One replica group of one rank: trains until the Manager's step count
    reaches --steps, logging (step, time, weights' sum) after each."""
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer

    from clawcomm.torchft_group import ProcessGroupClawcomm

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.05)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupClawcomm(timeout=timedelta(seconds=5)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"group{args.replica_id}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        timeout=timedelta(seconds=5),
        quorum_timeout=timedelta(seconds=10),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    log = open(args.log, "a") if args.log else None
    while manager.current_step() < args.steps:
        # The data of a step depends on the step alone: every group draws the same.
        g = torch.Generator().manual_seed(manager.current_step() * 2 + args.replica_id)
        x = torch.randn(32, 16, generator=g)
        y = x[:, :4].sum(1, keepdim=True).repeat(1, 4)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        if log:
            weights = sum(float(p.detach().double().sum()) for p in model.parameters())
            log.write(json.dumps({"step": manager.current_step(), "t": time.time(),
                                  "loss": loss.item(), "weights": weights,
                                  "participants": manager.num_participants()}) + "\n")  # fmt: skip
            log.flush()
        time.sleep(args.step_s)
    manager.shutdown(wait=False)


def _steps(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def demo(args) -> dict:
    """The story in one process tree; returns what happened."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200,
                                  heartbeat_timeout_ms=1000)  # fmt: skip
    folder = args.log_dir or "."
    os.makedirs(folder, exist_ok=True)
    logs = [os.path.join(folder, f"group{r}.jsonl") for r in range(2)]
    for path in logs:
        if os.path.exists(path):
            os.remove(path)

    def start(r: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, __file__, "--lighthouse", lighthouse.address(), "--replica-id",
             str(r), "--steps", str(args.steps), "--step-s", str(args.step_s), "--log", logs[r]]
        )  # fmt: skip

    procs = [start(0), start(1)]
    out = {"killed_at_step": None, "restarted_at": None}
    deadline = time.monotonic() + args.limit_s
    try:
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a replica group exited early: {[p.poll() for p in procs]}")
            one = _steps(logs[1])
            if one and one[-1]["step"] >= args.kill_at:
                procs[1].send_signal(signal.SIGKILL)
                procs[1].wait()
                out["killed_at"], out["killed_at_step"] = time.time(), one[-1]["step"]
                break
            time.sleep(0.05)
        time.sleep(2.0)
        out["restarted_at"] = time.time()
        procs[1] = start(1)
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
    runs = [_steps(path) for path in logs]
    out["groups"] = [{"steps": [s["step"] for s in run], "t": [s["t"] for s in run],
                      "participants": [s["participants"] for s in run],
                      "weights": run[-1]["weights"] if run else None} for run in runs]  # fmt: skip
    out["returncodes"] = [p.returncode for p in procs]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", action="store_true", help="lighthouse, two groups, a kill, a heal")
    p.add_argument("--lighthouse", help="HOST:PORT of torchft's Lighthouse")
    p.add_argument("--replica-id", type=int, default=0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-s", type=float, default=0.2, help="sleep after each step (s)")
    p.add_argument("--kill-at", type=int, default=10, help="--demo: kill group 1 at this step")
    p.add_argument("--limit-s", type=float, default=120.0)
    p.add_argument("--log", help="a JSON line per step to this file")
    p.add_argument("--log-dir", help="--demo: where the groups' logs go")
    args = p.parse_args()
    if args.demo:
        print(json.dumps(demo(args)))
    else:
        replica(args)


if __name__ == "__main__":
    main()
