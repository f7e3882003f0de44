"""Training against single-process training, shared by the trainer's tests:
the same seed and effective batch in one process (``_reference``) and on
ranks (``_train``), compared loss by loss, norm by norm and weight by
weight (``_check_against_reference``)."""

from __future__ import annotations

import pytest
import torch

from clawcomm.train import TrainConfig, Trainer
from clawcomm.train import models as train_models
from clawcomm.train.data import global_batches

STEPS = 3
GPT = dict(model="gpt", dim=32, heads=2, layers=2, seq_len=16, lr=3e-3, lr_decay="none",
           clip=0.5, steps=STEPS, quiet=True)  # fmt: skip


def _config(**kw) -> TrainConfig:
    return TrainConfig(**{**GPT, **kw})


# The layouts the ZeRO tests sweep: dp, pp, schedule, v, micro-batches.
LAYOUTS = [
    (2, 1, "1f1b", 1, 4),
    (2, 2, "gpipe", 1, 4),
    (2, 2, "1f1b", 1, 4),
    (2, 2, "zb1", 1, 4),
    (2, 2, "interleaved", 2, 4),
    (4, 1, "1f1b", 1, 2),
]


def _ckpt_config(**kw) -> TrainConfig:
    """The small MLP the checkpoint tests save and load."""
    base = dict(model="mlp", hidden=32, steps=6, microbatches=2, micro_batch_size=4,
                quiet=True, lr_decay="none")  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _reference(cfg: TrainConfig):
    """Plain single-process training on the whole effective batch: mean
    loss over every item, torch's clip_grad_norm_, the optimizer."""
    model, loss_fn, make_opt, ds, _, _ = train_models.build(cfg)
    params = list({id(p): p for p in model.parameters()}.values())
    opt = make_opt(params)
    losses, norms = [], []
    for _, (x, y) in zip(
        range(cfg.steps), global_batches(ds, cfg.effective_batch, cfg.seed), strict=False
    ):
        loss = loss_fn(model(x), y) / y.numel()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip if cfg.clip > 0 else float("inf"))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(float(norm))
    first = {}  # a tied parameter goes by its first name, as in Trainer.names
    for n, p in model.named_parameters():
        first[n] = p.detach().clone()
    return losses, norms, first


def _train(rank, world, cfg):
    model, loss_fn, make_opt, ds, tokens, sample = train_models.build(cfg)
    trainer = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    metrics = trainer.fit(global_batches(ds, cfg.effective_batch, cfg.seed), progress=False)
    with trainer.whole_params():  # (ZeRO-3 holds shards between steps)
        params = {trainer.names[id(p)]: p.detach().clone() for p in trainer.params}
    trainer.close()
    return metrics, params


def _train_slices(rank, world, cfg, checkpoint=None, load=None):
    """Trains (from ``load``'s checkpoint, if given) to ``cfg.steps``, saves
    to ``checkpoint`` if given; returns the metrics and this rank's
    parameters by name as (tensor, how it is split: a tensor- or
    expert-parallel slice, or None)."""
    from clawcomm.parallel.split import split_of

    model, loss_fn, make_opt, ds, tokens, sample = train_models.build(cfg)
    tr = Trainer(model, loss_fn, make_opt, cfg, tokens_per_sample=tokens, sample=sample)
    start = tr.load_checkpoint(load) if load else 0
    batches = global_batches(ds, cfg.effective_batch, cfg.seed, start=start)
    metrics = tr.fit(batches, steps=cfg.steps - start, progress=False)
    if checkpoint:
        tr.save_checkpoint(checkpoint)
    with tr.whole_params():
        params = {tr.names[id(p)]: (p.detach().clone(), split_of(p)) for p in tr.params}
    tr.close()
    return metrics, params


def _check_against_reference(results, cfg, atol=2e-5):
    losses, norms, want = _reference(cfg)
    for metrics, _ in results:
        assert [m["loss"] for m in metrics] == pytest.approx(losses, rel=1e-5, abs=1e-6)
        assert [m["grad_norm"] for m in metrics] == pytest.approx(norms, rel=1e-4)
    got = {}
    for _, params in results:
        for n, p in params.items():
            if n in got:  # held by several ranks (replicas, tied stages): all equal
                torch.testing.assert_close(p, got[n], atol=atol, rtol=0, msg=_named(n))
            got[n] = p
    assert sorted(got) == sorted(want)
    for n, p in got.items():
        torch.testing.assert_close(p, want[n], atol=atol, rtol=0, msg=_named(n))


def _named(name):
    """assert_close's message with the parameter's name before it (the
    mismatch's size stays in the report)."""
    return lambda message: f"{name}: {message}"


def _run(rank, n, cfg, stop, resume):
    """Trains to step `stop` (resuming from cfg.checkpoint_dir if asked);
    returns the losses and this rank's parameters by name."""
    from clawcomm.train.data import global_batches
    from clawcomm.train.models import build
    from clawcomm.train.trainer import Trainer

    model, loss, opt, ds, tokens, sample = build(cfg)
    tr = Trainer(model, loss, opt, cfg, tokens_per_sample=tokens, sample=sample)
    start = tr.load_checkpoint(cfg.checkpoint_dir) if resume else 0
    metrics = tr.fit(
        global_batches(ds, cfg.effective_batch, cfg.seed, start=start),
        steps=stop - start,
        progress=False,
        checkpoint_dir=cfg.checkpoint_dir or None,
        checkpoint_every=cfg.checkpoint_every,
    )
    with tr.whole_params():
        params = {tr.names[id(p)]: p.detach().clone() for p in tr.params}
    tr.close()
    return [m["loss"] for m in metrics], params


def _save_at(cfg: TrainConfig, root: str, steps, keep: int = 3) -> None:
    """Checkpoints of ``cfg``'s untrained model under ``root``, one per step
    in ``steps``, saved in this process (no ranks)."""
    model, loss, opt, _, _, _ = train_models.build(cfg)
    tr = Trainer(model, loss, opt, cfg)
    try:
        for step in steps:
            tr.step_index = step
            tr.save_checkpoint(root, keep=keep)
    finally:
        tr.close()
