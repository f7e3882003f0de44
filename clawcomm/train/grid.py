"""Where each rank sits in the dp x cp x tp x pp grid of a run's layout, its
process groups, the parameters tied across stages, and the line that
describes the layout at start.

Ranks are numbered pipeline-stage-major, tensor-parallel innermost, then
context-parallel: ``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp
+ tp_rank``, so a tensor-parallel group (the traffic of every layer) is
made of neighbours, which share a host first, then a context-parallel group
(the ring of every attention), then the ranks that average the same stage's
gradients, as Megatron and torchtitan place them. The data-parallel group
holds the cp ranks of every replica: they see different tokens of the same
samples, so their gradients are summed with the replicas'. Every rank
creates every group, in the same order, as torch.distributed requires.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Grid:
    dp: int
    pp: int
    rank: int
    tp: int = 1
    cp: int = 1

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return self.rank // self.tp % self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.cp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.dp)

    def rank_of(
        self, dp_rank: int, pp_rank: int, tp_rank: int | None = None, cp_rank: int | None = None
    ) -> int:
        """The rank at (dp_rank, pp_rank), ``tp_rank`` and ``cp_rank``
        (default: this rank's)."""
        t = self.tp_rank if tp_rank is None else tp_rank
        c = self.cp_rank if cp_rank is None else cp_rank
        return ((pp_rank * self.dp + dp_rank) * self.cp + c) * self.tp + t

    def pipeline_ranks(
        self, dp_rank: int, tp_rank: int | None = None, cp_rank: int | None = None
    ) -> list[int]:
        return [self.rank_of(dp_rank, p, tp_rank, cp_rank) for p in range(self.pp)]

    def replica_ranks(self, pp_rank: int, tp_rank: int | None = None) -> list[int]:
        """The ranks that average ``pp_rank``'s gradients: every replica's
        context-parallel ranks."""
        return [
            self.rank_of(d, pp_rank, tp_rank, c) for d in range(self.dp) for c in range(self.cp)
        ]

    def tensor_ranks(self) -> list[int]:
        return [self.rank_of(self.dp_rank, self.pp_rank, t) for t in range(self.tp)]

    def context_ranks(self, dp_rank: int, pp_rank: int, tp_rank: int) -> list[int]:
        return [self.rank_of(dp_rank, pp_rank, tp_rank, c) for c in range(self.cp)]

    def make_groups(self, backend: str | None = None):
        """(pp group, dp group, tp group, cp group) of this rank; every rank
        creates all of them. A group of one rank is None (nothing to talk
        to). On clawcomm the pipeline's progress threads are not niced: a
        stage posts its send and goes on computing, and the next stage
        waits for those bytes (``clawcomm.group_options``); nor are the
        context-parallel ring's, for the same reason."""
        pp_group = None
        for t in range(self.tp):
            for d in range(self.dp):
                for c in range(self.cp):
                    ranks = self.pipeline_ranks(d, t, c)
                    g = None
                    if self.pp > 1:
                        g = dist.new_group(
                            ranks, backend=backend, pg_options=_pipeline_options(backend)
                        )
                    if self.rank in ranks:
                        pp_group = g
        dp_group = self.make_dp_group(backend)
        tp_group = cp_group = None
        for p in range(self.pp):
            for d in range(self.dp):
                for c in range(self.cp):
                    ranks = [self.rank_of(d, p, t, c) for t in range(self.tp)]
                    g = dist.new_group(ranks, backend=backend) if self.tp > 1 else None
                    if self.rank in ranks:
                        tp_group = g
        for p in range(self.pp) if self.cp > 1 else ():
            for d in range(self.dp):
                for t in range(self.tp):
                    ranks = self.context_ranks(d, p, t)
                    g = dist.new_group(
                        ranks, backend=backend, pg_options=_pipeline_options(backend)
                    )
                    if self.rank in ranks:
                        cp_group = g
        return pp_group, dp_group, tp_group, cp_group

    def make_dp_group(self, backend: str | None = None):
        """This rank's data-parallel group (a new one at each call; every
        rank creates all of them). None where dp x cp == 1."""
        dp_group = None
        for t in range(self.tp):
            for p in range(self.pp):
                ranks = self.replica_ranks(p, t)
                g = dist.new_group(ranks, backend=backend) if len(ranks) > 1 else None
                if self.rank in ranks:
                    dp_group = g
        return dp_group


def _pipeline_options(backend: str | None):
    """A pipeline group's options: clawcomm's progress thread at nice 0,
    unless CLAWCOMM_PROGRESS_NICE names one for every group."""
    if (backend or dist.get_backend()) != "clawcomm" or "CLAWCOMM_PROGRESS_NICE" in os.environ:
        return None
    import clawcomm

    return clawcomm.group_options(progress_nice=0)


def tied_parameters(stages: list[nn.Module], cfg, grid: Grid) -> list[tuple]:
    """Parameters shared by stages on different ranks: (param, group of the
    pipeline ranks holding it in this replica, owned here?). Every rank
    creates the same groups in the same order."""
    from clawcomm.pipeline.schedules import stage_to_rank

    holders: dict[int, list[int]] = {}
    objects: dict[int, torch.Tensor] = {}
    for s, mod in enumerate(stages):
        for p in mod.parameters():
            if s not in holders.setdefault(id(p), []):
                holders[id(p)].append(s)
            objects[id(p)] = p
    ties, groups = [], {}
    for pid, ss in holders.items():
        ranks_pp = sorted({stage_to_rank(s, cfg.pp) for s in ss})
        if len(ranks_pp) < 2:
            continue
        mine = None
        for t in range(grid.tp):
            for d in range(cfg.dp):
                for c in range(grid.cp):
                    ranks = [grid.rank_of(d, r, t, c) for r in ranks_pp]
                    if tuple(ranks) not in groups:
                        groups[tuple(ranks)] = dist.new_group(ranks)
                    if grid.rank in ranks:
                        mine = groups[tuple(ranks)]
        if mine is not None:
            owner = stage_to_rank(ss[0], cfg.pp) == grid.pp_rank
            ties.append((objects[pid], mine, owner))
    return ties


def sync_initial_weights(local: dict, dp_group, ties, experts=None) -> None:
    """Every replica starts from its dp group's first rank's weights, and
    tied copies from the first stage's; spread experts (``experts``,
    parallel.expert.SpreadExperts) from the first rank holding the same."""
    if not dist.is_initialized():
        return
    with torch.no_grad():
        for mod in local.values():
            for t in list(mod.parameters()) + list(mod.buffers()):
                group = dp_group
                if experts is not None and id(t) in experts.ids:
                    group = experts.replicas
                if group is not None:
                    dist.broadcast(t, dist.get_global_rank(group, 0), group=group)
        for p, group, _ in ties:
            dist.broadcast(p, dist.get_global_rank(group, 0), group=group)


def describe(cfg, cuts: list[int], peak_lr: float, sharded: bool) -> str:
    """What rank 0 prints at start: the effective batch, the scaled LR, the
    layout, how replicas synchronise, and the stages."""
    base = cfg.base_batch or cfg.effective_batch

    def layers(s: int) -> str:
        lo, hi = cuts[s], cuts[s + 1] - 1
        return f"layer {lo}" if lo == hi else f"layers {lo}-{hi}"

    if cfg.num_stages == 1:
        stages = f"1 stage ({layers(0)})"
    else:
        parts = ", ".join(f"{s}: {layers(s)}" for s in range(cfg.num_stages))
        stages = f"{cfg.num_stages} stages ({parts})"
    sync = ""
    if cfg.sync != "every-step" and cfg.dp > 1:
        sync = (
            f", replicas meet {cfg.sync}"
            + (f" in {cfg.fragments} fragments" if cfg.fragments > 1 else "")
            + (f", {cfg.sync_delay} steps behind (mix {cfg.sync_mix})" if cfg.sync_delay else "")
        )
    compression = ""
    if cfg.compression and cfg.dp > 1:
        what = "the gradients" if cfg.sync == "every-step" else "each meeting's exchange"
        warm = f" after {cfg.compression_warmup} dense steps" if cfg.compression_warmup else ""
        compression = f"\ncompression {cfg.compression} on {what} between replicas{warm}"
    elif cfg.compression:
        compression = f"\ncompression {cfg.compression} is off: at dp 1 no replicas exchange"
    return (
        f"global batch {cfg.effective_batch} = micro-batch {cfg.micro_batch_size} x "
        f"{cfg.microbatches} micro-batches x {cfg.accumulation} accumulation x dp {cfg.dp}\n"
        f"lr {peak_lr * cfg.batch_scale():.4g} = {peak_lr:.4g} at base "
        f"batch {base}, {cfg.lr_scaling} scaling; {cfg.warmup_steps} warm-up steps, "
        f"{cfg.lr_decay} decay\n"
        f"layout dp {cfg.dp} x "
        + (f"tp {cfg.tp} ({tp_text(cfg)}) x " if cfg.tp > 1 else "")
        + (
            f"(ep {cfg.ep} of the dp ranks: {cfg.experts // cfg.ep} experts each) x "
            if cfg.ep > 1
            else ""
        )
        + (
            f"cp {cfg.cp} ({cfg.cp_method}, {cfg.seq_len // cfg.cp} tokens a rank) x "
            if cfg.cp > 1
            else ""
        )
        + f"pp {cfg.pp}"
        + (f" (ZeRO-{cfg.zero})" if sharded else "")
        + sync
        + f", schedule {cfg.schedule}"
        + (f" (v={cfg.virtual_stages})" if cfg.virtual_stages > 1 else "")
        + f", {stages}"
        + compression
    )


def tp_text(cfg) -> str:
    """How the tensor-parallel layers talk, in words."""
    sp = "sequence parallel" if cfg.sequence_parallel_on else "no sequence parallelism"
    return sp + (", overlapped" if cfg.tp_overlap_on else "")
