"""The trainer's loop: steps over batches, the wait for each batch, held-out
loss, metrics, checkpoints and the trace at the end (``Trainer.fit``).

Each step's ``data_wait_ms`` is the time the loop waited for its batch:
with the prefetching loader (``tokens.Prefetcher``) the part of the batch's
preparation that the previous step did not hide. The trace shows it as a
"data wait" span before the step.

Held-out loss (``val_loss``): ``evaluate`` runs the model forward only, on
the same stages and ranks as training (each rank's schedule with its
backward actions taken out), over a fixed list of held-out batches, every
``--eval-every`` steps and after the last.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from clawcomm.pipeline.actions import RECV_F, SEND_F, F
from clawcomm.pipeline.executor import PipelineExecutor
from clawcomm.train import deterministic
from clawcomm.train.metrics import MetricsSink


def fit(
    trainer,
    batches: Iterable,
    steps: int | None = None,
    metrics_file: str | None = None,
    progress: bool = True,
    log: Callable[[dict], None] | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    keep_checkpoints: int = 2,
    val_batches: list | None = None,
) -> list[dict]:
    """Runs ``steps`` steps (default: the config's, less those already done)
    over ``batches``. Rank 0 writes each step's metrics to ``metrics_file``
    (JSON lines, appended to when resuming) and shows a progress bar. With
    ``checkpoint_dir``, a checkpoint is saved after the last step, and every
    ``checkpoint_every`` steps if that is set; the step's metrics then carry
    ``checkpoint_ms`` and ``checkpoint`` (its folder). With ``val_batches``,
    the step's metrics carry ``val_loss`` every ``eval_every`` steps and at
    the last. When a rank's ``stop`` request is raised (SIGTERM, SIGINT),
    every rank stops after the same step, which is saved and carries
    ``stopped_by`` (the signal's number). Returns the metrics of every
    step."""
    cfg = trainer.cfg
    steps = cfg.steps - trainer.step_index if steps is None else steps
    out = []
    rank0 = trainer.grid.rank == 0
    with MetricsSink(
        metrics_file if rank0 else None,
        cfg.tensorboard if rank0 else "",
        steps if rank0 and progress else 0,
        append=trainer.step_index > 0,
    ) as sink:
        it = iter(batches)
        for k in range(steps):
            t0 = time.perf_counter()
            batch = next(it, None)
            if batch is None:
                break
            waited = (t0, time.perf_counter())
            # a step's gathers for the next one may land while that one starts
            m = trainer.step(batch, data_wait=waited, defer_gathers=True)
            m["data_wait_ms"] = 1e3 * (waited[1] - t0)
            if k == 0 and "energy_j" not in m:  # why there is no energy figure
                m["energy_note"] = trainer.energy.reason or "no meter on rank 0"
            if trainer.stopped_by:
                m["stopped_by"] = trainer.stopped_by
            last = k == steps - 1 or trainer.stopped_by
            due = cfg.eval_every and trainer.step_index % cfg.eval_every == 0
            if val_batches and (due or last):
                m["val_loss"] = evaluate(trainer, val_batches)
            every = checkpoint_every and trainer.step_index % checkpoint_every == 0
            if checkpoint_dir and (every or last):
                t0 = time.perf_counter()
                saved = trainer.save_checkpoint(
                    checkpoint_dir, keep_checkpoints, asynchronous=cfg.async_checkpoint
                )
                m["checkpoint_ms"] = 1e3 * (time.perf_counter() - t0)
                m["checkpoint"] = saved if isinstance(saved, str) else saved.path
            out.append(m)
            sink.write(m)
            if log is not None:
                log(m)
            if trainer.stopped_by:
                break
    if trainer.units is not None:
        trainer.units.settle()
    trainer.wait_checkpoint()
    _write_outputs(trainer)
    return out


def _write_outputs(trainer) -> None:
    """Gathers every rank's recorded steps on rank 0 and writes the trace,
    the timeline and the Chakra files the config asks for (collective); a
    failed write is one line."""
    from clawcomm import outputs
    from clawcomm.train import trace

    cfg = trainer.cfg
    if trainer.recorder is None:
        return
    try:
        trace.write_recorded(trainer, cfg.trace or None, cfg.timeline or None)
        if cfg.chakra:
            from clawcomm.train import chakra

            chakra.write(trainer, cfg.chakra)
    except OSError as e:
        outputs.failed("clawcomm train", "--trace/--timeline/--chakra", e.filename or "", e)


def evaluate(trainer, batches: Iterable) -> float:
    """The mean loss per item over ``batches`` (whole effective batches or
    ``tokens.ReplicaSlice``s, as training takes them), forward only, with
    no gradient; every rank calls it and gets the same number."""
    if trainer.eval_executor is None:
        trainer.eval_executor = _forward_only(trainer.executor)
    ex = trainer.eval_executor
    if trainer.units is not None:
        trainer.units.settle()
    losses, items = [], 0.0  # on the last stages
    with torch.no_grad(), trainer.whole_params():
        for batch in batches:
            x, y, whole = trainer.cfg.check_batch(batch)
            for _, inputs, targets in trainer.rounds(x, y, whole):
                losses += ex.run(inputs, targets).losses
            items += float(trainer.count_fn(y) if whole else batch.items)
    if trainer.grid.tp_rank != 0:  # every TP rank of a last stage has its replica's loss
        losses = []
    if trainer.cfg.deterministic:  # summed exactly, as the step's loss
        return deterministic.exact_totals(losses, [])[0] / items if items else float("nan")
    loss = torch.tensor([sum(float(v) for v in losses)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(loss)
    return float(loss) / items if items else float("nan")


def _forward_only(ex: PipelineExecutor) -> PipelineExecutor:
    """``ex``'s stages and ranks with its action list's forward part: the
    forward passes, and the sends and receives of activations, in order."""
    actions = [a for a in ex.actions if a.kind in (F, SEND_F, RECV_F)]
    return PipelineExecutor(
        ex.stages,
        actions,
        ex.num_stages,
        ex.microbatches,
        ex.pp_rank,
        ex.pp,
        ex.group,
        ex.loss_fn,
        device=ex.device,
    )
