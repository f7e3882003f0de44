"""torchft over clawcomm (issue 63, item 4): torchft's Manager drives
clawcomm.torchft_group.ProcessGroupClawcomm through a reconfigure per
quorum. examples/torchft_ddp.py --demo trains two replica groups with
torchft's DDP, SIGKILLs one mid-run and restarts it: the other must go on
alone, and the restarted one must heal (take the live group's state) and
finish in step with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torchft")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "torchft_ddp.py")


def test_a_killed_replica_group_leaves_the_other_going_and_heals(tmp_path):
    steps, kill_at = 60, 10
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--demo", "--steps", str(steps), "--kill-at", str(kill_at),
         "--log-dir", str(tmp_path), "--limit-s", "150"],
        capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    live, healed = out["groups"]
    assert out["killed_at_step"] is not None and out["killed_at_step"] >= kill_at, out
    # The live group went on while the other was dead: steps completed
    # between the kill and the restart, with itself alone in the quorum.
    alone = [
        s for s, t, n in zip(live["steps"], live["t"], live["participants"], strict=True)
        if out["killed_at"] < t < out["restarted_at"]
    ]  # fmt: skip
    assert len(alone) >= 3, out
    # The kill costs the live group one slow step (torchft's quorum drops the
    # dead group after the Lighthouse's 1 s heartbeat timeout), not a stop.
    times = live["t"]
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 10, out
    assert live["steps"][-1] >= steps - 1 and out["returncodes"] == [0, 0], out
    # The restarted group healed: it resumed at the live group's step, not
    # at 0, and both ended with the same weights.
    restarted = [
        s for s, t in zip(healed["steps"], healed["t"], strict=True) if t > out["restarted_at"]
    ]
    assert restarted and restarted[0] > out["killed_at_step"], out
    assert healed["steps"][-1] >= steps - 1, out
    assert abs(live["weights"] - healed["weights"]) < 1e-9 * max(1.0, abs(live["weights"])), out
    assert max(live["participants"][-3:]) == 2, out
