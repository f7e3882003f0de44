"""The data- and pipeline-parallel trainer.

    from clawcomm.train import Trainer, TrainConfig
    cfg = TrainConfig(dp=2, pp=2, schedule="zb1", microbatches=8, compression="topk:0.01")
    trainer = Trainer(model, loss_fn, lambda params: torch.optim.AdamW(params, lr=1e-3), cfg)
    for metrics in trainer.fit(global_batches, steps=100):   # one dict per step
        ...

``model`` is an ``nn.Sequential`` (cut into dp x pp-grid stages) or a list
of stage modules. ``loss_fn(output, target)`` returns the loss *summed* over
the micro-batch; the trainer divides by the number of items (target
elements: tokens, or samples) in the effective batch, so the gradient is
that of the mean over the effective batch whatever the layout and the
accumulation (the normalisation torchtitan uses; the per-micro-batch mean
is what made gradient accumulation wrong in Hugging Face's trainer until
2024). Every rank builds the whole model from the same seed and keeps its
stages.

One step (every rank):

1. Barrier on the pipeline; the rank's slice of the effective batch
   (replica, then accumulation round, then micro-batch).
2. ``accumulation`` runs of the schedule through ``PipelineExecutor``. In
   the last run, the last backward actions of each stage are armed: as each
   parameter's gradient becomes final, the GradReducer launches its bucket
   (averaged over the stage's data-parallel group, compressed with error
   feedback if asked), while the rest of the pipeline drains. In step 1
   the trainer only counts how many final contributions each gradient
   gets; from step 2 on it launches on that count.
3. Wait for the reductions; sum tied gradients across the stages that share
   them (the GPT's embedding and output projection).
4. One all-gather of a few numbers per rank: loss, squared gradient norm,
   bytes sent, busy and elapsed time, per-stage action costs. Every rank
   gets the global gradient norm (clipping, NaN/inf stop) and the loss;
   rank 0 also the measured bubble and the schedule's predicted one
   (``simulate`` with the measured costs).
5. Clip, step the optimizer, zero the gradients.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from clawcomm._torch_names import all_gather_single
from clawcomm.compression import get_compressor
from clawcomm.parallel.reducer import GradReducer
from clawcomm.pipeline.actions import Action, B, F, I, W
from clawcomm.pipeline.executor import PipelineExecutor
from clawcomm.pipeline.schedules import build, stage_to_rank
from clawcomm.pipeline.validate import SimulationPlan, validate
from clawcomm.pipeline.weight_grad import notify_grad, split_linear_backward
from clawcomm.train.config import TrainConfig
from clawcomm.train.device import for_rank as device_for_rank
from clawcomm.train.device import peak_mb, reset_peak
from clawcomm.train.layout import Grid, balanced_cuts, measured_costs, parameter_costs

_KINDS = (F, B, I, W)


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
        self.grid = Grid(cfg.dp, cfg.pp, dist.get_rank() if dist.is_initialized() else 0)
        self.count_fn = count_fn or (lambda t: t.numel())
        self.tokens_per_sample = tokens_per_sample
        if getattr(loss_fn, "reduction", "sum") == "mean":
            raise ValueError(
                "Trainer: loss_fn must sum over the micro-batch (reduction='sum'); the trainer "
                "divides by the number of items in the effective batch"
            )
        self.loss_fn = loss_fn
        S = cfg.num_stages
        stages, self.cuts = _cut(model, S, cfg.balance, sample)
        self.names = _full_names(model, stages)
        self.shapes = _full_shapes(model, stages)
        self.schedule = build(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
        validate(self.schedule, cfg.pp, S, cfg.microbatches)
        self._plan = SimulationPlan(self.schedule, S)
        me = self.grid.pp_rank
        self.local = {s: stages[s] for s in range(S) if stage_to_rank(s, cfg.pp) == me}
        # Every rank builds the whole model on the CPU from one seed (the same
        # weights whatever the device), then moves its own stages.
        self.device = device_for_rank(cfg.device, self.grid.rank)
        for mod in self.local.values():
            mod.to(self.device)
        if cfg.schedule == "zb1":
            for mod in self.local.values():
                split_linear_backward(mod)
        self.pp_group, self.dp_group = (
            self.grid.make_groups() if dist.is_initialized() else (None, None)
        )
        self._ties = self._make_ties(stages)
        self.params = _unique(
            p
            for s in sorted(self.local, reverse=True)
            for p in reversed(list(self.local[s].parameters()))
            if p.requires_grad
        )
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._sync_initial_weights()
        self.executor = PipelineExecutor(
            self.local,
            self.schedule[me],
            S,
            cfg.microbatches,
            me,
            cfg.pp,
            self.pp_group,
            loss_fn,
            on_grad=self._final_grad,
            device=self.device,
        )
        last = {}
        for a in self.schedule[me]:
            if a.kind in (B, I, W):
                last[(a.stage, a.kind)] = a
        self._final_actions = set(last.values())
        self.reducer = None
        if cfg.dp > 1:
            compressor = get_compressor(cfg.compression) if cfg.compression else None
            self.reducer = GradReducer(
                self.params,
                self.dp_group,
                bucket_cap_mb=cfg.bucket_cap_mb,
                first_bucket_mb=min(1.0, cfg.bucket_cap_mb),
                compressor=compressor,
                compression_warmup_steps=cfg.compression_warmup,
                overlap=cfg.overlap,
            )
            self.reducer.overlap = False  # step 1 learns when gradients are final
            self.reducer.attach_grads()
        self._counts = [0] * len(self.params)
        self._learned = False
        self._ready_order: list[int] = []
        # Autograd's accumulations count toward final gradients only where
        # there is a data-parallel reduction to launch.
        self._hooks = (
            [p.register_post_accumulate_grad_hook(notify_grad) for p in self.params]
            if self.reducer is not None
            else []
        )
        self.p2p_latency = self._measure_p2p_latency()
        self.optimizer = optimizer(self.params)
        self._peak_lr = [g["lr"] for g in self.optimizer.param_groups]
        self.step_index = 0
        self._engines = None  # for bytes_sent, found on first use
        self._pending_save = None
        self._checkpoint_group = None
        # Per-step events for --trace/--timeline (clawcomm.train.trace), or None.
        self.recorder = None
        if cfg.trace or cfg.timeline:
            from clawcomm.train.trace import StepRecorder

            self.recorder = StepRecorder()

    # ---- setup ----------------------------------------------------------------------

    def _make_ties(self, stages: list[nn.Module]) -> list[tuple[torch.Tensor, object, bool]]:
        """Parameters shared by stages on different ranks: (param, group of
        the pipeline ranks holding it in this replica, owned here?). Every
        rank creates the same groups in the same order."""
        holders: dict[int, list[int]] = {}
        objects: dict[int, torch.Tensor] = {}
        for s, mod in enumerate(stages):
            for p in mod.parameters():
                if s not in holders.setdefault(id(p), []):
                    holders[id(p)].append(s)
                objects[id(p)] = p
        ties, groups = [], {}
        for pid, ss in holders.items():
            ranks_pp = sorted({stage_to_rank(s, self.cfg.pp) for s in ss})
            if len(ranks_pp) < 2:
                continue
            mine = None
            for d in range(self.cfg.dp):
                ranks = [self.grid.rank_of(d, r) for r in ranks_pp]
                if tuple(ranks) not in groups:
                    groups[tuple(ranks)] = dist.new_group(ranks)
                if self.grid.rank in ranks:
                    mine = groups[tuple(ranks)]
            if mine is not None:
                owner = stage_to_rank(ss[0], self.cfg.pp) == self.grid.pp_rank
                ties.append((objects[pid], mine, owner))
        return ties

    def _sync_initial_weights(self) -> None:
        """Every replica starts from its dp group's first rank's weights, and
        tied copies from the first stage's."""
        if not dist.is_initialized():
            return
        with torch.no_grad():
            for mod in self.local.values():
                for t in list(mod.parameters()) + list(mod.buffers()):
                    if self.dp_group is not None:
                        dist.broadcast(
                            t, dist.get_global_rank(self.dp_group, 0), group=self.dp_group
                        )
            for p, group, _ in self._ties:
                dist.broadcast(p, dist.get_global_rank(group, 0), group=group)

    def _measure_p2p_latency(self, rounds: int = 20) -> float:
        """One-way latency of a small message between the first two stages'
        ranks (the median of ``rounds`` round trips, halved): the link cost
        the bubble prediction charges per transfer. 0 where pp == 1."""
        if self.pp_group is None:
            return 0.0
        # The other ranks wait for the end in a blocking receive, so that
        # neither their start-up nor a spinning barrier slows the ping-pong
        # down (two cores, four ranks).
        dist.barrier()
        pp = self.grid.pp_rank
        done = torch.zeros(1)
        if pp > 1:
            self.pp_group.recv([done], 0, 999_999).wait()
            return 0.0
        peer = 1 - pp
        buf = torch.zeros(256)
        times = []
        for i in range(rounds):
            t0 = time.perf_counter()
            if pp == 0:
                self.pp_group.send([buf], peer, 1_000_000 + i).wait()
                self.pp_group.recv([buf], peer, 1_000_000 + i).wait()
            else:
                self.pp_group.recv([buf], peer, 1_000_000 + i).wait()
                self.pp_group.send([buf], peer, 1_000_000 + i).wait()
            times.append(time.perf_counter() - t0)
        if pp == 0:
            for r in range(2, self.cfg.pp):
                self.pp_group.send([done], r, 999_999).wait()
        return sorted(times)[rounds // 2] / 2  # the median round trip, halved

    # ---- the step ---------------------------------------------------------------------

    def lr_factor(self, step: int) -> float:
        """The LR multiplier at ``step`` (0-based): batch scaling x warm-up x decay."""
        cfg = self.cfg
        scale = self.batch_scale()
        if step < cfg.warmup_steps:
            return scale * (step + 1) / cfg.warmup_steps
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        lo = cfg.min_lr_ratio
        decay = {
            "none": 1.0,
            "linear": 1.0 - (1.0 - lo) * progress,
            "cosine": lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress)),
        }[cfg.lr_decay]
        return scale * decay

    def batch_scale(self) -> float:
        """The LR multiplier for the effective batch against ``base_batch``."""
        cfg = self.cfg
        ratio = cfg.effective_batch / (cfg.base_batch or cfg.effective_batch)
        return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.lr_scaling]

    def describe(self) -> str:
        """What rank 0 prints at start: the effective batch, the scaled LR,
        the layout and the stages."""
        cfg = self.cfg
        base = cfg.base_batch or cfg.effective_batch
        stages = ", ".join(
            f"{s}: layers {self.cuts[s]}-{self.cuts[s + 1] - 1}" for s in range(cfg.num_stages)
        )
        return (
            f"effective batch {cfg.effective_batch} = micro-batch {cfg.micro_batch_size} x "
            f"{cfg.microbatches} micro-batches x {cfg.accumulation} accumulation x dp {cfg.dp}\n"
            f"lr {self._peak_lr[0] * self.batch_scale():.4g} = {self._peak_lr[0]:.4g} at base "
            f"batch {base}, {cfg.lr_scaling} scaling; {cfg.warmup_steps} warm-up steps, "
            f"{cfg.lr_decay} decay\n"
            f"layout dp {cfg.dp} x pp {cfg.pp}, schedule {cfg.schedule}"
            + (f" (v={cfg.virtual_stages})" if cfg.virtual_stages > 1 else "")
            + f", {cfg.num_stages} stages ({stages})"
        )

    def step(self, batch) -> dict:
        """One optimizer step on ``batch`` = (inputs, targets), the whole
        effective batch (every rank passes the same). Returns the metrics."""
        cfg, grid = self.cfg, self.grid
        x, y = batch
        n = cfg.effective_batch
        if x.shape[0] != n or y.shape[0] != n:
            raise ValueError(
                f"clawcomm.train: a batch must hold the effective batch of {n} samples "
                f"({cfg.micro_batch_size} x {cfg.microbatches} x {cfg.accumulation} x dp "
                f"{cfg.dp}); got inputs {tuple(x.shape)} and targets {tuple(y.shape)}"
            )
        count = float(self.count_fn(y))
        scale = (cfg.dp if self.reducer is not None else 1.0) / count
        per_replica = n // cfg.dp
        lo = grid.dp_rank * per_replica
        for i, g in enumerate(self.optimizer.param_groups):
            g["lr"] = self._peak_lr[i] * self.lr_factor(self.step_index)
        bytes_before = self._bytes_sent()
        reset_peak(self.device)
        if self.pp_group is not None:
            dist.barrier(group=self.pp_group)
        t0 = time.perf_counter()
        busy = recv_wait = host = 0.0
        computes = 0
        losses = []
        costs: dict = {}
        has_first = 0 in self.local
        has_last = cfg.num_stages - 1 in self.local
        events: list = []
        for a in range(cfg.accumulation):
            rows = slice(
                lo + a * per_replica // cfg.accumulation,
                lo + (a + 1) * per_replica // cfg.accumulation,
            )
            dev = self.device
            inputs = list(x[rows].to(dev).chunk(cfg.microbatches)) if has_first else None
            targets = list(y[rows].to(dev).chunk(cfg.microbatches)) if has_last else None
            last_round = a == cfg.accumulation - 1
            armed = self._armed if (last_round and self.reducer is not None) else None
            stats = self.executor.run(inputs, targets, loss_scale=scale, armed=armed)
            if self.recorder is not None:
                events += self._events_of(stats, a)
            busy += stats.busy
            recv_wait += stats.recv_wait
            host += stats.host
            computes += len(stats.timeline)
            losses += stats.losses
            for act, s0, s1 in stats.timeline:
                c = costs.setdefault((act.stage, act.kind), [0.0, 0])
                c[0] += s1 - s0
                c[1] += 1
        t_pipe = time.perf_counter()
        dp_wait = self._finish_reduction()
        for p, group, _ in self._ties:
            dist.all_reduce(p.grad, group=group)
        local_loss = float(sum(float(v) for v in losses)) if has_last else 0.0
        sumsq = self._owned_sumsq()
        summary = self._gather(
            local_loss, sumsq, bytes_before, busy, t_pipe - t0, recv_wait, dp_wait,
            host / max(1, computes), costs,
        )  # fmt: skip
        grad_norm = math.sqrt(summary["sumsq"] / cfg.dp)
        loss = summary["loss"] / count
        if not (math.isfinite(grad_norm) and math.isfinite(loss)):
            raise FloatingPointError(
                f"clawcomm.train: stopped at step {self.step_index}: the loss is {loss} and the "
                f"gradient norm {grad_norm} (every rank stops here)"
            )
        if cfg.clip > 0 and grad_norm > cfg.clip:
            factor = cfg.clip / (grad_norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(factor)
        t_opt = time.perf_counter()
        self.optimizer.step()
        self._zero_grads()
        step_s = time.perf_counter() - t0
        if self.recorder is not None:
            from clawcomm.train.trace import COMM, COMPUTE, STEP

            t_end = t0 + step_s
            events.append((COMM, "dp reduction (exposed)", t_pipe, t_pipe + dp_wait, {}))
            events.append((COMPUTE, "optimizer", t_opt, t_end, {"kind": "opt"}))
            events.append((STEP, f"step {self.step_index + 1}", t0, t_end, {}))
            events += self._engine_events(t0, t_end)
            self.recorder.add_step(events)
        self.step_index += 1
        out = {
            "step": self.step_index,
            "loss": loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm,
            "step_ms": step_s * 1e3,
            "samples_per_s": n / step_s,
        }
        if self.tokens_per_sample:
            out["tokens_per_s"] = n * self.tokens_per_sample / step_s
        out.update(summary["metrics"])
        return out

    def _events_of(self, stats, accumulation_round: int) -> list:
        from clawcomm.train.trace import COMM, COMPUTE

        out = []
        for act, s0, s1 in stats.timeline:
            args = {"kind": act.kind, "stage": act.stage, "mb": act.microbatch}
            if self.cfg.accumulation > 1:
                args["round"] = accumulation_round
            out.append((COMPUTE, f"{act.kind}{act.microbatch} s{act.stage}", s0, s1, args))
        out += [(COMM, what, s0, s1, {}) for what, s0, s1 in stats.waits]
        return out

    def _engine_events(self, t0: float, t1: float) -> list:
        """The dp group's collectives and the pp group's sends and receives
        that ran in [t0, t1], from the engines' flight records."""
        import json

        from clawcomm.train.trace import ENGINE

        if not dist.is_initialized() or dist.get_backend() != "clawcomm":
            return []
        self._bytes_sent()  # finds the engines
        out = []
        for label, eng in self._engines[1].items():
            for op in json.loads(eng.flight_record())["ops"]:
                s0, s1 = op["start_us"] / 1e6, op["end_us"] / 1e6
                p2p = op["op"] in ("send", "recv")
                if op["state"] != "done" or s1 < t0 or s0 > t1 or (label == "dp") == p2p:
                    continue
                name = f"{label} {op['op']}" + (f" #{op['seq']}" if "seq" in op else "")
                out.append((ENGINE, name, s0, s1, {"group": label, "bytes": op["bytes"]}))
        return out

    def write_trace(self, trace: str | None, timeline: str | None) -> None:
        """Gathers every rank's recorded steps on rank 0 and writes the
        Chrome trace and/or the timeline picture (collective)."""
        from clawcomm.train import trace as tr

        if self.recorder is None:
            return
        g = self.grid
        ranks = self.recorder.gather(g.rank, f"rank {g.rank} (dp {g.dp_rank}, pp {g.pp_rank})")
        if g.rank != 0:
            return
        if trace:
            tr.write_chrome_trace(trace, ranks)
        if timeline:
            cfg = self.cfg
            title = (
                f"step {self.step_index}: dp {cfg.dp} x pp {cfg.pp}, {cfg.schedule}, "
                f"{cfg.microbatches} micro-batches"
            )
            tr.draw_timeline(timeline, ranks, -1, title)

    def _armed(self, a: Action) -> bool:
        return a in self._final_actions

    def _final_grad(self, param: torch.Tensor) -> None:
        i = self._index.get(id(param))
        if i is None:
            return
        self._counts[i] += 1
        if not self._learned:
            if self._counts[i] == 1:
                self._ready_order.append(i)
            return
        if self._counts[i] > self.reducer.expected[i]:
            raise RuntimeError(
                f"clawcomm.train: parameter {self.names.get(id(param), i)!r} received more final "
                f"gradient contributions ({self._counts[i]}) than in the first step "
                f"({self.reducer.expected[i]}): its stage's control flow changed; train with "
                "overlap=False"
            )
        self.reducer.ready(i)

    def _finish_reduction(self) -> float:
        if self.reducer is None:
            return 0.0
        t0 = time.perf_counter()
        self.reducer.launch_all()
        self.reducer.wait()
        waited = time.perf_counter() - t0
        self.reducer.end_step()
        if not self._learned:
            self._learned = True
            self.reducer.expected = list(self._counts)
            seen = set(self._ready_order)
            order = self._ready_order + [i for i in range(len(self.params)) if i not in seen]
            t = torch.tensor(order, dtype=torch.int64)
            dist.broadcast(t, dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
            self.reducer.rebuild(t.tolist())
            self.reducer.overlap = self.cfg.overlap
        self.reducer.reset()
        self._counts = [0] * len(self.params)
        return waited

    def _zero_grads(self) -> None:
        if self.reducer is not None:
            self.reducer.zero_grad()
        else:
            for p in self.params:
                p.grad = None

    def _owned_sumsq(self) -> float:
        """Squared norm of this rank's gradients; a tied parameter counts on
        its first stage's rank only."""
        shared_elsewhere = {id(p) for p, _, owner in self._ties if not owner}
        grads = [
            p.grad for p in self.params if p.grad is not None and id(p) not in shared_elsewhere
        ]
        if not grads:
            return 0.0
        total = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6: fused
        if total is not None:
            return float(total(grads, 2.0)) ** 2
        norms = torch.stack([torch.linalg.vector_norm(g) for g in grads]).double()
        return float(norms.square().sum())

    def _bytes_sent(self) -> list[int]:
        """Bytes this rank sent so far: [every group, the pipeline group, the
        data-parallel group]."""
        if not dist.is_initialized() or dist.get_backend() != "clawcomm":
            return [0, 0, 0]
        if self._engines is None:
            import clawcomm

            named = {"pp": self.pp_group, "dp": self.dp_group}
            groups = (None, self.pp_group, self.dp_group, *(t[1] for t in self._ties))
            engines = {id(g): clawcomm.engine_of(g) for g in groups}
            # a group of one rank is None: nothing sent there
            self._engines = (
                list(engines.values()),
                {k: engines[id(g)] for k, g in named.items() if g is not None},
            )
        every, named = self._engines

        def sent(e) -> int:
            return sum(v["bytes_sent"] for v in e.comm_stats().values())

        return [sum(sent(e) for e in every)] + [
            sent(named[k]) if k in named else 0 for k in ("pp", "dp")
        ]

    def _gather(
        self, loss, sumsq, bytes_before, busy, span, recv_wait, dp_wait, host, costs
    ) -> dict:
        """One all-gather: [loss, sumsq, bytes, busy, span, recv wait, dp wait,
        rss MB, host overhead per compute action, pp bytes, dp bytes, peak GPU
        MB, then the F/B/I/W mean cost of each local stage]."""
        cfg = self.cfg
        v = cfg.virtual_stages
        sent = [float(a - b) for a, b in zip(self._bytes_sent(), bytes_before, strict=True)]
        own = [
            loss,
            sumsq,
            sent[0],
            busy,
            span,
            recv_wait,
            dp_wait,
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            host,
            sent[1],
            sent[2],
            peak_mb(self.device),
        ]
        for s in sorted(self.local):
            for k in _KINDS:
                tot, cnt = costs.get((s, k), (0.0, 0))
                own.append(tot / cnt if cnt else 0.0)
        width = 12 + 4 * v
        mine = torch.tensor(own, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = torch.zeros(dist.get_world_size() * width, dtype=torch.float64)
            all_gather_single(everyone, mine)
            rows = everyone.view(-1, width).tolist()
        else:
            rows = [own]
        grid = self.grid
        replica0 = [grid.rank_of(0, p) for p in range(cfg.pp)]
        bubble = []
        for d in range(cfg.dp):
            ranks = [grid.rank_of(d, p) for p in range(cfg.pp)]
            span_max = max(rows[r][4] for r in ranks)
            busy_sum = sum(rows[r][3] for r in ranks)
            bubble.append(1.0 - busy_sum / (cfg.pp * span_max) if span_max > 0 else 0.0)
        metrics = {
            "bubble": sum(bubble) / len(bubble),
            "bytes_sent": int(sum(row[2] for row in rows)),
            "dp_wait_ms": max(row[6] for row in rows) * 1e3,
            "recv_wait_ms": max(row[5] for row in rows) * 1e3,
            "max_rss_mb": max(row[7] for row in rows),
            # the busiest rank's compute, and the longest exposed
            # communication (waits for tensors + the reduction's tail)
            "compute_ms": max(row[3] for row in rows) * 1e3,
            "exposed_comm_ms": max(row[5] + row[6] for row in rows) * 1e3,
            "bytes_sent_pp": int(sum(row[9] for row in rows)),
            "bytes_sent_dp": int(sum(row[10] for row in rows)),
        }
        if self.device.type == "cuda":
            metrics["max_gpu_mem_mb"] = max(row[11] for row in rows)
        if grid.rank == 0:
            cost = {}
            for p_rank, r in enumerate(replica0):
                for j in range(v):
                    s = j * cfg.pp + p_rank
                    for k_i, k in enumerate(_KINDS):
                        cost[(s, k)] = rows[r][12 + 4 * j + k_i]
            host = [rows[r][8] for r in replica0]

            def costs_of(a):
                return cost.get((a.stage, a.kind), 0.0)

            # The prediction charges what was measured besides compute: the
            # p2p latency per transfer and each rank's host time per action.
            sim = self._plan.run(costs_of, latency=self.p2p_latency, overhead=host.__getitem__)
            metrics["bubble_predicted"] = sim.bubble
            metrics["bubble_ideal"] = self._plan.run(costs_of).bubble
            metrics["host_us_per_action"] = sum(host) / len(host) * 1e6
        return {
            "loss": sum(row[0] for row in rows),
            "sumsq": sum(row[1] for row in rows),
            "metrics": metrics,
        }

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

    def load_checkpoint(self, path: str) -> int:
        """Loads a checkpoint (or ``path``'s latest one), at this run's layout
        whatever the layout it was saved at; returns its step."""
        from clawcomm.train import checkpoint

        return checkpoint.load(self, path)

    def fit(
        self,
        batches: Iterable,
        steps: int | None = None,
        metrics_file: str | None = None,
        progress: bool = True,
        log: Callable[[dict], None] | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_every: int = 0,
        keep_checkpoints: int = 2,
    ) -> list[dict]:
        """Runs ``steps`` steps (default: the config's, less those already
        done) over ``batches``. Rank 0 writes each step's metrics to
        ``metrics_file`` (JSON lines, appended to when resuming) and shows a
        progress bar. With ``checkpoint_dir`` and ``checkpoint_every``, a
        checkpoint is saved every that many steps and after the last; the
        step's metrics then carry ``checkpoint_ms``. Returns the metrics of
        every step."""
        import json

        steps = self.cfg.steps - self.step_index if steps is None else steps
        rank0 = self.grid.rank == 0
        bar = None
        if rank0 and progress:
            from tqdm import tqdm

            bar = tqdm(total=steps, unit="step", leave=False)
        out = []
        mode = "a" if self.step_index else "w"
        sink = open(metrics_file, mode) if (rank0 and metrics_file) else None  # noqa: SIM115
        board = None
        if rank0 and self.cfg.tensorboard:
            from clawcomm._optional import require

            require("tensorboard", "clawcomm train --tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            board = SummaryWriter(self.cfg.tensorboard)
        try:
            for k, batch in zip(range(steps), batches, strict=False):
                m = self.step(batch)
                if (
                    checkpoint_dir
                    and checkpoint_every
                    and (self.step_index % checkpoint_every == 0 or k == steps - 1)
                ):
                    t0 = time.perf_counter()
                    self.save_checkpoint(
                        checkpoint_dir, keep_checkpoints, asynchronous=self.cfg.async_checkpoint
                    )
                    m["checkpoint_ms"] = 1e3 * (time.perf_counter() - t0)
                out.append(m)
                if sink is not None:
                    sink.write(json.dumps(m) + "\n")
                    sink.flush()
                if board is not None:
                    for key, value in m.items():
                        if key != "step" and isinstance(value, int | float):
                            board.add_scalar(f"train/{key}", value, m["step"])
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{m['loss']:.4f}", bubble=f"{m['bubble']:.2f}")
                if log is not None:
                    log(m)
        finally:
            if bar is not None:
                bar.close()
            if sink is not None:
                sink.close()
            if board is not None:
                board.close()
        self.wait_checkpoint()
        self.write_trace(self.cfg.trace or None, self.cfg.timeline or None)
        return out

    def close(self) -> None:
        self.wait_checkpoint()
        if self.reducer is not None:
            self.reducer.close()
        for h in self._hooks:
            h.remove()


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _cut(model, num_stages: int, balance: str, sample) -> tuple[list[nn.Module], list[int]]:
    if isinstance(model, nn.Sequential):
        layers = list(model)
        if num_stages > len(layers):
            raise ValueError(
                f"clawcomm.train: {num_stages} stages (pp x v) but the model has only "
                f"{len(layers)} layers; use fewer stages or more layers"
            )
        if balance == "time":
            if sample is None:
                raise ValueError("clawcomm.train: balance='time' needs a sample micro-batch")
            costs = measured_costs(layers, sample)
            if dist.is_initialized():  # timings differ: every rank takes rank 0's
                t = torch.tensor(costs, dtype=torch.float64)
                dist.broadcast(t, 0)
                costs = t.tolist()
        else:
            costs = parameter_costs(layers)
        cuts = balanced_cuts(costs, num_stages)
        return [nn.Sequential(*layers[cuts[s] : cuts[s + 1]]) for s in range(num_stages)], cuts
    stages = list(model)
    if len(stages) != num_stages:
        raise ValueError(
            f"clawcomm.train: {len(stages)} stage modules given for {num_stages} stages (pp x v)"
        )
    return stages, list(range(num_stages + 1))


def _full_shapes(model, stages) -> dict[str, list[int]]:
    """Every parameter's shape, by its name in the whole model."""
    params = {id(p): p for p in (model.parameters() if isinstance(model, nn.Sequential) else ())}
    for s in stages:
        params.update({id(p): p for p in s.parameters()})
    names = _full_names(model, stages)
    return {names[i]: list(p.shape) for i, p in params.items()}


def _full_names(model, stages) -> dict[int, str]:
    """id(param) -> its name in the whole model (what checkpoints key on)."""
    pairs = (
        model.named_parameters(remove_duplicate=False)
        if isinstance(model, nn.Sequential)
        else ((f"{s}.{n}", p) for s, m in enumerate(stages) for n, p in m.named_parameters())
    )
    names: dict[int, str] = {}
    for n, p in pairs:
        names.setdefault(id(p), n)  # a tied parameter keeps its first name
    return names
