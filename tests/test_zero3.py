"""ZeRO-3 in the trainer (``--zero 3``, clawcomm.parallel.zero3): single-
process training's losses, norms and weights in every layout and schedule,
with and without ``reshard_after_forward``, with accumulation and with
compressed gradients and parameters; parameters held as 1/dp between steps
and gathered layer by layer during them. (Checkpoints that resume exactly
and load at other stages and layouts, stage 3 included: test_zero.py.)"""

from __future__ import annotations

import argparse
import dataclasses
import re

import _training
import pytest
import torch
from _training import _check_against_reference, _config, _reference, _train

from clawcomm.launch import RankFailure, run_ranks
from clawcomm.train.config import TrainConfig
from clawcomm.train.flags import add_arguments, from_args

# The ZeRO layouts, and one micro-batch per round (FSDP's case) and gpipe at pp 1.
LAYOUTS = [*_training.LAYOUTS, (2, 1, "1f1b", 1, 1), (2, 1, "gpipe", 1, 4)]


@pytest.mark.parametrize("reshard", [False, True])
@pytest.mark.parametrize("dp,pp,schedule,v,m", LAYOUTS)
def test_every_layout_and_schedule_trains_like_one_process(dp, pp, schedule, v, m, reshard):
    """Layers gathered as the schedule needs them (kept across the round's
    micro-batches, or freed after every forward and regathered in backward)
    give single-process training's losses, clipped norms and weights; the
    GPT's tied embedding is shared by two layers of one stage (pp 1) or
    replicated across pipeline ranks (pp 2)."""
    cfg = _config(dp=dp, pp=pp, schedule=schedule, virtual_stages=v, microbatches=m,
                  micro_batch_size=8 // (m * dp), zero=3,
                  reshard_after_forward=reshard)  # fmt: skip
    _check_against_reference(run_ranks(_train, dp * pp, cfg), cfg)


def test_accumulation_is_the_same_effective_batch():
    cfg = _config(dp=2, pp=2, microbatches=2, micro_batch_size=1, accumulation=3, zero=3,
                  reshard_after_forward=True)  # fmt: skip
    _check_against_reference(run_ranks(_train, 4, cfg), cfg)


def _held(rank, world, cfg):
    """Every step's metrics and the model's size."""
    from clawcomm.train import models
    from clawcomm.train.data import global_batches
    from clawcomm.train.trainer import Trainer

    model, loss_fn, make_opt, ds, tokens, sample = models.build(cfg)
    trainer = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    metrics = trainer.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)
    whole = sum(p.numel() * p.element_size() for p in trainer.params)
    trainer.close()
    return metrics, whole


@pytest.mark.parametrize("dp", [2, 4])
def test_parameters_are_one_dp_th_between_uses_and_gathered_by_layer(dp):
    """An MLP of five equal layers and a small head: once the step's
    backward is done a rank holds 1/dp of the parameters (its shards);
    during every step, the first included, about two layers (the one
    computing and the one prefetched) beside the shards by default at pp 1
    (resharding after forward) or, keeping them across micro-batches
    (``reshard_after_forward=False``), every layer."""
    cfg = _config(model="mlp", hidden=64, layers=6, dp=dp, microbatches=2, micro_batch_size=4,
                  steps=3, zero=3)  # fmt: skip
    for metrics, whole in run_ranks(_held, dp, cfg):
        for m in metrics:
            assert m["param_bytes"] == pytest.approx(whole / dp, rel=0.02), (m, whole)
            assert m["param_peak_bytes"] < whole * (0.5 + 1 / dp), (m, whole)
    keep = dataclasses.replace(cfg, reshard_after_forward=False)
    for metrics, whole in run_ranks(_held, dp, keep):
        for m in metrics:
            assert m["param_bytes"] == pytest.approx(whole / dp, rel=0.02), (m, whole)
            assert m["param_peak_bytes"] == pytest.approx(whole * (1 + 1 / dp), rel=0.02)
    # Gradients as at stage 2, the optimizer state as at stages 1 and 2 (a
    # bucket per layer: more padding, a step count per shard).
    two = run_ranks(_held, dp, dataclasses.replace(cfg, zero=2))[0][0][-1]
    got = run_ranks(_held, dp, cfg)[0][0][-1]
    for key in ("grad_bytes", "optim_bytes"):
        assert got[key] == pytest.approx(two[key], rel=0.01), key
    assert two["param_peak_bytes"] == two["param_bytes"] == pytest.approx(whole, rel=0.01)


def test_the_first_step_holds_no_whole_model_and_none_is_over_a_limit_that_fits_shards():
    """Issue 59: a model that fits a rank only sharded trains from its first
    step. An MLP of 20 layers (0.32 MB of parameters) at dp 4, SGD without
    momentum (no optimizer state: each step holds what the first does): at
    stage 0 a rank holds 0.64 MB (its parameters and gradients whole) and
    stops at step 1 under a 0.57 MB limit; at stage 3, by default, at most
    0.51 MB: its shard and about two layers of parameters in every step
    (the first's relayout onto the learned bucket order included), and the
    gradients whole once in the first step (counted before any is known
    final, as at stage 0), their parts and a round's full buffers after.
    (The first step once held the whole model beside the shards: 0.80 MB.)"""
    cfg = _config(model="mlp", hidden=64, layers=20, dp=4, microbatches=2, micro_batch_size=2,
                  optimizer="sgd", momentum=0.0, steps=3, max_memory_mb=0.57)  # fmt: skip
    with pytest.raises(RankFailure) as e:
        run_ranks(_train, 4, cfg)
    for text in e.value.errors.values():  # every rank, the same error
        assert re.search(r"stopped at step 1: rank \d held 0.64 MB .* max_memory_mb 0.57", text)
    runs = run_ranks(_held, 4, dataclasses.replace(cfg, zero=3))
    layer = 64 * 65 * 4
    for metrics, whole in runs:
        assert len(metrics) == 3
        first = metrics[0]
        assert first["param_peak_bytes"] < whole / 4 + 2.5 * layer < whole, (first, whole)
        assert first["grad_peak_bytes"] < whole * 1.02, (first, whole)
        for m in metrics:
            assert m["param_peak_bytes"] < whole / 4 + 2.5 * layer, (m, whole)


@pytest.mark.parametrize("wire,codec", [("int8", "int8"), ("bf16", "fp16")])
def test_compressed_gradients_and_parameters_train_like_one_process_within_their_rounding(
    wire, codec
):
    """qgZ and qwZ at stage 3: block-quantised (or 16-bit) gradients in the
    reduce-scatter, quantised weights in every layer's gather."""
    cfg = _config(dp=2, pp=2, microbatches=2, micro_batch_size=2, zero=3, compression=wire,
                  param_compression=codec, reshard_after_forward=True)  # fmt: skip
    losses, _, want = _reference(cfg)
    for metrics, params in run_ranks(_train, 4, cfg):
        assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=5e-3)
        for n, p in params.items():
            torch.testing.assert_close(p, want[n], atol=3e-2, rtol=0, msg=n)


def test_reshard_after_forward_without_zero_three_is_refused_before_training():
    cfg = _config(dp=2, zero=2, reshard_after_forward=True, microbatches=2, micro_batch_size=2)
    with pytest.raises(RankFailure, match="reshard_after_forward .* needs zero 3, not zero 2"):
        run_ranks(_train, 2, cfg)


def test_resharding_after_forward_is_the_default_at_pp_one_only(tmp_path):
    """One rule, ``TrainConfig.reshards_after_forward``: on at stage 3 with
    pp 1, off at pp > 1 (every micro-batch of a round uses every layer) and
    below stage 3; the flags and a config file's key say otherwise."""
    assert TrainConfig(dp=2, zero=3).reshards_after_forward
    assert not TrainConfig(dp=2, pp=2, zero=3).reshards_after_forward
    assert not TrainConfig(dp=2, zero=2).reshards_after_forward
    assert dataclasses.replace(TrainConfig(dp=2), zero=3).reshards_after_forward
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = lambda *a: from_args(parser.parse_args(["--zero", "3", *a]))  # noqa: E731
    assert flags().reshard_after_forward is None and flags().reshards_after_forward
    assert not flags("--no-reshard-after-forward").reshards_after_forward
    assert flags("--pp", "2", "--reshard-after-forward").reshards_after_forward
    toml = tmp_path / "run.toml"
    toml.write_text("reshard-after-forward = false\n")
    assert not from_args(parser.parse_args(["--zero", "3"]), str(toml)).reshards_after_forward
    assert "on at pp 1" in " ".join(parser.format_help().split())
