"""ZeRO-3 in the trainer (``--zero 3``, clawcomm.parallel.zero3): single-
process training's losses, norms and weights in every layout and schedule,
with and without ``reshard_after_forward``, with accumulation and with
compressed gradients and parameters; parameters held as 1/dp between steps
and gathered layer by layer during them. (Checkpoints that resume exactly
and load at other stages and layouts, stage 3 included: test_zero.py.)"""

from __future__ import annotations

import dataclasses
import re

import _training
import pytest
import torch
from _training import _check_against_reference, _config, _reference, _train

from clawcomm.launch import RankFailure, run_ranks

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
    """The last step's metrics and the model's size."""
    from clawcomm.train import models
    from clawcomm.train.data import global_batches
    from clawcomm.train.trainer import Trainer

    model, loss_fn, make_opt, ds, tokens, sample = models.build(cfg)
    trainer = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    metrics = trainer.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)
    whole = sum(p.numel() * p.element_size() for p in trainer.params)
    trainer.close()
    return metrics[-1], whole


@pytest.mark.parametrize("dp", [2, 4])
def test_parameters_are_one_dp_th_between_uses_and_gathered_by_layer(dp):
    """An MLP of five equal layers and a small head: once the step's
    backward is done a rank holds 1/dp of the parameters (its shards);
    during the step at most every layer (kept across micro-batches) or,
    resharding after forward, about two layers (the one computing and the
    one prefetched) beside the shards."""
    cfg = _config(model="mlp", hidden=64, layers=6, dp=dp, microbatches=2, micro_batch_size=4,
                  steps=3, zero=3)  # fmt: skip
    for m, whole in run_ranks(_held, dp, cfg):
        assert m["param_bytes"] == pytest.approx(whole / dp, rel=0.02), (m, whole)
        assert m["param_peak_bytes"] == pytest.approx(whole * (1 + 1 / dp), rel=0.02), (m, whole)
    for m, whole in run_ranks(_held, dp, dataclasses.replace(cfg, reshard_after_forward=True)):
        assert m["param_bytes"] == pytest.approx(whole / dp, rel=0.02), (m, whole)
        assert m["param_peak_bytes"] < whole * (0.5 + 1 / dp), (m, whole)
    # Gradients as at stage 2, the optimizer state as at stages 1 and 2 (a
    # bucket per layer: more padding, a step count per shard).
    two = run_ranks(_held, dp, dataclasses.replace(cfg, zero=2))[0][0]
    got = run_ranks(_held, dp, cfg)[0][0]
    for key in ("grad_bytes", "optim_bytes"):
        assert got[key] == pytest.approx(two[key], rel=0.01), key
    assert two["param_peak_bytes"] == two["param_bytes"] == pytest.approx(whole, rel=0.01)


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


def test_a_model_over_the_memory_limit_at_stage_zero_trains_at_stage_three():
    """An MLP whose parameters, gradients and AdamW state take 0.34 MB per
    rank at stage 0 stops every rank at a 0.3 MB limit, naming the figures;
    at stage 3 (dp 2, resharding after forward) it holds 0.26 MB at most and
    trains."""
    cfg = _config(model="mlp", hidden=64, layers=6, dp=2, microbatches=1, micro_batch_size=8,
                  steps=3, max_memory_mb=0.3)  # fmt: skip
    with pytest.raises(RankFailure) as e:
        run_ranks(_train, 2, cfg)
    message = r"stopped at step 2: rank \d held 0.34 MB .* over max_memory_mb 0.3"
    assert len(e.value.errors) == 2, e.value  # every rank, the same error
    for text in e.value.errors.values():
        assert re.search(message, text), text
    sharded = dataclasses.replace(cfg, zero=3, reshard_after_forward=True)
    metrics = run_ranks(_train, 2, sharded)[0][0]
    assert len(metrics) == 3
