"""A resume keeps the global batch (clawcomm.train.resume): at another layout
the accumulation is derived from the checkpoint's batch and the loss follows
the uninterrupted run; a batch no whole accumulation gives is refused, and
--allow-batch-change is the one way to change it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from _training import _run

from clawcomm.launch import RankFailure, run_ranks
from clawcomm.train import resume
from clawcomm.train.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**kw) -> TrainConfig:
    base = dict(model="mlp", hidden=32, steps=6, microbatches=2, micro_batch_size=4, quiet=True)
    base.update(kw)
    return TrainConfig(**base)


def test_a_resume_at_another_layout_keeps_the_batch_and_follows_the_loss(tmp_path):
    """dp 2 -> dp 1 x pp 2: accumulation 2 keeps the batch of 16, the same
    samples in the same order; the loss differs from the uninterrupted run's
    only by the order of the sums (same layout: the same floats)."""
    cfg = _config(dp=2)
    whole = run_ranks(_run, 2, cfg, 6, False, timeout=300)[0][0]
    cfg = dataclasses.replace(cfg, checkpoint_dir=str(tmp_path))
    first = run_ranks(_run, 2, cfg, 3, False, timeout=300)[0][0]
    moved, line = resume.plan(dataclasses.replace(cfg, dp=1, pp=2, resume=True))
    assert (moved.accumulation, moved.effective_batch) == (2, 16)
    assert line == (
        "clawcomm train: --resume at another layout keeps the global batch of 16: dp 2 x pp 1, "
        "2 micro-batches of 4, accumulation 1 then, dp 1 x pp 2, 2 micro-batches of 4, "
        "accumulation 2 now"
    )
    second = run_ranks(_run, 2, moved, 6, True, timeout=300)[-1][0]  # (the last stage's losses)
    assert first == whole[:3]
    assert second == pytest.approx(whole[3:], rel=1e-5, abs=0)
    same, line = resume.plan(moved)  # the same layout as the last save: nothing to say
    assert same == moved and line == ""


def test_a_batch_that_cannot_be_kept_is_refused_and_a_change_is_said(tmp_path):
    cfg = _config(dp=1, checkpoint_dir=str(tmp_path))  # a global batch of 8
    run_ranks(_run, 1, cfg, 2, False, timeout=300)
    wide = dataclasses.replace(cfg, dp=4, pp=1, resume=True)  # a run of 32 > 8
    with pytest.raises(resume.BatchChangeError) as e:
        resume.plan(wide)
    assert "global batch of 8" in str(e.value) and "4 x 2 x 4 = 32 samples" in str(e.value)
    assert "--allow-batch-change" in str(e.value)
    with pytest.raises(resume.BatchChangeError, match="--global-batch asks for 16"):
        resume.plan(dataclasses.replace(cfg, resume=True, global_batch=16))
    allowed, line = resume.plan(dataclasses.replace(wide, allow_batch_change=True))
    assert allowed.effective_batch == 32
    assert "the global batch changes from 8 to 32 (--allow-batch-change)" in line
    # the trainer's own load refuses it too (a library user who skips plan())
    with pytest.raises(RankFailure, match="global batch of 8, this run.s is 16"):
        run_ranks(_run, 2, dataclasses.replace(cfg, dp=2), 3, True, timeout=300)


def test_global_batch_derives_the_accumulation_and_names_a_bad_one():
    assert _config(dp=2, global_batch=64).accumulation == 4  # 4 x 2 x 2 = 16 a run
    with pytest.raises(ValueError, match="global_batch 20 is not a whole number of schedule runs"):
        _config(dp=2, global_batch=20).check(2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "clawcomm.cli", "train", "--global-batch", "64",
           "--accumulation", "2", "--model", "mlp"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and "give one of them" in p.stderr, p.stderr
