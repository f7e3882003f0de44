"""clawcomm.train against single-process training: every layout and
schedule, accumulation, compression, tied weights, clipping and the NaN
stop, LR scaling; bad configurations; the CLI, its TOML config and
torchrun."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from _training import STEPS, _check_against_reference, _config, _reference, _train

from clawcomm.launch import RankFailure, run_ranks
from clawcomm.train import TrainConfig, Trainer
from clawcomm.train import models as train_models
from clawcomm.train.data import global_batches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = [
    # dp, pp, schedule, v
    (1, 1, "1f1b", 1),
    (2, 1, "1f1b", 1),
    (1, 2, "gpipe", 1),
    (1, 2, "1f1b", 1),
    (1, 2, "zb1", 1),
    (1, 2, "interleaved", 2),
    (1, 1, "interleaved", 4),
    (2, 2, "1f1b", 1),
    (2, 2, "zb1", 1),
    (1, 4, "gpipe", 1),
    (1, 4, "1f1b", 1),
    (1, 4, "zb1", 1),
]


@pytest.mark.parametrize("dp,pp,schedule,v", LAYOUTS)
def test_every_layout_and_schedule_trains_like_one_process(dp, pp, schedule, v):
    """Same seed and effective batch (8 samples of 16 tokens): the same loss
    curve, gradient norms (clipping active) and final weights, whatever the
    layout. The GPT's tied embedding crosses ranks whenever pp > 1."""
    m = 4
    cfg = _config(dp=dp, pp=pp, schedule=schedule, virtual_stages=v, microbatches=m,
                  micro_batch_size=8 // (m * dp))  # fmt: skip
    _check_against_reference(run_ranks(_train, dp * pp, cfg), cfg)


def test_accumulation_is_the_same_effective_batch():
    """2 runs of 2 micro-batches per step equal 1 run of 4, with the loss
    the mean over all 8 samples' tokens."""
    cfg = _config(dp=1, pp=2, microbatches=2, accumulation=2, micro_batch_size=2)
    _check_against_reference(run_ranks(_train, 2, cfg), cfg)


def test_mlp_with_sgd_and_a_stage_of_its_own_per_layer():
    cfg = TrainConfig(model="mlp", dp=1, pp=4, microbatches=4, micro_batch_size=3,
                      optimizer="sgd", lr=0.1, weight_decay=1e-2, lr_decay="none", clip=0,
                      steps=STEPS, quiet=True)  # fmt: skip
    _check_against_reference(run_ranks(_train, 4, cfg), cfg, atol=1e-6)


@pytest.mark.parametrize("spec,atol", [("topk:1.0", 2e-5), ("fp16", 2e-3)])
def test_compressed_data_parallelism_inside_the_pipeline(spec, atol):
    """Each stage's gradients are averaged through the compressor (error
    feedback kept per bucket): lossless top-k matches; fp16 is close (SGD,
    so that a weight's error stays proportional to its gradient's)."""
    cfg = _config(dp=2, pp=2, microbatches=2, micro_batch_size=2, compression=spec, clip=0,
                  optimizer="sgd", lr=0.5)  # fmt: skip
    results = run_ranks(_train, 4, cfg)
    losses, _, want = _reference(cfg)
    for metrics, params in results:
        assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-3)
        for n, p in params.items():
            torch.testing.assert_close(p, want[n], atol=atol, rtol=0, msg=n)


# ---- the data-parallel reduction overlaps the pipeline ----------------------------------


def _launch_times(rank, world):
    from clawcomm.parallel import reducer as reducer_mod

    cfg = TrainConfig(model="wait", dp=2, pp=2, microbatches=4, micro_batch_size=1,
                      wait_ms="2,2,2", wait_width=64, layers=4, steps=3, quiet=True)  # fmt: skip
    model, loss_fn, make_opt, ds, _, _ = train_models.build(cfg)
    trainer = Trainer(model, loss_fn, make_opt, cfg)
    seen: list = []
    launch = reducer_mod.GradReducer._launch

    def recording(self, bucket):
        seen.append((trainer.step_index, trainer.reducer.armed))
        launch(self, bucket)

    reducer_mod.GradReducer._launch = recording
    trainer.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)
    trainer.close()
    return seen, len(trainer.reducer.buckets)


def test_stage_gradients_are_reduced_while_the_pipeline_drains():
    """Step 1 learns when each gradient is final and reduces after the
    pipeline; from step 2 each bucket leaves from inside the backward action
    that finished it."""
    for seen, buckets in run_ranks(_launch_times, 4):
        first = [armed for step, armed in seen if step == 0]
        later = [armed for step, armed in seen if step > 0]
        assert first == [False] * buckets
        assert later == [True] * (2 * buckets)


# ---- clipping, NaN, LR --------------------------------------------------------------


def _nan_at_step_two(rank, world):
    cfg = TrainConfig(model="mlp", pp=2, microbatches=2, micro_batch_size=2, steps=4, quiet=True)
    model, loss_fn, make_opt, ds, _, _ = train_models.build(cfg)
    calls = {"n": 0}

    def poisoned(out, target):
        calls["n"] += 1
        loss = loss_fn(out, target)
        return loss * float("nan") if calls["n"] > 2 else loss  # step 2, on the last stage

    trainer = Trainer(model, poisoned, make_opt, cfg)
    trainer.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)


def test_a_nan_stops_every_rank():
    results = run_ranks(_nan_at_step_two, 2, allow_failures=True)
    for r in results:
        assert isinstance(r, RankFailure)
        assert "FloatingPointError: clawcomm.train: stopped at step 1: the loss is nan" in str(r)


def test_learning_rate_scaling_warm_up_and_decay():
    def trainer(**kw):
        cfg = TrainConfig(model="mlp", micro_batch_size=4, microbatches=2, steps=10, **kw)
        model, loss_fn, make_opt, *_ = train_models.build(cfg)
        return Trainer(model, loss_fn, make_opt, cfg)

    t = trainer(lr_scaling="linear", base_batch=4, lr_decay="none", lr=0.01)
    assert t.cfg.lr_factor(0) == pytest.approx(2.0)  # effective batch 8 against 4
    assert "lr 0.02 = 0.01 at base batch 4, linear scaling" in t.describe()
    assert "global batch 8 = micro-batch 4 x 2 micro-batches x 1 accumulation x dp 1" in (
        t.describe()
    )
    t = trainer(lr_scaling="sqrt", base_batch=2, lr_decay="none")
    assert t.cfg.lr_factor(5) == pytest.approx(2.0)
    t = trainer(warmup_steps=4, lr_decay="cosine", min_lr_ratio=0.1)
    assert [t.cfg.lr_factor(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert t.cfg.lr_factor(10) == pytest.approx(0.1)
    # half-way through the decay (step 7 of 4..10): cos(pi/2) = 0
    assert t.cfg.lr_factor(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


# ---- bad configurations ------------------------------------------------------------------


BAD = [
    (dict(dp=2, pp=2), 2, r"dp \* tp \* pp = 2 \* 1 \* 2 = 4 ranks, but the world has 2"),
    (dict(model="mlp", layers=2, pp=2, schedule="interleaved", virtual_stages=2), 2,
     r"4 stages \(pp (2 )?x v( 2)?\) but the (mlp )?model has only 2 layers"),
    (dict(pp=2, microbatches=1), 2, r"schedule 1f1b needs at least pp=2 micro-batches"),
    (dict(schedule="pipedream"), 1, r"schedule[ :].*'pipedream'.*gpipe'?, '?1f1b"),
    (dict(micro_batch_size=0), 1, r"micro_batch_size must be >= 1, got 0"),
]  # fmt: skip


def _bad(rank, world, kw):
    cfg = TrainConfig(**{"model": "mlp", **kw})
    model, loss_fn, make_opt, *_ = train_models.build(cfg)
    Trainer(model, loss_fn, make_opt, cfg)


@pytest.mark.parametrize("kw,world,message", BAD)
def test_bad_configurations_fail_on_every_rank_before_training(kw, world, message):
    results = run_ranks(_bad, world, kw, allow_failures=True)
    for r in results:
        assert isinstance(r, RankFailure)
        assert re.search(message, str(r)), str(r)[-800:]


def _cli(*args, timeout=300, **kw):
    return subprocess.run(
        [sys.executable, "-m", "clawcomm.train", *args], cwd=ROOT, capture_output=True,
        text=True, timeout=timeout, **kw,
    )  # fmt: skip


def _refused(*args):
    """``clawcomm train ARGS`` in this process, for a command refused before
    any rank starts (what it prints, the parent prints): (status, stderr)."""
    import contextlib
    import io

    from clawcomm.train.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's refusal
            code = e.code
    return code, err.getvalue()


@pytest.mark.parametrize("kw,world,message", BAD)
def test_the_cli_refuses_bad_configurations_before_starting(kw, world, message):
    args = []
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    code, err = _refused("--model", "mlp", "--nproc", str(world), *args)
    assert code == 2, err
    assert re.search(message, err), err


def test_loss_that_averages_is_refused():
    cfg = TrainConfig(model="mlp")
    model, _, make_opt, *_ = train_models.build(cfg)
    with pytest.raises(ValueError, match=r"loss_fn must sum over the micro-batch"):
        Trainer(model, torch.nn.CrossEntropyLoss(), make_opt, cfg)


# ---- the command line ------------------------------------------------------------------------


KEYS = {"step", "loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "step_ms", "bubble",
        "bubble_predicted", "bytes_sent"}  # fmt: skip


def test_cli_with_a_toml_config_writes_metrics(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'model = "gpt"\ndim = 32\nheads = 2\nlayers = 2\nseq-len = 16\npp = 2\n'
        'schedule = "zb1"\nmicrobatches = 4\nmicro_batch_size = 2\nsteps = 50\nlr = 0.003\n'
    )
    metrics = tmp_path / "m.jsonl"
    proc = _cli("--config", str(toml), "--steps", "3", "--metrics", str(metrics), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "global batch 8 = micro-batch 2 x 4 micro-batches" in proc.stdout
    assert "schedule zb1" in proc.stdout and "final loss" in proc.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # --steps beat the file's 50
    assert KEYS <= set(rows[0]), KEYS - set(rows[0])
    assert rows[0]["bytes_sent"] > 0 and rows[-1]["loss"] < rows[0]["loss"]


def test_toml_errors_name_the_key(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("micro-batchsize = 4\n")
    code, err = _refused("--config", str(toml))
    assert code == 2 and "unknown setting 'micro-batchsize'" in err
    toml.write_text('steps = "ten"\n')
    code, err = _refused("--config", str(toml))
    assert code == 2 and "steps = 'ten' is not an integer" in err


def test_torchrun_runs_the_same_trainer(tmp_path):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "clawcomm.train", "--model",
         "mlp", "--pp", "2", "--steps", "3", "--quiet", "--metrics", str(metrics)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(metrics.read_text().splitlines()) == 3


def test_metrics_split_compute_exposed_communication_and_bytes_per_group(tmp_path):
    import json

    from clawcomm.train.cli import train_rank
    from clawcomm.train.config import TrainConfig

    def body(rank, n, board):
        cfg = TrainConfig(
            model="mlp", hidden=32, dp=2, pp=2, steps=2, microbatches=4, micro_batch_size=2,
            quiet=True, tensorboard=board,
        )  # fmt: skip
        return train_rank(cfg, announce=False)

    board = str(tmp_path / "tb")
    metrics = run_ranks(body, 4, board, timeout=180)[0]
    m = metrics[-1]
    assert m["compute_ms"] > 0 and m["exposed_comm_ms"] >= 0, m
    assert m["bytes_sent_pp"] > 0 and m["bytes_sent_dp"] > 0, m
    assert m["bytes_sent"] >= m["bytes_sent_pp"] + m["bytes_sent_dp"], m
    json.dumps(m)
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert files and files[0].stat().st_size > 0


def test_a_missing_text_or_a_broken_config_is_an_error_not_a_traceback(tmp_path):
    code, err = _refused("--model", "gpt", "--text", str(tmp_path / "missing.txt"), "--nproc", "1")
    assert code == 2 and "Traceback" not in err, err
    assert "missing.txt' is not a file" in err, err
    toml = tmp_path / "broken.toml"
    toml.write_text("steps = 3\ndp = \n")
    code, err = _refused("--config", str(toml))
    assert code == 2, err
    assert f"{toml}: not valid TOML: Invalid value (at line 2, column 6)" in err
    code, err = _refused("--config", str(tmp_path / "absent.toml"))
    assert code == 2 and "absent.toml: cannot read the settings" in err


def test_a_checkpoint_dir_alone_keeps_the_last_step_and_says_so(tmp_path, capsys):
    """--checkpoint-dir without --checkpoint-every saves after the last step
    (it saved nothing), every save is announced with its step, folder and
    time, and --resume on a folder with no checkpoint says it starts fresh."""
    from clawcomm.train import checkpoint_files
    from clawcomm.train.cli import train_rank
    from clawcomm.train.config import TrainConfig

    ck = str(tmp_path / "ck")
    cfg = TrainConfig(model="mlp", hidden=32, quiet=True, checkpoint_dir=ck, resume=True, steps=3)
    train_rank(cfg)
    out = capsys.readouterr().out
    assert f"--resume: no checkpoint in {ck} yet; starting from step 0" in out, out
    assert checkpoint_files.latest(ck) is not None and checkpoint_files.latest(ck).endswith("3")
    assert f"clawcomm train: checkpoint of step 3 saved in {ck}/step-00000003 (" in out, out
    assert " MB, " in out.split("step-00000003 (")[1].splitlines()[0], out
    train_rank(dataclasses.replace(cfg, steps=5))
    out = capsys.readouterr().out
    assert "resumed from step 3" in out and "checkpoint of step 5" in out, out
    assert checkpoint_files.latest(ck).endswith("5")
    train_rank(dataclasses.replace(cfg, steps=6, async_checkpoint=True))  # said when durable
    out = capsys.readouterr().out
    assert "checkpoint of step 6: state copied in " in out, out
    assert f"; {ck}/step-00000006 is written meanwhile" in out, out
    assert f"clawcomm train: checkpoint {ck}/step-00000006 durable (" in out, out
