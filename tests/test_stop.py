"""SIGTERM and SIGINT stop a run without losing it (clawcomm.train.stop):
every rank stops after the same step, which is saved; the exit status says
a signal stopped it; a second signal stops at once; --resume goes on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from clawcomm.cli import main
from clawcomm.launch import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stopped_at(rank, world, ck, layout, zero, signum):
    """Rank 1 alone signals itself after step 3: the flag rides the step's
    all-gather, so every rank stops after step 4 (not 3: rank 1 raised it
    after step 3's figures were gathered)."""
    from clawcomm.train import checkpoint_files, models
    from clawcomm.train.config import TrainConfig
    from clawcomm.train.data import global_batches
    from clawcomm.train.stop import StopRequest
    from clawcomm.train.trainer import Trainer

    dp, pp = layout
    cfg = TrainConfig(model="mlp", hidden=32, layers=4, dp=dp, pp=pp, steps=20, zero=zero,
                      microbatches=2, quiet=True, checkpoint_dir=ck)  # fmt: skip
    model, loss, opt, ds, tokens, sample = models.build(cfg)
    trainer = Trainer(model, loss, opt, cfg, tokens_per_sample=tokens, sample=sample)
    # A shell that starts the tests in the background (`cmd &`) hands them
    # SIGINT ignored, which the ranks inherit, and StopRequest rightly leaves
    # an ignored signal to whoever ignores it (the launcher): this test
    # stands for a rank whose signals are its own.
    signal.signal(signum, signal.SIG_DFL)
    trainer.stop = StopRequest().install()

    def log(m):
        if rank == 1 and m["step"] == 3:
            os.kill(os.getpid(), signum)

    try:
        metrics = trainer.fit(
            global_batches(ds, cfg.effective_batch, cfg.seed), progress=False, log=log,
            checkpoint_dir=ck,
        )  # fmt: skip
    finally:
        trainer.stop.uninstall()
        trainer.close()
    return [m["step"] for m in metrics], metrics[-1].get("stopped_by"), checkpoint_files.latest(ck)


@pytest.mark.parametrize(
    "layout,zero,signum",
    [((2, 1), 0, signal.SIGTERM), ((1, 2), 0, signal.SIGINT), ((2, 2), 2, signal.SIGTERM)],
)
def test_every_rank_stops_after_the_same_step_and_saves_it(tmp_path, layout, zero, signum):
    ck = str(tmp_path / "ck")
    world = layout[0] * layout[1]
    for steps, stopped_by, latest in run_ranks(_stopped_at, world, ck, layout, zero, signum):
        assert steps == [1, 2, 3, 4] and stopped_by == signum
        assert latest == os.path.join(ck, "step-00000004")


def _train(*args, **kw):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "clawcomm.cli", "train", "--model", "mlp", "--hidden", "32"]
    return subprocess.Popen(
        cmd + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=ROOT, start_new_session=True, **kw,
    )  # fmt: skip


def _wait_for_steps(path, n, proc, limit=120.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if os.path.exists(path) and len(open(path).read().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{path}: fewer than {n} steps in {limit} s")


def test_ctrl_c_saves_stops_with_130_and_resume_goes_on(tmp_path, capfd):
    """Ctrl-C as a terminal sends it (to the whole process group): the
    launcher says it as SIGINT and passes it on once, the ranks finish their
    step and save, the run prints its summary and how to go on, and exits
    130; the resumed run's summary says which steps it ran."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = _train("--dp", "2", "--steps", "100000", "--checkpoint-dir", str(ck),
                  "--metrics", str(metrics))  # fmt: skip
    _wait_for_steps(metrics, 3, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    last = json.loads(metrics.read_text().splitlines()[-1])
    step = last["step"]
    # (the ranks heard the launcher's SIGTERM)
    assert last["stopped_by"] == signal.SIGTERM and last["checkpoint"].endswith(f"{step:08d}")
    asked = f"SIGINT: asking every rank to stop after the step it is in and save it in {ck} ("
    assert asked in err, err
    assert "SIGTERM" not in out + err, (out, err)  # the ranks' SIGTERM is the launcher's
    assert f"stopped by SIGINT after step {step}; checkpoint {last['checkpoint']}" in out, out
    assert "final loss" in out and "Traceback" not in err, err
    # (in this process: the same command line, where torch is imported already)
    argv = ["train", "--model", "mlp", "--hidden", "32", "--dp", "2", "--steps", str(step + 2),
            "--checkpoint-dir", str(ck), "--resume", "--quiet"]  # fmt: skip
    capfd.readouterr()
    assert main(argv) == 0
    out = capfd.readouterr().out  # (rank 0, a forked process, says it resumed)
    assert f"resumed from step {step}" in out, out
    assert f"at step {step + 2}, after 2 steps resumed from step {step}" in out, out


def test_a_second_signal_stops_at_once(tmp_path):
    """Two signals in a row while the ranks are inside a step of about 1.5
    seconds (layers that wait): the ranks are killed, the launcher says so
    and exits 143 at once."""
    metrics = tmp_path / "m.jsonl"
    proc = _train("--model", "wait", "--wait-ms", "250,250,250", "--layers", "2",
                  "--microbatches", "1", "--dp", "2", "--steps", "1000", "--metrics",
                  str(metrics))  # fmt: skip
    _wait_for_steps(metrics, 1, proc)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.3)  # (two signals at once would arrive as one)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, (out, err)
    assert time.monotonic() - t0 < 5.0
    assert "a second SIGTERM: ranks killed" in err and "stopped at once" in err, err
    nothing = "SIGTERM: asking every rank to stop after the step it is in; nothing is saved"
    assert nothing in err, err
    assert len(metrics.read_text().splitlines()) == 1  # step 2 never ended
