"""ZeRO-1 and -2 in the trainer (``--zero 1|2``, clawcomm.parallel.zero):
the loss curve, gradient norms and weights of single-process training in
every schedule, with accumulation and with the GPT's embedding tied across
pipeline ranks; 1/dp of the optimizer state per rank, and at stage 2 of the
gradients between steps; checkpoints that resume exactly and load at
another stage and layout."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _training import LAYOUTS, _check_against_reference, _ckpt_config, _config, _run, _train

from clawcomm.launch import RankFailure, run_ranks


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("dp,pp,schedule,v,m", LAYOUTS)
def test_every_layout_and_schedule_trains_like_one_process(dp, pp, schedule, v, m, zero):
    """Reduce-scattered gradients, sharded AdamW steps and all-gathered
    weights give single-process training's losses, clipped norms and
    weights (the embedding, tied across pipeline ranks, stays replicated)."""
    cfg = _config(dp=dp, pp=pp, schedule=schedule, virtual_stages=v, microbatches=m,
                  micro_batch_size=8 // (m * dp), zero=zero)  # fmt: skip
    _check_against_reference(run_ranks(_train, dp * pp, cfg), cfg)


@pytest.mark.parametrize("zero", [1, 2])
def test_accumulation_is_the_same_effective_batch(zero):
    """At stage 2 each accumulation round's gradients are reduce-scattered
    and added into the shards (the combination DeepSpeed refuses)."""
    cfg = _config(dp=2, pp=2, microbatches=2, micro_batch_size=1, accumulation=3, zero=zero)
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
    return held, params, metrics[-1]


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
    ratio = sharded[0][2]["optim_bytes"] / whole[0][2]["optim_bytes"]
    assert abs(ratio - 1 / dp) <= 0.01, (ratio, dp)


@pytest.mark.parametrize("dp", [2, 4])
def test_stage_two_holds_one_dp_th_of_the_gradients_between_steps(dp):
    """ZeRO's formula, within 5%: optimizer state 1/dp of stage 0's at
    stages 1 and 2, gradients 1/dp at stage 2 once reduced (stage 1 keeps
    the full buffers beside the shards); during the step the full buffers
    exist at every stage (grad_peak_bytes)."""
    cfg = _config(model="mlp", hidden=64, dp=dp, microbatches=2, micro_batch_size=4,
                  steps=2)  # fmt: skip
    got = {z: run_ranks(_state_sizes, dp, dataclasses.replace(cfg, zero=z))[0][2] for z in range(3)}
    full = got[0]["grad_bytes"]
    assert got[0]["grad_peak_bytes"] == full
    assert got[1]["grad_bytes"] == pytest.approx(full * (1 + 1 / dp), rel=0.05)
    assert got[2]["grad_bytes"] == pytest.approx(full / dp, rel=0.05)
    assert got[2]["grad_peak_bytes"] >= full
    for z in (1, 2):
        assert got[z]["optim_bytes"] == pytest.approx(got[0]["optim_bytes"] / dp, rel=0.05)


@pytest.mark.parametrize(
    "zero,compression,params,asynchronous",
    [
        (1, "", "none", False),
        (2, "", "none", False),
        (2, "int8", "int8", False),
        (3, "", "none", False),
        (3, "", "int8", True),
    ],
)
def test_a_resumed_run_reproduces_the_uninterrupted_one_bit_for_bit(
    tmp_path, zero, compression, params, asynchronous
):
    """int8's stochastic rounding included (its draws are seeded from the
    checkpointed call counts), and int8 parameters (the float32 masters are
    checkpointed beside the decoded weights); at stage 3, whose parameters
    are gathered for the save, asynchronous saves too."""
    cfg = _ckpt_config(dp=2, pp=2, zero=zero, compression=compression, param_compression=params,
                       async_checkpoint=asynchronous)  # fmt: skip
    whole = run_ranks(_run, 4, cfg, 6, False, timeout=300)[0][0]
    cfg = dataclasses.replace(cfg, checkpoint_dir=str(tmp_path), checkpoint_every=3)
    first = run_ranks(_run, 4, cfg, 3, False, timeout=300)[0][0]
    second = run_ranks(_run, 4, cfg, 6, True, timeout=300)[0][0]
    assert first + second == whole  # the same floats, not merely close


@pytest.mark.parametrize(
    "before,after",
    [
        ((2, 1, 1), (1, 2, 0)),
        ((2, 1, 0), (2, 1, 1)),
        ((2, 2, 1), (4, 1, 1)),
        ((2, 2, 2), (1, 4, 0)),
        ((2, 1, 0), (4, 1, 2)),
        ((2, 2, 3), (1, 4, 0)),
        ((2, 2, 2), (4, 1, 3)),
        ((4, 1, 3), (2, 1, 1)),
    ],
)
def test_a_checkpoint_loads_at_another_stage_and_layout(tmp_path, before, after):
    """Saved at one (dp, pp, zero), loaded at another: the rest of the run
    follows the uninterrupted run at the new layout's float order (the
    optimizer's moments came whole through the checkpoint)."""
    (dp, pp, z), (dp2, pp2, z2) = before, after
    cfg = _ckpt_config(dp=dp, pp=pp, zero=z, micro_batch_size=8 // dp,
                       checkpoint_dir=str(tmp_path), checkpoint_every=3)  # fmt: skip
    run_ranks(_run, dp * pp, cfg, 3, False, timeout=300)
    # The same effective batch (16) at the new layout (1f1b: pp micro-batches at least).
    m2 = max(2, pp2)
    cfg2 = dataclasses.replace(cfg, dp=dp2, pp=pp2, zero=z2, microbatches=m2,
                               micro_batch_size=16 // (m2 * dp2))  # fmt: skip
    resumed = run_ranks(_run, dp2 * pp2, cfg2, 6, True, timeout=300)[0][0]
    whole = run_ranks(_run, dp2 * pp2, dataclasses.replace(cfg2, checkpoint_dir="",
                                                           checkpoint_every=0), 6, False,
                      timeout=300)[0][0]  # fmt: skip
    assert resumed == pytest.approx(whole[3:], rel=1e-5)


class _AllReduceOnly:
    """A compressor of one's own with no reduce-scatter."""

    @staticmethod
    def make(*args, spec):
        import torch.distributed as dist

        from clawcomm.compression import Compressor

        class Plain(Compressor):
            spec = "plainar"

            def all_reduce(self, tensor, state, key, group):
                dist.all_reduce(tensor, group=group)

        return Plain()


def test_zero_with_a_compressor_that_cannot_reduce_scatter_is_refused_before_training():
    from clawcomm.compression import available, register_compressor

    if "plainar" not in available():
        register_compressor("plainar", _AllReduceOnly.make)  # the ranks are forked: they have it
    cfg = _config(dp=2, zero=1, compression="plainar", microbatches=2, micro_batch_size=2)
    with pytest.raises(RankFailure, match="zero 1 with compression 'plainar' is not supported"):
        run_ranks(_train, 2, cfg)


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("wire", ["topk:0.25", "randomk:0.5"])
def test_a_sparse_reduce_scatter_trains_and_sends_fewer_bytes(wire, zero):
    """Top-k (error feedback over the whole bucket) and random-k at stages 2
    and 3: each selected pair goes to the rank whose part holds it
    (all-to-alls, no dense reduce-scatter; random-k's indices are drawn
    alike everywhere, so only values travel); the loss falls as dense
    training's does."""
    cfg = _config(dp=2, microbatches=2, micro_batch_size=2, steps=8, zero=zero, lr=1e-2)
    dense = run_ranks(_train, 2, cfg)[0][0]
    sparse = run_ranks(_train, 2, dataclasses.replace(cfg, compression=wire))[0][0]
    assert sparse[-1]["loss"] < sparse[0]["loss"] * 0.9, [m["loss"] for m in sparse]
    assert sparse[-1]["loss"] == pytest.approx(dense[-1]["loss"], rel=0.1)
    last = sparse[-1]
    assert last["bytes_sent_dp_reduce_scatter"] == 0 and last["bytes_sent_dp_all_to_all"] > 0
    assert last["bytes_sent_dp_all_to_all"] < dense[-1]["bytes_sent_dp_reduce_scatter"]


# wire, the loss's tolerance, the compressed reduce-scatter's bytes against
# the float32 all-gather's (per accumulation round at stage 2).
WIRES = [("fp16", 1e-4, 0.5), ("bf16", 1e-4, 0.5), ("int8", 1e-3, 0.25), ("int4", 1e-2, 0.125)]


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("wire,rel,share", WIRES)
def test_a_compressed_reduce_scatter_trains_like_one_process_within_its_rounding(
    zero, wire, rel, share
):
    """Gradients reduce-scattered with 16 bits on the wire and float32
    accumulation (the engine's ring), or block-quantised to 8 or 4 bits
    through one all-to-all (stochastic rounding, float32 sums): single-
    process training's losses within the wire's rounding, at dp 2 x pp 2
    with two accumulation rounds (each reduce-scattered at stage 2)."""
    from _training import _reference

    cfg = _config(dp=2, pp=2, microbatches=2, micro_batch_size=1, accumulation=2,
                  zero=zero, compression=wire)  # fmt: skip
    losses, _, want = _reference(cfg)
    for metrics, params in run_ranks(_train, 4, cfg):
        assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=rel)
        # AdamW's first steps move a weight by about lr (3e-3) whatever its
        # gradient's size: one that the wire rounds to zero (or, at 8 and 4
        # bits, to the other sign) moves that much less (or the other way).
        atol = 1e-2 if wire in ("fp16", "bf16") else 3e-2
        for n, p in params.items():
            torch.testing.assert_close(p, want[n], atol=atol, rtol=0, msg=n)
        # A share of the all-gather's bytes per reduce-scatter (16, 8 or 4
        # bits against 32; int8/int4 add a scale per block of 256 and pad
        # each part to whole blocks, which this small model's parts feel).
        last = metrics[-1]
        rounds = cfg.accumulation if zero == 2 else 1
        rs = last["bytes_sent_dp_reduce_scatter"] + last["bytes_sent_dp_all_to_all"]
        ag = last["bytes_sent_dp_all_gather"]
        if wire.startswith(("fp", "bf")):
            assert rs == pytest.approx(ag * rounds * share, rel=0.02), (rs, ag)
        else:
            # The all-gathers also carry the replicated (tied) weights' all-
            # reduce, whose second stage gathers int8/int4 codes, not float32:
            # the all-gathers shrink by up to the share, the ratio grows.
            assert ag * rounds * share * 0.9 < rs < ag * rounds * share * 1.45, (rs, ag)


def _grad_bytes_by_action(rank, world, cfg):
    from clawcomm.train import models
    from clawcomm.train.data import global_batches
    from clawcomm.train.trainer import Trainer

    model, loss_fn, make_opt, ds, tokens, sample = models.build(cfg)
    trainer = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    reducer, seen = trainer.reducer, []
    begin = reducer.begin_action

    def spy(action, *args):
        seen.append((trainer.step_index, action.kind, reducer.grad_bytes()))
        begin(action, *args)

    reducer.begin_action = spy
    trainer.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)
    full = sum(b.padded * b.element_size for b in reducer.buckets)
    trainer.close()
    return seen, full


def test_stage_two_holds_no_full_gradient_while_only_forwards_run():
    """gpipe runs every forward before any backward: from step 2 (the
    layout learned) a forward starts with the shards alone, each
    accumulation round's first backward with the full buffers back."""
    cfg = _config(model="mlp", hidden=64, dp=2, schedule="gpipe", microbatches=2,
                  micro_batch_size=2, accumulation=2, steps=3, zero=2)  # fmt: skip
    for seen, full in run_ranks(_grad_bytes_by_action, 2, cfg):
        later = [(kind, held) for step, kind, held in seen if step >= 1]
        forwards = [held for kind, held in later if kind == "F"]
        assert forwards and max(forwards) < 0.6 * full, (forwards, full)
        # Each round's first backward finds the buffers gone (and brings
        # them back), its second finds them there.
        backwards = [held for kind, held in later if kind != "F"]
        assert len(forwards) == len(backwards) == 2 * 2 * 2  # steps x rounds x micro-batches
        assert max(backwards[0::2]) < 0.6 * full <= full <= min(backwards[1::2]), (backwards, full)


def test_the_data_parallel_bytes_are_counted_by_kind_of_collective():
    """bytes_sent_dp by kind: stage 0 all-reduces; stage 1 reduce-scatters
    and all-gathers half each; stage 2 reduce-scatters once per
    accumulation round. Each kind that sent bytes took time (dp_ms_*), the
    others none."""
    cfg = _config(model="mlp", hidden=64, dp=2, microbatches=2, micro_batch_size=2,
                  accumulation=2, steps=3)  # fmt: skip
    kinds = ("reduce_scatter", "all_gather", "all_reduce", "all_to_all")
    got = {}
    for z in range(3):
        metrics = run_ranks(_train, 2, dataclasses.replace(cfg, zero=z))[0][0][-1]
        got[z] = [metrics[f"bytes_sent_dp_{k}"] for k in kinds]
        assert sum(got[z]) == metrics["bytes_sent_dp"], (z, metrics)
        took = [metrics[f"dp_ms_{k}"] > 0 for k in kinds]
        assert took == [b > 0 for b in got[z]], (z, metrics)
    ar = got[0][2]  # (the shards are padded to a multiple of dp: within 1%)
    assert got[0] == [0, 0, ar, 0] and ar > 0
    assert got[1] == pytest.approx([ar / 2, ar / 2, 0, 0], rel=0.01), got
    assert got[2] == pytest.approx([ar, ar / 2, 0, 0], rel=0.01), got


@pytest.mark.parametrize("codec,rel,share", [("fp16", 1e-4, 0.5), ("bf16", 1e-3, 0.5),
                                             ("int8", 5e-3, 0.26)])  # fmt: skip
def test_a_compressed_parameter_all_gather_trains_like_one_process_within_its_rounding(
    codec, rel, share
):
    """qwZ: the all-gather sends fp16, bf16 or int8 weights, every rank
    computes with the decoded ones and steps float32 masters: single-process
    training's losses within the rounding, the weights within a step of the
    codec, and the all-gather's bytes cut by as much."""
    from _training import _reference

    cfg = _config(dp=2, pp=2, microbatches=2, micro_batch_size=2, zero=2)
    dense = run_ranks(_train, 4, cfg)[0][0][-1]["bytes_sent_dp_all_gather"]
    cfg = dataclasses.replace(cfg, param_compression=codec)
    losses, _, want = _reference(cfg)
    for metrics, params in run_ranks(_train, 4, cfg):
        assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=rel)
        atol = {"fp16": 1e-3, "bf16": 1e-2, "int8": 2e-2}[codec]
        for n, p in params.items():
            torch.testing.assert_close(p, want[n], atol=atol, rtol=0, msg=n)
        got = metrics[-1]["bytes_sent_dp_all_gather"]
        assert got == pytest.approx(dense * share, rel=0.05), (got, dense)


def test_a_checkpoint_with_master_weights_loads_without_param_compression(tmp_path):
    """Saved with int8 parameters at zero 1, loaded at zero 0: the masters
    are dropped (the run starts from the decoded weights) and it trains."""
    cfg = _ckpt_config(dp=2, zero=1, param_compression="int8", micro_batch_size=8 // 2,
                       checkpoint_dir=str(tmp_path), checkpoint_every=3)  # fmt: skip
    run_ranks(_run, 2, cfg, 3, False, timeout=300)
    cfg0 = dataclasses.replace(cfg, zero=0, param_compression="none")
    losses = run_ranks(_run, 2, cfg0, 6, True, timeout=300)[0][0]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)


def test_param_compression_without_zero_is_refused_before_training():
    cfg = _config(dp=2, param_compression="int8", microbatches=2, micro_batch_size=2)
    with pytest.raises(RankFailure, match="param_compression 'int8' .* needs zero 1, 2 or 3"):
        run_ranks(_train, 2, cfg)


def test_the_model_state_a_zero_stage_leaves_a_rank():
    # The one rule the planner and bench/zero_memory.py read (the trainer's
    # measured figures are checked against the same fractions above).
    from clawcomm.parallel.zero import model_state_bytes

    assert model_state_bytes(100, 4, 0) == {"param_bytes": 400, "grad_bytes": 400,
                                            "optim_bytes": 800}  # fmt: skip
    assert model_state_bytes(100, 4, 1) == {"param_bytes": 400, "grad_bytes": 500,
                                            "optim_bytes": 200}  # fmt: skip
    assert model_state_bytes(100, 4, 2)["grad_bytes"] == 100
    assert model_state_bytes(100, 4, 3) == {"param_bytes": 100, "grad_bytes": 100,
                                            "optim_bytes": 200}  # fmt: skip
    assert model_state_bytes(100, 1, 3)["param_bytes"] == 400  # one replica shards nothing


def test_a_steps_peak_as_the_trainers_memory_limit_counts_it():
    # the gradients' full buffers beside the parts while a round's backward
    # runs, and at stage 3 the units held whole beside the shards: about two
    # resharding after forward, every one keeping them (docs/zero.md's figures)
    from clawcomm.parallel.zero import step_peak_bytes
    from clawcomm.parallel.zero3 import gathered_bytes

    assert step_peak_bytes(100, 4, 0) == {"param_bytes": 400, "grad_bytes": 400,
                                          "optim_bytes": 800}  # fmt: skip
    assert step_peak_bytes(100, 4, 2)["grad_bytes"] == 500
    units = [40.0, 160.0, 120.0, 80.0]
    assert gathered_bytes(units, True) == 280 and gathered_bytes(units, False) == 400
    peak = step_peak_bytes(100, 2, 3, gathered_bytes(units, False))
    assert sum(peak.values()) == sum(step_peak_bytes(100, 2, 0).values())  # 1.5x, 1.5x, 0.5x
