"""A trainer killed while it saves: the trial tests/test_checkpoint.py runs
in CI and bench/checkpoint_bench.py runs long."""

from __future__ import annotations

import os

import clawcomm

_SAVER = """
import sys
from clawcomm.train.config import TrainConfig
from clawcomm.train.models import build
from clawcomm.train.trainer import Trainer
cfg = TrainConfig(model="gpt", dim=64, layers=2, steps=10**6, quiet=True)
model, loss, opt, _, _, _ = build(cfg)
tr = Trainer(model, loss, opt, cfg)
for step in range(1, 10**6):
    tr.step_index = step
    tr.save_checkpoint(sys.argv[1], keep=2)
    print(step, flush=True)
"""


def kill_mid_save_trial(root: str, delay_s: float) -> tuple[int, int]:
    """One kill-mid-save trial: a process saves trainer checkpoints under
    ``root`` in a loop; ``delay_s`` after its first save it is SIGKILLed
    (landing inside a save most of the time), and what ``latest`` names is
    loaded here. Returns (the last step it reported saved, the step
    loaded); the load raising is the failure this guards against."""
    import signal
    import subprocess
    import sys
    import time

    from clawcomm.train.config import TrainConfig
    from clawcomm.train.models import build
    from clawcomm.train.trainer import Trainer

    here = os.path.dirname(os.path.dirname(os.path.abspath(clawcomm.__file__)))
    env = dict(os.environ, PYTHONPATH=here)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVER, root], stdout=subprocess.PIPE, text=True, env=env
    )
    first = proc.stdout.readline()
    if first.strip() != "1":
        proc.kill()
        raise RuntimeError(f"kill_mid_save_trial: the saver did not start ({first!r})")
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    rest = proc.stdout.read().split()
    proc.wait()
    last = int(rest[-1]) if rest else 1
    model, loss, opt, _, _, _ = build(TrainConfig(model="gpt", dim=64, layers=2, quiet=True))
    tr = Trainer(model, loss, opt, TrainConfig(model="gpt", dim=64, layers=2, quiet=True))
    try:
        return last, tr.load_checkpoint(root)
    finally:
        tr.close()


# --- the wire format, for tests/test_wire.py and bench/fuzz_frames.py --------
