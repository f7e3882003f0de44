"""Activation checkpointing (``--activation-checkpoint``, train/recompute.py):
single-process training's losses, norms and weights with each mode, under
every schedule (zero-bubble's split I/W passes recompute once), with ZeRO-3
regathering a layer for its recomputation, and with tensor parallelism; the
refusal of selective on models without attention."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _training import _check_against_reference, _config, _train

from clawcomm.launch import run_ranks
from clawcomm.train import models
from clawcomm.train.recompute import apply


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(dp=1, pp=1),
        dict(dp=1, pp=2, schedule="zb1"),
        dict(dp=1, pp=2, schedule="interleaved", virtual_stages=2, layers=4),
        dict(dp=2, pp=1, zero=3, reshard_after_forward=True, micro_batch_size=2),
    ],
    ids=["pp1", "zb1", "interleaved", "zero3"],
)
def test_each_mode_trains_like_one_process(mode, kw):
    """Losses and norms are single-process training's; the weights are the
    same layout's without recomputation, bit for bit (recomputing replays
    the same operations). Against one process the weights match only to
    the rounding of a different summation order, which AdamW magnifies
    where a gradient is near its eps (one element of 2.fc.weight at
    1.6e-5 at dp 2 here, beyond 2e-5 on another CPU): test_zero3 and
    test_train hold that comparison for each layout."""
    cfg = _config(activation_checkpoint=mode, microbatches=4, **kw)
    results = run_ranks(_train, cfg.world, cfg)
    _check_against_reference(results, cfg, atol=float("inf"))
    plain = run_ranks(_train, cfg.world, replace(cfg, activation_checkpoint="none"))
    for (_, got), (_, want) in zip(results, plain, strict=True):
        assert got.keys() == want.keys()
        for n in got:
            assert torch.equal(got[n], want[n]), n


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_under_tensor_parallelism_gives_the_same_losses(mode):
    """tp 2 x pp 2 with zb1, sequence parallel: the recomputed forward makes
    its collectives again, on every TP rank alike."""
    from test_tensor_parallel import _check
    from test_tensor_parallel import _config as tp_config
    from test_tensor_parallel import _train as tp_train

    cfg = tp_config(tp=2, pp=2, schedule="zb1", activation_checkpoint=mode)
    _check(run_ranks(tp_train, 4, cfg), cfg)


def test_gradients_are_identical_and_fewer_activations_are_kept():
    """One process: each mode's gradients equal no recomputation's bit for
    bit; after the forward, selective keeps fewer activation bytes alive,
    full fewer still."""
    from clawcomm.train.recompute import LiveActivations

    x = torch.randint(0, 50, (4, 32), generator=torch.Generator().manual_seed(0))

    def run(mode):
        torch.manual_seed(0)
        m = models.gpt(50, 64, 2, 4, 32)
        apply(m, mode)
        with LiveActivations() as counter:
            loss = models.gpt_loss(m(x), x)
        kept = counter.live
        loss.backward()
        return [p.grad for p in m.parameters()], kept

    (none, a), (sel, b), (full, c) = run("none"), run("selective"), run("full")
    for g0, g1, g2 in zip(none, sel, full, strict=True):
        assert torch.equal(g0, g1) and torch.equal(g0, g2)
    assert c < 0.5 * a and c < b < 0.85 * a, (a, b, c)


def test_selective_needs_the_gpt():
    with pytest.raises(ValueError, match="the mlp model has neither"):
        _config(model="mlp", activation_checkpoint="selective").check(1)
