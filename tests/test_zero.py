"""ZeRO-1 in the trainer (``--zero 1``, clawcomm.parallel.zero): the loss
curve, gradient norms and weights of single-process training in every
schedule, with accumulation and with the GPT's embedding tied across
pipeline ranks; 1/dp of the optimizer state per rank; checkpoints that
resume exactly and load at another stage and layout."""

from __future__ import annotations

import dataclasses

import pytest
from _training import _check_against_reference, _config, _run, _train

from clawcomm.testing import RankFailure, run_ranks
from clawcomm.train import TrainConfig

LAYOUTS = [
    # dp, pp, schedule, v, micro-batches
    (2, 1, "1f1b", 1, 4),
    (2, 2, "gpipe", 1, 4),
    (2, 2, "1f1b", 1, 4),
    (2, 2, "zb1", 1, 4),
    (2, 2, "interleaved", 2, 4),
    (4, 1, "1f1b", 1, 2),
]


@pytest.mark.parametrize("dp,pp,schedule,v,m", LAYOUTS)
def test_every_layout_and_schedule_trains_like_one_process(dp, pp, schedule, v, m):
    """Reduce-scattered gradients, sharded AdamW steps and all-gathered
    weights give single-process training's losses, clipped norms and
    weights (the embedding, tied across pipeline ranks, stays replicated)."""
    cfg = _config(dp=dp, pp=pp, schedule=schedule, virtual_stages=v, microbatches=m,
                  micro_batch_size=8 // (m * dp), zero=1)  # fmt: skip
    _check_against_reference(run_ranks(_train, dp * pp, cfg), cfg)


def test_accumulation_is_the_same_effective_batch():
    cfg = _config(dp=2, pp=2, microbatches=2, micro_batch_size=1, accumulation=2, zero=1)
    _check_against_reference(run_ranks(_train, 4, cfg), cfg)


def _state_sizes(rank, world, cfg):
    from clawcomm.train import models
    from clawcomm.train.data import global_batches
    from clawcomm.train.trainer import Trainer

    model, loss_fn, make_opt, ds, tokens, sample = models.build(cfg)
    trainer = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    metrics = trainer.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)
    held = sum(
        v.numel() for s in trainer.optimizer.state.values() for v in s.values() if v.dim() > 0
    )
    params = sum(p.numel() for p in trainer.params)
    trainer.close()
    return held, params, metrics[-1]["optim_bytes"]


@pytest.mark.parametrize("dp", [2, 4])
def test_each_rank_holds_one_dp_th_of_the_optimizer_state(dp):
    """AdamW keeps two moments per parameter: under ZeRO-1 a rank holds
    2/dp of them (within the padding of each bucket to a multiple of dp)."""
    cfg = _config(model="mlp", hidden=64, dp=dp, microbatches=2, micro_batch_size=4,
                  steps=2, zero=1)  # fmt: skip
    sharded = run_ranks(_state_sizes, dp, cfg)
    for held, params, _ in sharded:
        assert 2 * params / dp <= held <= 2 * params / dp + 2 * 16 * dp, (held, params, dp)
    whole = run_ranks(_state_sizes, dp, dataclasses.replace(cfg, zero=0))
    for held, params, _ in whole:
        assert held == 2 * params, (held, params)
    # The step's metrics say so too (optim_bytes: the rank that holds the
    # most; Adam's step counts, one per tensor, make the difference).
    ratio = sharded[0][2] / whole[0][2]
    assert abs(ratio - 1 / dp) <= 0.01, (ratio, dp)


def _ckpt_config(**kw) -> TrainConfig:
    base = dict(model="mlp", hidden=32, steps=6, microbatches=2, micro_batch_size=4,
                quiet=True, lr_decay="none")  # fmt: skip
    return TrainConfig(**{**base, **kw})


def test_a_resumed_run_reproduces_the_uninterrupted_one_bit_for_bit(tmp_path):
    cfg = _ckpt_config(dp=2, pp=2, zero=1)
    whole = run_ranks(_run, 4, cfg, 6, False, timeout=300)[0][0]
    cfg = dataclasses.replace(cfg, checkpoint_dir=str(tmp_path), checkpoint_every=3)
    first = run_ranks(_run, 4, cfg, 3, False, timeout=300)[0][0]
    second = run_ranks(_run, 4, cfg, 6, True, timeout=300)[0][0]
    assert first + second == whole  # the same floats, not merely close


@pytest.mark.parametrize(
    "before,after",
    [((2, 1, 1), (1, 2, 0)), ((2, 1, 0), (2, 1, 1)), ((2, 2, 1), (4, 1, 1))],
)
def test_a_checkpoint_loads_at_another_stage_and_layout(tmp_path, before, after):
    """Saved at one (dp, pp, zero), loaded at another: the rest of the run
    follows the uninterrupted run at the new layout's float order (the
    optimizer's moments came whole through the checkpoint)."""
    (dp, pp, z), (dp2, pp2, z2) = before, after
    cfg = _ckpt_config(dp=dp, pp=pp, zero=z, micro_batch_size=8 // dp,
                       checkpoint_dir=str(tmp_path), checkpoint_every=3)  # fmt: skip
    run_ranks(_run, dp * pp, cfg, 3, False, timeout=300)
    # The same effective batch (16) at the new layout.
    cfg2 = dataclasses.replace(cfg, dp=dp2, pp=pp2, zero=z2, micro_batch_size=8 // dp2)
    resumed = run_ranks(_run, dp2 * pp2, cfg2, 6, True, timeout=300)[0][0]
    whole = run_ranks(_run, dp2 * pp2, dataclasses.replace(cfg2, checkpoint_dir="",
                                                           checkpoint_every=0), 6, False,
                      timeout=300)[0][0]  # fmt: skip
    assert resumed == pytest.approx(whole[3:], rel=1e-5)


def test_zero_with_compression_is_refused_before_training():
    cfg = _config(dp=2, zero=1, compression="fp16", microbatches=2, micro_batch_size=2)
    with pytest.raises(RankFailure, match="zero 1 with compression 'fp16' is not supported yet"):
        run_ranks(_train, 2, cfg)
