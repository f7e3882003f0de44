"""Checkpoints of the trainer (clawcomm.train.checkpoint): exact resume,
loading at another layout, atomicity under SIGKILL, and clear errors for a
checkpoint of another model, compressor or optimizer."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
from _training import _run, _save_at

from clawcomm.launch import run_ranks
from clawcomm.testing.checkpoint import kill_mid_save_trial
from clawcomm.train import checkpoint, checkpoint_files
from clawcomm.train.config import TrainConfig


def _config(**kw) -> TrainConfig:
    base = dict(model="mlp", hidden=32, steps=6, microbatches=2, micro_batch_size=4, quiet=True)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize(
    "dp,pp,compression,optimizer",
    [
        (2, 2, "topk:0.1", "adamw"),
        (2, 1, "fp16", "sgd"),
        (1, 2, "", "adamw"),
        # DGC's momentum (per element) and PowerSGD's Q (per bucket) resume too.
        (2, 1, "dgc:0.2:warmup=2", "sgd"),
        (2, 2, "powersgd:2", "adamw"),
    ],  # fmt: skip
)
def test_a_resumed_run_reproduces_the_uninterrupted_one_bit_for_bit(
    tmp_path, dp, pp, compression, optimizer
):
    cfg = _config(dp=dp, pp=pp, compression=compression, optimizer=optimizer)
    n = dp * pp
    whole = run_ranks(_run, n, cfg, 6, False, timeout=300)[0][0]
    cfg = dataclasses.replace(cfg, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    first = run_ranks(_run, n, cfg, 3, False, timeout=300)[0][0]  # saves at 2 and 3
    assert open(tmp_path / "latest").read().strip() == "step-00000003"
    second = run_ranks(_run, n, cfg, 6, True, timeout=300)[0][0]
    assert first + second == whole  # the same floats, not merely close


@pytest.mark.parametrize("before,after", [((2, 2), (1, 4)), ((2, 1), (1, 2)), ((1, 4), (2, 2))])
def test_a_checkpoint_loads_at_another_layout(tmp_path, before, after):
    (dp, pp), (dp2, pp2) = before, after
    cfg = _config(dp=dp, pp=pp, microbatches=4, checkpoint_dir=str(tmp_path), checkpoint_every=3,
                  accumulation=2 if dp == 1 else 1)  # fmt: skip
    saved = {}
    for _, params in run_ranks(_run, dp * pp, cfg, 3, False, timeout=300):
        saved.update(params)
    # the same global batch (clawcomm.train.resume): the accumulation follows
    cfg2 = dataclasses.replace(cfg, dp=dp2, pp=pp2, accumulation=1, global_batch=32)
    loaded = {}
    for _, params in run_ranks(_run, dp2 * pp2, cfg2, 3, True, timeout=300):  # 0 more steps
        loaded.update(params)
    assert set(loaded) == set(saved)
    for name, t in saved.items():
        assert torch.equal(loaded[name], t), name


def _save_once(cfg, root):
    from clawcomm.train.models import build
    from clawcomm.train.trainer import Trainer

    model, loss, opt, _, _, _ = build(cfg)
    tr = Trainer(model, loss, opt, cfg)
    tr.step_index = 5
    tr.save_checkpoint(root)
    tr.close()


def _load_once(cfg, root):
    from clawcomm.train.models import build
    from clawcomm.train.trainer import Trainer

    model, loss, opt, _, _, _ = build(cfg)
    tr = Trainer(model, loss, opt, cfg)
    try:
        return tr.load_checkpoint(root)
    finally:
        tr.close()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"hidden": 48}, "holds another model: parameter '0.0.weight' is \\[32, 64\\] there"),
        ({"layers": 5}, "holds another model: it lacks"),
        ({"compression": "topk:0.1", "dp": 1}, "made with compression '', this run uses"),
        ({"optimizer": "sgd"}, "made with optimizer AdamW, this run uses SGD"),
    ],
)
def test_a_checkpoint_of_another_run_is_a_clear_error(tmp_path, change, message):
    cfg = _config()
    _save_once(cfg, str(tmp_path))
    with pytest.raises(checkpoint.CheckpointError, match=message):
        _load_once(dataclasses.replace(cfg, **change), str(tmp_path))
    assert _load_once(cfg, str(tmp_path)) == 5


def test_no_checkpoint_and_a_dangling_latest_are_errors(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint there"):
        _load_once(_config(), str(tmp_path))
    (tmp_path / "latest").write_text("step-00000009\n")
    with pytest.raises(checkpoint.CheckpointError, match="not a complete checkpoint"):
        checkpoint_files.latest(str(tmp_path))


def _cut_short(folder) -> str:
    """Cuts checkpoint ``folder``'s data file to half its size; returns it."""
    (shard,) = [f for f in os.listdir(folder) if f.endswith(".distcp")]
    path = os.path.join(folder, shard)
    os.truncate(path, os.path.getsize(path) // 2)
    return path


def test_a_damaged_checkpoint_is_named_and_the_intact_step_before_it_loads(tmp_path):
    """A shard cut short used to fail inside DCP's reader (EOFError, no file
    named) and the intact step beside it went unused."""
    cfg, root = _config(), str(tmp_path)
    _save_at(cfg, root, [2, 4])
    folder = tmp_path / "step-00000004"
    whole = checkpoint_files.size_bytes(folder) - os.path.getsize(folder / ".metadata")
    shard = _cut_short(folder)
    found = checkpoint_files.choose(root)
    assert found.path == os.path.join(root, "step-00000002")
    assert found.passed_over == [
        f"{shard}: cut short, {whole // 2} bytes where DCP's index places items up to {whole}"
    ]
    assert _load_once(cfg, root) == 2  # a root: the newest intact step
    with pytest.raises(checkpoint.CheckpointError, match=f"^{shard}: cut short"):
        _load_once(cfg, str(tmp_path / "step-00000004"))  # this one and no other
    # A resumed run saves over the damaged step; until then it is neither
    # counted among those kept nor removed.
    _save_at(cfg, root, [3], keep=2)
    assert sorted(os.listdir(root)) == ["latest", "step-00000002", "step-00000003",
                                        "step-00000004"]  # fmt: skip
    _save_at(cfg, root, [4], keep=2)
    assert sorted(os.listdir(root)) == ["latest", "step-00000003", "step-00000004"]
    assert checkpoint_files.choose(root).passed_over == []


def test_when_no_checkpoint_is_intact_each_is_named(tmp_path):
    cfg, root = _config(), str(tmp_path)
    _save_at(cfg, root, [2, 4])
    os.truncate(tmp_path / "step-00000004" / ".metadata", 10)
    shard = _cut_short(tmp_path / "step-00000002")
    os.remove(shard)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint_files.choose(root)
    assert str(e.value) == (
        f"no intact checkpoint in {root}: {root}/step-00000004/.metadata: DCP's index cannot be "
        f"read (UnpicklingError: pickle data was truncated); {shard}: missing (DCP's index "
        "places items in it)"
    )


def test_a_process_killed_while_saving_leaves_a_loadable_checkpoint(tmp_path):
    """bench/checkpoint_bench.py runs 100 of these trials (here: two, one
    killed at once after the first save, one later)."""
    rng = random.Random(0)
    for trial in range(2):
        root = str(tmp_path / f"t{trial}")
        last, loaded = kill_mid_save_trial(root, rng.uniform(0.0, 0.4))
        assert loaded in (last, last + 1), (last, loaded)  # the kill may follow a rename


@pytest.mark.parametrize("dp,pp,zero", [(2, 2, 0), (1, 2, 0), (2, 2, 2)])
def test_an_asynchronous_save_resumes_exactly_too(tmp_path, dp, pp, zero):
    """Training goes on while the files are written; the state saved is the
    one of the step it was taken at, and the run resumes from it exactly
    (at ZeRO-2, the moments gathered whole when the save is taken)."""
    compression = "topk:0.1" if dp > 1 and not zero else ""
    cfg = _config(dp=dp, pp=pp, compression=compression, zero=zero)
    whole = run_ranks(_run, dp * pp, cfg, 6, False, timeout=300)[0][0]
    cfg = dataclasses.replace(
        cfg, checkpoint_dir=str(tmp_path), checkpoint_every=3, async_checkpoint=True
    )
    first = run_ranks(_run, dp * pp, cfg, 4, False, timeout=300)[0][0]  # saves at 3 and 4
    assert open(tmp_path / "latest").read().strip() == "step-00000004"
    second = run_ranks(_run, dp * pp, cfg, 6, True, timeout=300)[0][0]
    assert first + second == whole


FULL_DISK_SCRIPT = """
import os, sys
from clawcomm.train import checkpoint_files
from clawcomm.train.models import build
from clawcomm.train.config import TrainConfig
from clawcomm.train.trainer import Trainer
if sys.argv[1] == "write":  # the room check passes, then the disk is full
    checkpoint_files.check_room = lambda *a: None
cfg = TrainConfig(model="gpt", steps=1, quiet=True)
model, loss, opt, _, _, _ = build(cfg)
tr = Trainer(model, loss, opt, cfg)
try:
    tr.save_checkpoint("/tmp/clawcomm-tiny/ckpt")
    print("SAVED")
except OSError as e:
    print("ERROR:", e)
print("LEFT:", sorted(os.listdir("/tmp/clawcomm-tiny/ckpt")))
"""


@pytest.mark.parametrize("stage", ["check", "write"])
def test_a_full_disk_is_a_clear_error_that_leaves_no_partial_checkpoint(stage):
    """torch's zip writer used to fail with "unexpected pos 704 vs 598" and
    leave a step-N.tmp folder behind."""
    import os
    import shutil
    import subprocess
    import sys

    if not shutil.which("unshare"):
        pytest.skip("needs unshare to mount a small file system")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = (
        "mkdir -p /tmp/clawcomm-tiny && mount -t tmpfs -o size=256k tmpfs /tmp/clawcomm-tiny && "
        f"{sys.executable} -c '{FULL_DISK_SCRIPT}' {stage}"
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=root),
    )  # fmt: skip
    if "mount" in proc.stderr and "ERROR" not in proc.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
    if stage == "check":
        assert "needs about" in proc.stdout and "0.3 MB free" in proc.stdout, proc.stdout
    else:
        assert "writing checkpoint step-00000000 into /tmp/clawcomm-tiny/ckpt failed" in proc.stdout
    assert "LEFT: []" in proc.stdout, proc.stdout + proc.stderr
