"""Tensor parallelism in the trainer (``--tp``, clawcomm.parallel.tensor):
single-process training's losses, clipped norms and weights (each rank's
slices of them) at every listed layout, with and without sequence
parallelism and overlap; the refusals; checkpoints across tp; memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _training import _reference
from _training import _train_slices as _train

from clawcomm.launch import run_ranks
from clawcomm.train import TrainConfig, Trainer
from clawcomm.train import models as train_models
from clawcomm.train.data import global_batches

GPT = dict(model="gpt", dim=32, heads=4, layers=2, seq_len=16, lr=3e-3, lr_decay="none",
           clip=0.5, steps=3, quiet=True, microbatches=2, micro_batch_size=4)  # fmt: skip


def _config(**kw) -> TrainConfig:
    return TrainConfig(**{**GPT, **kw})


def _check(results, cfg, rel=1e-5, atol=2e-5):
    """Every rank's loss and norm are one process's; each slice is the
    slice of one process's weights."""
    losses, norms, want = _reference(cfg)
    for metrics, _ in results:
        assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=rel, abs=1e-6)
        assert [m["grad_norm"] for m in metrics] == pytest.approx(norms, rel=10 * rel)
    seen = set()
    for _, params in results:
        for name, (p, split) in params.items():
            whole = want[name]
            expect = split.take(whole) if split is not None else whole
            torch.testing.assert_close(p, expect, atol=atol, rtol=0, msg=name)
            seen.add(name)
    assert seen == set(want)


GPT_LAYOUTS = [  # dp, tp, pp, schedule, v, zero
    (1, 2, 1, "1f1b", 1, 0),
    (1, 4, 1, "1f1b", 1, 0),
    (1, 2, 2, "1f1b", 1, 0),
    (1, 2, 2, "zb1", 1, 0),
    (1, 2, 2, "interleaved", 2, 0),
    (2, 2, 1, "1f1b", 1, 3),
]


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize("dp,tp,pp,schedule,v,zero", GPT_LAYOUTS)
def test_the_gpt_split_trains_like_one_process(dp, tp, pp, schedule, v, zero, sp):
    """Heads, MLP columns and rows, the vocabulary-parallel embedding,
    output and loss, under every schedule (zb1's split W passes), ZeRO-3
    over the data-parallel ranks, sequence parallelism on and off."""
    cfg = _config(dp=dp, tp=tp, pp=pp, schedule=schedule, virtual_stages=v, zero=zero,
                  sequence_parallel=sp, micro_batch_size=4 // dp)  # fmt: skip
    _check(run_ranks(_train, dp * tp * pp, cfg), cfg)


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2), (4, 1)])
def test_overlapped_tensor_parallel_collectives_train_like_one_process(tp, pp):
    """The ring-decomposed all-gathers and reduce-scatters (--tp-overlap)."""
    cfg = _config(tp=tp, pp=pp, tp_overlap=True, schedule="zb1" if pp > 1 else "1f1b")
    _check(run_ranks(_train, tp * pp, cfg), cfg)


def test_tp_with_zero_one_and_accumulation_over_two_replicas():
    """dp 2 x tp 2 at ZeRO 1 (shards of the TP slices), two rounds of
    accumulation."""
    cfg = _config(dp=2, tp=2, zero=1, micro_batch_size=2, accumulation=2)
    _check(run_ranks(_train, 4, cfg), cfg)


@pytest.mark.parametrize("tp,pp,layers", [(2, 1, 4), (2, 2, 4), (4, 1, 3)])
def test_the_mlp_split_trains_like_one_process(tp, pp, layers):
    """Column then row layers (an odd last one whole), across stages too."""
    cfg = _config(model="mlp", hidden=32, layers=layers, tp=tp, pp=pp)
    _check(run_ranks(_train, tp * pp, cfg), cfg)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_waiting_model_exchanges_a_layer_pairs_bytes(overlap):
    """Each waiting layer's forward and input-gradient pass all-gather and
    reduce-scatter a [micro-batch, seq_len, width] activation: 2 x 2 x
    (tp-1)/tp of it per layer and micro-batch, on each rank, each message
    with the engine's header of at most 64 bytes."""
    cfg = _config(model="wait", layers=2, wait_ms="1,1,1", wait_width=64, tp=2, steps=2,
                  tp_overlap=overlap)  # fmt: skip
    results = run_ranks(_train, 2, cfg)
    per_rank = 2 * 2 * cfg.micro_batch_size * cfg.seq_len * 64 * 4 // 2
    expect = per_rank * cfg.layers * cfg.microbatches * 2  # two ranks
    headers = 64 * 4 * cfg.layers * cfg.microbatches * 2
    for metrics, _ in results:
        assert expect <= metrics[-1]["bytes_sent_tp"] <= expect + headers
        assert metrics[-1]["tp_ms"] > 0


def test_reruns_of_one_layout_are_bitwise_equal():
    cfg = _config(tp=2, pp=2, schedule="zb1")
    a, b = run_ranks(_train, 4, cfg), run_ranks(_train, 4, cfg)
    assert [m["loss"] for m in a[0][0]] == [m["loss"] for m in b[0][0]]
    for (_, pa), (_, pb) in zip(a, b, strict=True):
        for n in pa:
            assert torch.equal(pa[n][0], pb[n][0]), n


def test_parameters_and_optimizer_state_are_one_tp_th_but_the_replicated_ones():
    """Memory per rank: the split parameters at 1/tp of tp 1's; what stays
    whole (LayerNorms, row-parallel biases, positions) on every rank."""
    one = _config(steps=2)  # (the optimizer's state exists from step 2)
    two = dataclasses.replace(one, tp=2)
    whole = run_ranks(_train, 1, one)[0][1]
    halves = run_ranks(_train, 2, two)
    total = sum(p.numel() for p, _ in whole.values())
    replicated = sum(p.numel() for p, s in halves[0][1].values() if s is None)
    mine = [sum(p.numel() for p, _ in params.values()) for _, params in halves]
    for n in mine:  # (the vocabulary splits unevenly: one row apart)
        assert n == pytest.approx((total - replicated) / 2 + replicated, abs=one.dim)
    assert replicated < 0.1 * total
    metrics = halves[0][0][-1]  # (the rank holding the most)
    assert metrics["param_bytes"] == max(mine) * 4
    assert metrics["optim_bytes"] >= 2 * max(mine) * 4  # AdamW's two moments of the slices
    assert metrics["optim_bytes"] < 2 * total * 4 * 0.6


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(tp=3, heads=4), "heads 4 is not a multiple of tp 3"),
        (dict(tp=2, seq_len=15), "seq_len 15 is not a multiple of tp 2"),
        (dict(tp=2, model="mlp", sequence_parallel=True), "the mlp has none"),
        (dict(tp=2, sequence_parallel=False, tp_overlap=True), "needs sequence_parallel"),
    ],
)
def test_a_split_the_plan_cannot_make_is_refused_naming_the_flag(kw, words):
    with pytest.raises(ValueError, match=words):
        _config(**kw).check(kw["tp"])


def test_the_world_must_be_dp_times_tp_times_pp():
    with pytest.raises(ValueError, match=r"dp \* tp \* pp = 1 \* 2 \* 2 = 4 ranks"):
        _config(tp=2, pp=2).check(2)


def test_the_cli_refuses_a_bad_split_before_any_rank_starts(capsys):
    from clawcomm.train.cli import main

    assert main(["--tp", "3", "--heads", "4", "--steps", "1", "--quiet"]) == 2
    assert "heads 4 is not a multiple of tp 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "saved,loaded",
    [
        (dict(tp=2), dict()),
        (dict(), dict(tp=4)),
        (dict(tp=2), dict(tp=4, pp=1)),
        (dict(tp=4), dict(tp=2, pp=2, zero=0)),
    ],  # fmt: skip
)
def test_a_checkpoint_loads_at_another_tp(tmp_path, saved, loaded):
    """Saved at one tp after 2 steps, loaded at another: the run goes on as
    one process's does (same global batch, whole-model names)."""
    a = _config(steps=4, **saved)
    first = dataclasses.replace(a, steps=2)
    run_ranks(_train, a.world, first, str(tmp_path))
    b = _config(steps=4, **loaded)
    results = run_ranks(_train, b.world, b, None, str(tmp_path))
    losses, _, _ = _reference(_config(steps=4))
    for metrics, _ in results:
        assert [m["loss"] for m in metrics] == pytest.approx(losses[2:], rel=1e-5)


def test_resuming_at_the_same_layout_is_exact(tmp_path):
    cfg = _config(tp=2, pp=2, steps=4)
    straight = run_ranks(_train, 4, cfg)
    run_ranks(_train, 4, dataclasses.replace(cfg, steps=2), str(tmp_path))
    resumed = run_ranks(_train, 4, cfg, None, str(tmp_path))
    assert [m["loss"] for m in resumed[0][0]] == [m["loss"] for m in straight[0][0]][2:]
    for (_, pa), (_, pb) in zip(straight, resumed, strict=True):
        for n in pa:
            assert torch.equal(pa[n][0], pb[n][0]), n


def test_a_stock_dcp_reader_sees_whole_tensors(tmp_path):
    """torch's own dcp_to_torch_save turns a tp 2 checkpoint into whole
    tensors by the whole model's names (qkv's three pieces per rank
    joined)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    cfg = _config(tp=2, steps=1)
    results = run_ranks(_train, 2, cfg, str(tmp_path / "ck"))
    ck = next(p for p in (tmp_path / "ck").iterdir() if p.name.startswith("step-"))
    dcp_to_torch_save(str(ck), str(tmp_path / "whole.pt"))
    sd = torch.load(tmp_path / "whole.pt", weights_only=False)
    for _, params in results:
        for name, (p, split) in params.items():
            whole = sd[f"model/{name}"]
            assert list(whole.shape) == (list(split.whole) if split else list(p.shape))
            torch.testing.assert_close(split.take(whole) if split else whole, p)


@pytest.mark.parametrize("overlap", [False, True])
def test_tp_runs_on_gloo_too(overlap):
    """The split layers use torch.distributed's collectives and sends as any
    backend takes them (gloo checks the all-gather's and reduce-scatter's
    leading dimension against the world)."""
    cfg = _config(tp=2, tp_overlap=overlap)
    _check(run_ranks(_train, 2, cfg, backend="gloo"), cfg)


def _train_saving(rank, world, cfg, root, asynchronous):
    """Trains cfg.steps steps, saving (asynchronously if asked) at the end;
    returns the losses."""
    model, loss_fn, make_opt, ds, tokens, sample = train_models.build(cfg)
    tr = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    metrics = tr.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)
    tr.save_checkpoint(root, asynchronous=asynchronous)
    tr.wait_checkpoint()
    tr.close()
    return [m["loss"] for m in metrics]


@pytest.mark.parametrize(
    "kw",
    [dict(compression="fp16"), dict(compression="topk:0.1"), dict(sync="diloco:2")],
    ids=["fp16", "topk-residual", "diloco"],
)
def test_compression_and_outer_sync_act_on_each_tp_ranks_data_parallel_traffic(tmp_path, kw):
    """dp 2 x tp 2 with a compressed wire (fp16; top-k with its
    error-feedback residual) or DiLoCo: the replicas exchange their slices.
    fp16 rounds each element as at tp 1 and DiLoCo is exact, so both train as
    dp 2 x tp 1 does; top-k picks among a slice's elements, not the whole
    tensor's, so it trains as itself. Each saves (asynchronously: DCP's
    staging copies the pieces) and resumes at the same layout exactly."""
    cfg = _config(dp=2, tp=2, steps=4, micro_batch_size=2, **kw)
    straight = run_ranks(_train, 4, cfg)
    if "topk" not in kw.get("compression", ""):
        one = run_ranks(_train, 2, dataclasses.replace(cfg, tp=1))
        got = [m["loss"] for m in straight[0][0]]
        assert got == pytest.approx([m["loss"] for m in one[0][0]], rel=1e-3)
    root = str(tmp_path / "ck")
    run_ranks(_train_saving, 4, dataclasses.replace(cfg, steps=2), root, True)
    resumed = run_ranks(_train, 4, cfg, None, root)
    assert [m["loss"] for m in resumed[0][0]] == [m["loss"] for m in straight[0][0]][2:]
    if "compression" in kw:  # the residuals (per TP rank where a parameter is whole) at tp 1
        other = run_ranks(_train, 2, dataclasses.replace(cfg, tp=1), None, root)
        losses = [m["loss"] for m in other[0][0]]
        assert losses == pytest.approx([m["loss"] for m in straight[0][0]][2:], rel=2e-2)


def _held_out(rank, world, cfg):
    model, loss_fn, make_opt, ds, tokens, sample = train_models.build(cfg)
    tr = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    tr.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)
    batches = global_batches(ds, cfg.effective_batch, cfg.seed + 1)
    loss = tr.evaluate(next(batches) for _ in range(2))
    tr.close()
    return loss


def test_the_held_out_loss_counts_each_replica_once_at_any_tp():
    """``Trainer.evaluate``: every TP rank of a last stage has the loss; it
    is counted once."""
    cfg = _config(steps=2)
    one = run_ranks(_held_out, 1, cfg)[0]
    for kw in (dict(tp=2), dict(tp=2, pp=2), dict(dp=2, tp=2, micro_batch_size=2)):
        got = run_ranks(_held_out, 2 * kw.get("pp", 1) * kw.get("dp", 1), _config(steps=2, **kw))
        assert got == pytest.approx([one] * len(got), rel=1e-5), kw
