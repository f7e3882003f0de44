"""The data-, tensor- and pipeline-parallel trainer.

    from clawcomm.train import Trainer, TrainConfig
    cfg = TrainConfig(dp=2, pp=2, schedule="zb1", microbatches=8, compression="topk:0.01")
    trainer = Trainer(model, loss_fn, lambda params: torch.optim.AdamW(params, lr=1e-3), cfg)
    for metrics in trainer.fit(global_batches, steps=100):   # one dict per step
        ...

``model`` is an ``nn.Sequential`` (cut into dp x tp x pp-grid stages; at
tp > 1 each layer is then split over its TP group, clawcomm.parallel.tensor)
or a list of stage modules. ``loss_fn(output, target)`` returns the loss *summed* over
the micro-batch; the trainer divides by the number of items (tokens, or
samples) in the global batch, so the gradient is that of the mean over it
whatever the layout and the accumulation (torchtitan's normalisation; a
per-micro-batch mean made accumulation wrong in Hugging Face's trainer
until 2024). Every rank builds the whole model from one seed.

One step (every rank):

1. Barrier on the pipeline; the rank's slice of the effective batch
   (replica, then accumulation round, then micro-batch).
2. ``accumulation`` runs of the schedule through ``PipelineExecutor``. In
   the last run the executor tells the GradReducer each action it runs;
   the reducer knows which are the last backward actions of each stage,
   and as each parameter's gradient becomes final it launches its bucket
   (averaged over the stage's data-parallel group, compressed with error
   feedback if asked), while the rest of the pipeline drains. In step 1
   the reducer only counts how many final contributions each gradient
   gets; from step 2 on it launches on that count.
3. Wait for the reductions; sum tied gradients across the stages that share
   them (the GPT's embedding and output projection); at tp > 1, make the
   gradients of the parameters tensor parallelism leaves whole one over
   the TP group.
4. One all-gather of each rank's figures (``metrics.RankSample``: loss,
   squared gradient norm, bytes sent, busy time, action costs, a stop
   request). Every rank gets the global gradient norm (clipping, NaN/inf
   stop), the loss and whether to stop after this step (SIGTERM, SIGINT);
   rank 0 also the measured bubble and the schedule's predicted one.
5. Clip, step the optimizer (ZeRO: on the shards, then all-gather).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from clawcomm.parallel import context, expert
from clawcomm.parallel.tensor import comm as tensor_comm
from clawcomm.parallel.tensor import split_layers
from clawcomm.parallel.zero import ZeroShards
from clawcomm.parallel.zero3 import ParamUnits, Trackers
from clawcomm.pipeline.actions import B, I, W
from clawcomm.pipeline.clock import ScheduleClock
from clawcomm.pipeline.executor import PipelineExecutor
from clawcomm.pipeline.schedules import build, stage_to_rank
from clawcomm.pipeline.validate import validate
from clawcomm.pipeline.weight_grad import split_linear_backward
from clawcomm.train import deterministic, moe, norms, recompute, replicas, trace
from clawcomm.train.config import TrainConfig
from clawcomm.train.data import replica_rows, rounds
from clawcomm.train.device import for_rank as device_for_rank
from clawcomm.train.device import keep_heap, peak_mb, reset_peak
from clawcomm.train.energy import StepEnergy
from clawcomm.train.grid import Grid, describe, sync_initial_weights, tied_parameters
from clawcomm.train.metrics import (
    PipelineTotals,
    RankSample,
    Traffic,
    check_memory,
    comm_device_bytes,
    gather,
    held_bytes,
    measure_p2p_latency,
    step_metrics,
    summarise,
)
from clawcomm.train.models import cut_into_stages, parameter_names, parameter_shapes, unique_params


class Trainer:
    """See the module docstring. ``optimizer(params)`` builds the optimizer
    over this rank's parameters; its learning rates are the peak rates, which
    the trainer scales (``lr_scaling``), warms up and decays each step.
    ``count_fn(targets)`` counts the loss's items in a batch of targets
    (default: ``targets.numel()``); ``tokens_per_sample`` adds tokens/s to
    the metrics. ``sample`` (one micro-batch of inputs) is needed only for
    ``balance="time"``."""

    def __init__(
        self,
        model: nn.Sequential | list[nn.Module],
        loss_fn: Callable,
        optimizer: Callable,
        config: TrainConfig | None = None,
        *,
        count_fn: Callable | None = None,
        tokens_per_sample: int = 0,
        sample: torch.Tensor | None = None,
    ):
        cfg = config or TrainConfig()
        self.cfg = cfg
        world = dist.get_world_size() if dist.is_initialized() else 1
        cfg.check(world)
        if cfg.deterministic:
            deterministic.enter(world)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.grid = Grid(cfg.dp, cfg.pp, rank, cfg.tp, cfg.cp)
        self.count_fn = count_fn or (lambda t: t.numel())
        self.tokens_per_sample = tokens_per_sample
        if getattr(loss_fn, "reduction", "sum") == "mean":
            raise ValueError(
                "Trainer: loss_fn must sum over the micro-batch (reduction='sum'); the trainer "
                "divides by the number of items in the effective batch"
            )
        S = cfg.num_stages
        self.pp_group, self.dp_group, self.tp_group, self.cp_group = (
            self.grid.make_groups() if dist.is_initialized() else (None,) * 4
        )
        stages, self.cuts = cut_into_stages(model, S, cfg.balance, sample)
        self.tensor_parallel = None  # what parallel.tensor.parallelize made, at tp > 1
        if cfg.tp > 1:  # cut whole (every TP rank the same), then split each layer
            self.tensor_parallel = split_layers(model, loss_fn, cfg, self.grid, self.tp_group)
            loss_fn = self.tensor_parallel.loss_fn
            stages = [nn.Sequential(*model[self.cuts[s] : self.cuts[s + 1]]) for s in range(S)]
        self.loss_fn = loss_fn
        if self.cp_group is not None:  # each rank on its tokens of every sequence
            context.split(
                [model] if isinstance(model, nn.Sequential) else stages, self.cp_group, cfg
            )
        self.experts = None  # what parallel.expert.spread made, at ep > 1
        if dist.is_initialized() and cfg.ep > 1:
            layers = [m for s in stages for m in moe.layers_of(s)]
            self.experts = expert.spread(layers, self.grid, cfg.ep)
        for mod in [model] if isinstance(model, nn.Sequential) else stages:
            recompute.apply(mod, cfg.activation_checkpoint)
            moe.set_aux_scale(mod, 1.0 / (cfg.microbatches * cfg.accumulation))
        self.names = parameter_names(model, stages)
        self.shapes = parameter_shapes(model, stages)
        self.schedule = build(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
        validate(self.schedule, cfg.pp, S, cfg.microbatches)
        self._plan = ScheduleClock(self.schedule, S)
        me = self.grid.pp_rank
        self.local = {s: stages[s] for s in range(S) if stage_to_rank(s, cfg.pp) == me}
        # Every rank builds the whole model on the CPU from one seed (the same
        # weights whatever the device), then moves its own stages.
        self.device = device_for_rank(cfg.device, self.grid.rank)
        if self.device.type == "cpu" and cfg.keep_heap:
            keep_heap()
        for mod in self.local.values():
            mod.to(self.device)
        if cfg.schedule == "zb1":
            for mod in self.local.values():
                split_linear_backward(mod)
        self._ties = tied_parameters(stages, cfg, self.grid)
        self.params = unique_params(
            p
            for s in sorted(self.local, reverse=True)
            for p in reversed(list(self.local[s].parameters()))
            if p.requires_grad
        )
        sync_initial_weights(self.local, self.dp_group, self._ties, self.experts)
        self.executor = PipelineExecutor(
            self.local,
            self.schedule[me],
            S,
            cfg.microbatches,
            me,
            cfg.pp,
            self.pp_group,
            loss_fn,
            device=self.device,
        )
        # deterministic: the GPT head's gradient apart from the embedding's, on one rank
        self.apart = deterministic.keep_head_apart(self.local) if cfg.deterministic else []
        self.reducer, self.outer, exchange_group = replicas.synchronise(self)
        self.p2p_latency = measure_p2p_latency(self.pp_group, self.grid.pp_rank, cfg.pp)
        self._make_optimizer = optimizer
        self.optimizer = optimizer(self.params)
        self._peak_lr = [g["lr"] for g in self.optimizer.param_groups]
        # Under ZeRO the optimizer is rebuilt over the shards once the
        # reducer's layout is learned (the first step), or after a load.
        self.shards = self.units = params_group = None
        if self.reducer is not None and self.reducer.zero:
            self.shards = ZeroShards(self.reducer, cfg.param_compression)
        if self.shards is not None:  # parameters gathered as the actions need them
            # ZeRO-3 gathers during the step: on a group of their own where a
            # reduction thread issues collectives too (compressed, overlapped).
            threaded = self.reducer.compressor is not None and cfg.overlap and cfg.zero == 3
            params_group = self.grid.make_dp_group() if threaded else None
            last = {a.stage: a for a in self.schedule[me] if a.kind in (B, I, W)}
            self.units = ParamUnits(
                self.shards, self.local, last, params_group or self.dp_group,
                cfg.reshards_after_forward,
            )  # fmt: skip
            if self.shards.frees:  # sharded from the start, a bucket at a time
                self.lay_out_shards()
        self.tracker = Trackers(self.reducer, self.units) if self.units else self.reducer
        if cfg.deterministic:  # (the reducer hears nothing: it launches after the tree)
            per_replica = cfg.microbatches * cfg.accumulation
            self.tracker = deterministic.MicroBatchTree(
                self.local, per_replica, cfg.microbatches, self.apart, self.units
            )
        self.step_index = 0
        self.traffic = Traffic(
            self.pp_group,
            self.dp_group,
            (t[1] for t in self._ties),
            params_group or exchange_group,
            self.tp_group,
            self.experts.group if self.experts else None,
            self.cp_group,
        )
        self._mark = None  # traffic where the next step's figures start (ZeRO: its gathers)
        self._pending_save = None
        self._checkpoint_group = None
        # SIGTERM/SIGINT (clawcomm.train.stop): this rank's request, and the signal every
        # rank agreed to stop on; on_durable(path, s): rank 0, an async save committed.
        self.stop, self.stopped_by, self.on_durable = None, 0, None
        # Per-step events for --trace/--timeline (clawcomm.train.trace), or None.
        self.recorder = None
        self.eval_executor: PipelineExecutor | None = None  # forward only (loop.evaluate)
        local = int(os.environ.get("LOCAL_RANK", self.grid.rank))
        self.energy = StepEnergy(self.device, local)  # this rank's joules per step, if metered
        if cfg.trace or cfg.timeline or cfg.chakra:
            self.recorder = trace.StepRecorder()

    # ---- the step ---------------------------------------------------------------------

    def describe(self) -> str:
        """What rank 0 prints at start: the batch, the LR, the layout, the stages."""
        return describe(self.cfg, self.cuts, self._peak_lr[0], self.shards is not None)

    def step(self, batch, *, data_wait=None, defer_gathers: bool = False) -> dict:
        """One optimizer step on ``batch`` = (inputs, targets), the whole
        effective batch (every rank passes the same), or a
        ``tokens.ReplicaSlice`` (this replica's rows). Returns the metrics.
        ``data_wait``: when the wait for this batch began and ended, for the
        trace; ``defer_gathers``: ZeRO's gathers for the next step may land
        in it (``fit`` says so; a step on its own lets them land first)."""
        cfg = self.cfg
        x, y, whole = cfg.check_batch(batch)
        count = float(self.count_fn(y) if whole else batch.items)
        bytes_before = self._begin_step()
        t0 = time.perf_counter()
        self.energy.begin()
        totals, events = self._run_pipeline(x, y, cfg.averaged_over / count, whole)
        t_pipe = time.perf_counter()
        dp_wait = self._finish_gradients()
        rows = gather(self._sample(totals, bytes_before, t_pipe - t0, dp_wait))
        self.stopped_by = int(max(r.stop for r in rows))  # every rank reads the same rows
        check_memory(rows, cfg.max_memory_mb, self.step_index + 1)
        loss, sumsq = sum(r.loss for r in rows), sum(r.sumsq for r in rows)
        if cfg.deterministic:  # exact sums: no rank or shard boundary shows
            loss, sumsq = norms.exact_step_totals(self, totals.losses)
        grad_norm, loss = math.sqrt(sumsq / cfg.averaged_over), loss / count
        self._check_finite(loss, grad_norm)
        self._clip(grad_norm)
        t_opt = time.perf_counter()
        self._update(defer_gathers)
        step_s = time.perf_counter() - t0
        if self.recorder is not None:
            times = (t0, t_pipe, dp_wait, t_opt, t0 + step_s)
            trace.record_step(self, events, *times, data_wait=data_wait)
        self.step_index += 1
        lr = self.optimizer.param_groups[0]["lr"]
        out = step_metrics(self.step_index, loss, lr, grad_norm, step_s, cfg.effective_batch)
        if self.tokens_per_sample:
            out["tokens_per_s"] = cfg.effective_batch * self.tokens_per_sample / step_s
        out["device_s"] = step_s * cfg.world
        cuda = self.device.type == "cuda"
        return out | summarise(rows, cfg, self.grid, self._plan, self.p2p_latency, cuda)

    def _begin_step(self) -> list[int]:
        """The step's learning rates, its peaks reset, the pipeline's ranks
        started together; returns the traffic the step's figures start from."""
        for i, g in enumerate(self.optimizer.param_groups):
            g["lr"] = self._peak_lr[i] * self.cfg.lr_factor(self.step_index)
        bytes_before = self._mark if self._mark is not None else self.traffic.sent()
        reset_peak(self.device)
        tensor_comm.EXPOSED.lap()  # (what an evaluation waited is not the step's)
        expert.EXPOSED.lap()
        context.EXPOSED.lap()
        context.COMPUTE.lap()
        moe.ROUTING.lap()
        if self.shards is not None:
            self.shards.reset_peak()
        if self.pp_group is not None:
            dist.barrier(group=self.pp_group)
        return bytes_before

    def _finish_gradients(self) -> float:
        """The data-parallel reduction waited for, tied copies summed, and
        ZeRO's shards made anew where the bucket layout changed (the first
        step, a load); returns the seconds waited for the reduction."""
        dp_wait = self.reducer.finish() if self.reducer is not None else 0.0
        if self.experts is not None:
            self.experts.reduce_grads()
        for p, group, _ in self._ties:
            dist.all_reduce(p.grad, group=group)
        if self.cfg.deterministic:  # (the GPT head's part, averaged as the rest was)
            self.tracker.add_apart(self.dp_group if self.reducer is not None else None)
        if self.tensor_parallel is not None:
            self.tensor_parallel.sync_replicated_grads()
        self.lay_out_shards()
        return dp_wait

    def lay_out_shards(self) -> None:
        """ZeRO: the optimizer over shards laid out on the reducer's bucket
        layout, where it changed (the first step's learned order, a load;
        ZeRO-3 builds them from the old shards a layer at a time)."""
        if self.shards is not None:
            if self.units is not None:
                self.units.land()
            old = self.optimizer  # (the experts outside the reducer: whole, 1/ep already)
            make = lambda shards: self._make_optimizer(shards + self._outside())  # noqa: E731
            self.optimizer = self.shards.ready(old, make)
            for p in self._outside() if self.optimizer is not old else ():
                self.optimizer.state[p] = old.state.get(p, {})

    def _outside(self) -> list:
        """This rank's parameters outside the reducer: spread experts'."""
        return [p for p in self.params if id(p) in self.experts.ids] if self.experts else []

    def _sample(self, totals, bytes_before, span: float, dp_wait: float) -> RankSample:
        """This rank's figures of the step, which every rank gathers."""
        sent = [a - b for a, b in zip(self.traffic.sent(), bytes_before, strict=True)]
        return RankSample(
            # (every TP rank of the last stage has the loss: rank 0 of them counts it)
            loss=float(sum(float(v) for v in totals.losses)) if self.grid.tp_rank == 0 else 0.0,
            sumsq=0.0 if self.cfg.deterministic else norms.owned_sumsq(self),  # (exact: step)
            **Traffic.fields(sent),
            busy=totals.busy, span=span, recv_wait=totals.recv_wait, dp_wait=dp_wait,
            tp_wait=tensor_comm.EXPOSED.lap(), ep_wait=expert.EXPOSED.lap(),
            cp_wait=context.EXPOSED.lap(), cp_attention=context.COMPUTE.lap(),
            **RankSample.routing(moe.ROUTING.lap(), self.grid.tp_rank == 0),
            host=totals.host / max(1, totals.computes), gpu_mb=peak_mb(self.device),
            comm_bytes=self._comm_device_bytes(),
            costs=totals.mean_costs(sorted(self.local)),
            **held_bytes(self.params, self.reducer, self.optimizer, self.shards),
            stop=self.stop.signum if self.stop is not None else 0, energy_j=self.energy.lap(),
            cpu_s=self.energy.cpu_lap(),
        )  # fmt: skip

    def _update(self, defer_gathers: bool) -> None:
        """The optimizer's step, the replicas' meeting where one is due, and
        ZeRO's gathers for the next step started (landed at once unless
        ``defer_gathers``); the gradients zeroed."""
        self.optimizer.step()
        self._mark = None
        if self.outer is not None:
            if self.outer.due(self.step_index + 1):  # (the meeting's bytes count in the next step)
                self._mark = self.traffic.sent()
            self.outer.after_step(self.step_index + 1)
        if self.units is not None:  # gathered as the next step needs them (its bytes, too)
            self._mark = self.traffic.sent()
            self.units.updated()
            if not defer_gathers:
                self.units.settle()
        self._zero_grads()

    def data_rows(self) -> tuple[slice, bool]:
        """This replica's rows of each effective batch, and whether this rank
        reads them (its stages take the inputs or the targets)."""
        reads = bool({0, self.cfg.num_stages - 1} & set(self.local))
        return replica_rows(self.cfg, self.grid.dp_rank), reads

    def rounds(self, x, y, whole: bool):
        """``data.rounds`` for this rank: its replica's slice, with the
        inputs where it holds the first stage and the targets where the last."""
        first, last = 0 in self.local, self.cfg.num_stages - 1 in self.local
        out = rounds(self.cfg, self.grid.dp_rank, x, y, whole, first, last, self.device)
        if self.cfg.cp == 1:
            return out
        cp, c = self.cfg.cp, self.grid.cp_rank  # each rank its tokens of every sequence
        held = lambda ts: None if ts is None else [context.take(t, cp, c) for t in ts]  # noqa: E731
        return ((a, held(i), held(t)) for a, i, t in out)

    def _run_pipeline(self, x, y, loss_scale: float, whole: bool) -> tuple[PipelineTotals, list]:
        """The replica's slice through the schedule, once per accumulation
        round (``rounds``); the reducer hears each action run, and in the
        last round launches each bucket when its gradients are final."""
        cfg = self.cfg
        totals, events = PipelineTotals(), []
        for a, inputs, targets in self.rounds(x, y, whole):
            if self.reducer is not None and not cfg.deterministic:  # (ZeRO-2: in each)
                self.reducer.begin_round(a, last=a == cfg.accumulation - 1)
            stats = self.executor.run(inputs, targets, loss_scale=loss_scale, tracker=self.tracker)
            totals.add(stats)
            if self.recorder is not None:
                events += trace.run_events(stats, a if cfg.accumulation > 1 else None)
        if cfg.deterministic:  # every gradient final at once, the tree's root
            self.tracker.collapse()
            if self.reducer is not None:
                self.reducer.all_final()
        return totals, events

    def _check_finite(self, loss: float, grad_norm: float) -> None:
        if not (math.isfinite(grad_norm) and math.isfinite(loss)):
            raise FloatingPointError(
                f"clawcomm.train: stopped at step {self.step_index}: the loss is {loss} and the "
                f"gradient norm {grad_norm} (every rank stops here)"
            )

    def _clip(self, grad_norm: float) -> None:
        if self.cfg.clip > 0 and grad_norm > self.cfg.clip:
            factor = self.cfg.clip / (grad_norm + 1e-6)
            tensors = self.shards.tensors() + self._outside() if self.shards else self.params
            for p in tensors:
                if p.grad is not None:
                    p.grad.mul_(factor)

    def _zero_grads(self) -> None:
        if self.experts is not None:
            self.experts.zero_grad()
        if self.reducer is not None:
            self.reducer.zero_grad()
        else:
            for p in self.params:
                p.grad = None

    def whole_params(self):
        """A context in which every parameter is whole (ZeRO-3 gathers them
        and frees them after); it yields whether they had to be gathered."""
        from contextlib import nullcontext

        return self.units.whole() if self.units is not None else nullcontext(False)

    def _comm_device_bytes(self) -> float:
        """The device memory this rank's groups' CUDA communicators hold
        outside torch's allocator (their CUDA IPC buffers); 0 on the CPU."""
        if self.device.type != "cuda":
            return 0.0
        return float(comm_device_bytes(self.traffic.engines("cuda")[0]))

    # ---- the loop -------------------------------------------------------------------------

    def save_checkpoint(self, root: str, keep: int = 2, asynchronous: bool = False):
        """Saves an atomic checkpoint under ``root`` (every rank calls it);
        see clawcomm.train.checkpoint. ``asynchronous``: returns once the
        state is copied; the files are written meanwhile and committed by
        ``wait_checkpoint()`` (or the next save)."""
        from clawcomm.train import checkpoint

        self.wait_checkpoint()
        if not asynchronous:
            return checkpoint.save(self, root, keep)
        if self._checkpoint_group is None and dist.is_initialized():
            self._checkpoint_group = dist.new_group(backend=dist.get_backend())
        self._pending_save = checkpoint.save(
            self, root, keep, asynchronous=True, group=self._checkpoint_group
        )
        return self._pending_save

    def wait_checkpoint(self) -> None:
        """Waits for an asynchronous save and commits it."""
        if self._pending_save is not None:
            pending, self._pending_save = self._pending_save, None
            pending.wait()
            if self.on_durable is not None and self.grid.rank == 0:
                self.on_durable(pending.path, time.perf_counter() - pending.started)

    def load_checkpoint(self, path: str) -> int:
        """Loads a checkpoint (or ``path``'s latest one), at this run's layout
        whatever the layout it was saved at; returns its step."""
        from clawcomm.train import checkpoint

        return checkpoint.load(self, path)

    def fit(self, batches: Iterable, steps: int | None = None, **options) -> list[dict]:
        """Runs ``steps`` steps (default: the config's, less those already
        done) over ``batches``; see ``loop.fit`` for the options (metrics
        file, progress bar, checkpoints, held-out batches). Returns the
        metrics of every step."""
        from clawcomm.train import loop

        return loop.fit(self, batches, steps, **options)

    def evaluate(self, batches: Iterable) -> float:
        """The mean loss over ``batches`` (held-out), forward only, on every
        rank (collective); see ``loop.evaluate``."""
        from clawcomm.train import loop

        return loop.evaluate(self, batches)

    def close(self) -> None:
        self.wait_checkpoint()
        if self.reducer is not None:
            self.reducer.close()
        if self.outer is not None:
            self.outer.close()
        if self.units is not None:
            self.units.close()
