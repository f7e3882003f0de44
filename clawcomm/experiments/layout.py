"""The compression lab at a dp x pp layout (``--layout DPxPP``, PP > 1): each
method trains through ``clawcomm train``'s Trainer, every stage reducing
(or, for sync methods, meeting) over its own data-parallel group.

The task is the lab's, built by the trainer: the digits MLP (64-256-256-10,
SGD) or the character GPT (4 blocks of width 128, AdamW), the learning rate
decaying linearly to zero, no clipping; each replica's batch is the lab's
batch per rank, in 4 micro-batches through the 1F1B schedule. ``compute``
is the same steps with replicas that never meet (``local-sgd`` with a
period longer than the run): the pipeline's own traffic stays, the
gradient exchange goes.

Bytes per step are the data-parallel bytes the trainer measures
(``bytes_sent_dp``, summed over every rank, divided by the number of ranks:
bytes per rank, as the rest of the lab reports); the pipeline's
activations are not counted. The loss curve is replica 0's whole model, gathered over its
pipeline: the MLP's loss on the whole training set and accuracy on the
test set, the GPT's loss and accuracy on the lab's held-out batches.
"""

from __future__ import annotations

import time

MICROBATCHES = 4


def parse_layout(text: str) -> tuple[int, int]:
    """'2x2' -> (2, 2): data-parallel replicas and pipeline ranks."""
    dp, x, pp = text.lower().partition("x")
    if not x or not dp.strip().isdigit() or not pp.strip().isdigit():
        raise ValueError(f"--layout {text!r} is not DPxPP, such as 2x2")
    dp, pp = int(dp), int(pp)
    if dp < 1 or pp < 1:
        raise ValueError(f"--layout {text!r}: dp and pp must be >= 1")
    return dp, pp


def check(cfg: dict) -> None:
    """What a pipelined lab run needs (raises ValueError)."""
    if cfg["device"] != "cpu":
        raise ValueError(f"--layout with pp > 1 runs on the CPU, not --device {cfg['device']}")
    if cfg["batch"] % MICROBATCHES:
        raise ValueError(
            f"--layout with pp > 1: --batch {cfg['batch']} must split into {MICROBATCHES} "
            "micro-batches"
        )


def train_config(spec: str, cfg: dict):
    from clawcomm.experiments.methods import COMPUTE, parse_method
    from clawcomm.train import TrainConfig

    method = parse_method(spec)
    sync = method.sync if spec != COMPUTE else f"local-sgd:{cfg['steps'] + 1}"
    return TrainConfig(
        dp=cfg["dp"], pp=cfg["pp"], model=cfg["model"], layers=3 if cfg["model"] == "mlp" else 0,
        steps=cfg["steps"], seed=cfg["seed"], lr=cfg["lr"], lr_decay="linear", min_lr_ratio=0.0,
        weight_decay=cfg["weight_decay"], clip=0.0,
        optimizer="sgd" if cfg["model"] == "mlp" else "adamw", momentum=cfg["momentum"],
        microbatches=MICROBATCHES, micro_batch_size=cfg["batch"] // MICROBATCHES,
        compression="" if method.compressor == "none" else method.compressor,
        compression_warmup=cfg["warmup"], sync=sync, fragments=method.fragments,
        sync_delay=method.delay, sync_mix=method.mix, outer_lr=cfg["outer_lr"],
        outer_momentum=cfg["outer_momentum"], device="cpu", quiet=True,
    )  # fmt: skip


def _gather_replica(trainer, model) -> None:
    """Every stage's current parameters into ``model`` on each rank of the
    pipeline (from the rank that holds the stage)."""
    import torch.distributed as dist

    from clawcomm.pipeline.schedules import stage_to_rank

    cuts, grid = trainer.cuts, trainer.grid
    for s in range(trainer.cfg.num_stages):
        owner = grid.rank_of(grid.dp_rank, stage_to_rank(s, grid.pp))
        for p in model[cuts[s] : cuts[s + 1]].parameters():
            dist.broadcast(p.data, owner, group=trainer.pp_group)


def train(rank: int, world_size: int, spec: str, cfg: dict) -> dict | None:
    """One run on one rank of the layout; rank 0 returns the measurements."""
    import torch
    import torch.distributed as dist

    from clawcomm.experiments import tasks
    from clawcomm.train import models
    from clawcomm.train.data import global_batches
    from clawcomm.train.trainer import Trainer

    tc = train_config(spec, cfg)
    model, loss_fn, make_opt, ds, _, sample = models.build(tc)
    trainer = Trainer(model, loss_fn, make_opt, tc, sample=sample)
    if tc.model == "gpt":
        held_out = tasks.gpt_held_out(ds, "cpu")

        def evaluate():
            return tasks.gpt_evaluate(model, held_out)
    else:

        def evaluate():
            with torch.no_grad():
                loss = float(models.classification_loss(model(ds.x), ds.y)) / len(ds.y)
                accuracy = float((model(ds.x_test).argmax(1) == ds.y_test).float().mean())
            return loss, accuracy

    def point():
        _gather_replica(trainer, model)
        return evaluate()[0] if rank == 0 else float("nan")

    every = max(1, tc.steps // 50)
    counted = cfg["warmup"] + 1 if cfg["warmup"] < tc.steps else 1
    batches = global_batches(ds, tc.effective_batch, tc.seed)
    curve, seconds, sent, total = [(0, point(), 0, 0.0)], 0.0, 0, 0
    for step in range(1, tc.steps + 1):
        t0 = time.perf_counter()
        m = trainer.step(next(batches))
        seconds += time.perf_counter() - t0
        total += m["bytes_sent_dp"] / world_size  # per rank
        if step >= counted:
            sent += m["bytes_sent_dp"] / world_size
        if step % every == 0 or step == tc.steps:
            curve.append((step, point(), total, seconds))
    trainer.close()
    _gather_replica(trainer, model)
    final_loss, accuracy = evaluate()
    dist.barrier()
    if rank:
        return None
    return {
        "compressor": spec,
        "bytes_per_step": sent / (tc.steps - counted + 1),
        "step_ms": 1e3 * seconds / tc.steps,
        "final_loss": final_loss,
        "test_accuracy": accuracy,
        "curve": curve,
        "parameters": sum(p.numel() for p in model.parameters()),
        "layout": f"{tc.dp}x{tc.pp}",
    }
