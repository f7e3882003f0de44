"""What each rank counts in the step's loss and global gradient norm, and
how the ranks' parts are added: in floating point (``owned_sumsq``, one
figure per rank, summed by the trainer's all-gather) or, in deterministic
mode, exactly (``exact_step_totals``)."""

from __future__ import annotations

import torch

from clawcomm.train import deterministic


def _not_counted(trainer) -> set[int]:
    """ids of parameters another rank counts: a tied parameter off its first
    stage's rank; at tp > 1, what tensor parallelism leaves whole, off TP
    rank 0."""
    skip = {id(p) for p, _, owner in trainer._ties if not owner}
    if trainer.tensor_parallel is not None and trainer.grid.tp_rank != 0:
        skip |= trainer.tensor_parallel.replicated_ids()
    return skip


def owned_grads(trainer) -> list[tuple[torch.Tensor, int]]:
    """This rank's gradients in the norm, each with the times it counts
    (ZeRO: a shard dp times); the spread experts' aside (parallel.expert)."""
    skip = _not_counted(trainer) | (trainer.experts.ids if trainer.experts else set())
    if trainer.shards is not None:
        return trainer.shards.owned(skip)
    return [(p.grad, 1) for p in trainer.params if p.grad is not None and id(p) not in skip]


def owned_sumsq(trainer) -> float:
    """Squared norm of this rank's gradients, as ``owned_grads`` counts them."""
    spread = trainer.experts.sumsq(_not_counted(trainer)) if trainer.experts else 0.0
    owned = owned_grads(trainer)
    if trainer.shards is not None:
        return sum(n * float(g.double().square().sum().cpu()) for g, n in owned) + spread
    if not owned:
        return spread
    return float(torch.nn.utils.get_total_norm([g for g, _ in owned], 2.0)) ** 2 + spread


def exact_step_totals(trainer, losses: list[torch.Tensor]) -> tuple[float, float]:
    """(the step's loss summed over every micro-batch, the squared gradient
    norm times dp), each exact and rounded once, whatever the layout: one
    collective over every rank."""
    mine = losses if trainer.grid.tp_rank == 0 else []
    return deterministic.exact_totals(mine, owned_grads(trainer))
