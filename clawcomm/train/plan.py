"""``clawcomm plan``: the layout for a model on a world, chosen by a model of
its step, with the reasons, and a check of the prediction on this machine.

    clawcomm plan --nproc 4 --model gpt --global-batch 64              # the best few, and why
    clawcomm plan --nproc 4 --model gpt --global-batch 64 --check 4    # ... run for real
    clawcomm train --nproc 4 --layout auto --global-batch 64           # train with the first

1. **Profile** (one process, a few seconds, ``train.profiling``): each
   layer's forward and backward time and the bytes autograd saves for
   backward, at every micro-batch size a candidate uses; one optimizer
   step; all with the one intra-op thread a CPU rank runs with. On the
   CPU, each pipeline shape's passes in its schedule's order against back
   to back (``plan_order``), which scales them: measured last, after the
   trial of step 3, in what is left of the plan's 14 s.
2. **Enumerate** dp x pp (dp * pp = the world, pp at most the layers) x
   schedule (gpipe, 1f1b, zb1, interleaved with v = 2) x micro-batches (pp,
   2 pp and 4 pp, where the global batch divides) x ZeRO stage (0-3 where
   dp > 1); the compression is the command's unless ``--search-compression``
   names wires to choose among (``plan_wire``), the sync method unless
   ``--search-sync`` names methods (every-step, local-sgd:H, diloco:H).
3. **Predict** each one's step: the pipeline's makespan from the schedule
   simulator (``pipeline.validate``) with the profiled costs of each stage
   (stages cut by parameters, as the trainer cuts them; where a host's
   ranks outnumber its cores, the share of each layer's time spent on a
   core times the oversubscription) and the cost model's latency per
   activation (over the link where two stages sit on different hosts:
   ``--hosts``, ``--link``, ranks numbered host by host); the data-parallel
   traffic from the cost model (``clawcomm.cost_model``: an all-reduce of the
   stage's gradients, or ZeRO's reduce-scatter and parameter all-gathers,
   on the hosts the dp group spans), in the trainer's buckets on the
   rank's timeline (``plan_dp``: what runs past the pipeline's end, and
   what the next forward waits for ZeRO's gathers, is exposed); the optimizer
   on the stage's (shard of its) parameters. Where a host's CPU ranks
   outnumber its cores, the pipeline is simulated with the ranks taking
   turns on the cores (a rank alone in a bubble runs at a core's speed),
   and takes at least the host's CPU-seconds over its cores, a compute
   action costing what a short trial measured beyond its profile
   (``plan_cores``). Memory per rank: parameters,
   gradients and AdamW's state as ZeRO divides them, and the activations
   of the micro-batches in flight.
4. **Rank** the candidates within ``--max-memory-mb`` (one over it is never
   chosen), print the best few with the terms of each prediction, why the
   first beats the second, and the command that runs it. ``--check K``
   trains the first K for a few steps each and prints predicted against
   measured step times and their rank correlation (``plan_check``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

from clawcomm.pipeline.clock import ScheduleClock
from clawcomm.pipeline.schedules import build as build_schedule
from clawcomm.pipeline.schedules import check_schedule_args
from clawcomm.train import plan_cores, plan_order
from clawcomm.train.plan_check import model_flags, spearman  # noqa: F401 (the plan's API)
from clawcomm.train.plan_dp import buckets, exposed_gathers, exposed_reduction, rank_timeline
from clawcomm.train.plan_report import report, why  # noqa: F401 (the plan's API)
from clawcomm.train.plan_wire import check_specs, codec_seconds, compressor, reduction_seconds
from clawcomm.train.profiling import Profile, profile

SCHEDULE_CHOICES = (("gpipe", 1), ("1f1b", 1), ("zb1", 1), ("interleaved", 2))


@dataclass(frozen=True)
class Candidate:
    dp: int
    pp: int
    schedule: str
    v: int
    microbatches: int
    micro_batch_size: int
    zero: int
    compression: str | None = None  # searched ('' none); None: the command's own
    sync: str | None = None  # searched; None: the command's own

    def flags(self) -> list[str]:
        out = ["--dp", str(self.dp), "--pp", str(self.pp)]
        if self.pp > 1:
            out += ["--schedule", self.schedule, "-v", str(self.v)]
        out += ["--microbatches", str(self.microbatches)]
        out += ["--micro-batch-size", str(self.micro_batch_size), "--zero", str(self.zero)]
        out += ["--compression", self.compression] if self.compression else []
        return out + (["--sync", self.sync] if self.sync else [])

    def name(self) -> str:
        pipe = f" {self.schedule}" + (f" v{self.v}" if self.v > 1 else "") if self.pp > 1 else ""
        zero = f" ZeRO-{self.zero}" if self.zero else ""
        wire = f" {self.compression}" if self.compression else ""
        sync = f" {self.sync}" if self.sync else ""
        return (f"dp {self.dp} x pp {self.pp}{pipe}, {self.microbatches} x "
                f"{self.micro_batch_size}{zero}{wire}{sync}")  # fmt: skip


@dataclass
class Prediction:
    cand: Candidate
    compute_ms: float  # the busiest rank's compute in the pipeline
    bubble_ms: float  # the pipeline's makespan beyond it
    comm_ms: float  # exposed data-parallel communication
    opt_ms: float  # the optimizer step
    memory_mb: float  # the fullest rank's tensors

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.bubble_ms + self.comm_ms + self.opt_ms


def apply(cfg, c: Candidate):
    """``cfg`` with the candidate's layout."""
    return dataclasses.replace(
        cfg, dp=c.dp, pp=c.pp, schedule=c.schedule, virtual_stages=c.v,
        microbatches=c.microbatches, micro_batch_size=c.micro_batch_size, accumulation=1,
        global_batch=0, zero=c.zero, layout="",
        compression=cfg.compression if c.compression is None else c.compression,
        sync=cfg.sync if c.sync is None else c.sync,
    )  # fmt: skip


def _runs(cfg, world: int) -> bool:
    try:
        cfg.check(world)
        return True
    except ValueError:  # (ZeRO beside a sync method, say)
        return False


def candidates(world: int, layers: int, global_batch: int, compressions=(None,), syncs=(None,)):
    """Every layout the trainer can run ``global_batch`` samples a step with
    (with each of ``compressions`` and ``syncs`` where dp > 1)."""
    for pp in range(1, min(world, layers) + 1):
        if world % pp:
            continue
        dp = world // pp
        if global_batch % dp:
            continue
        per_replica = global_batch // dp
        schedules = SCHEDULE_CHOICES if pp > 1 else (("1f1b", 1),)
        for schedule, v in schedules:
            if pp * v > layers:
                continue
            for m in sorted({pp, 2 * pp, 4 * pp} if pp > 1 else {1, 2, 4}):
                if per_replica % m:
                    continue
                try:
                    check_schedule_args(schedule, pp, m, v)
                except ValueError:
                    continue
                for zero in range(4) if dp > 1 else (0,):
                    for wire in compressions if dp > 1 else compressions[:1]:
                        for sync in syncs if dp > 1 else (None,):
                            yield Candidate(dp, pp, schedule, v, m, per_replica // m, zero, wire,
                                            sync)  # fmt: skip


def _placement(c: Candidate, hosts: int):
    """Where the candidate's ranks sit on ``hosts`` hosts (numbered host by
    host, as torchrun numbers them; the trainer's rank is pp_rank * dp +
    dp_rank): (how many replicas' pipeline ranks p and q are on different
    hosts, the cost model's layout of the widest dp group)."""
    from clawcomm.cost_model import Topology

    per_host = c.dp * c.pp // hosts
    host = lambda d, p: (p * c.dp + d) // per_host  # noqa: E731

    def crossing(p: int, q: int) -> int:
        return sum(host(d, p) != host(d, q) for d in range(c.dp))

    spans = max(len({host(d, p) for d in range(c.dp)}) for p in range(c.pp))
    return crossing, Topology(spans, -(-c.dp // spans))


def predict(c: Candidate, prof: Profile, cores: int, cost=None, gpu: bool = False,
            hosts: int = 1, cap_bytes: float = 25 * 2**20, codec=None,
            sync=("every-step", 1), sync_delay: int = 0) -> Prediction:  # fmt: skip
    """The candidate's step time and memory (see the module docstring) on
    ``hosts`` hosts of ``cores`` cores each (``codec``: seconds of each
    searched compression's passes over the whole model's gradient; ``sync``:
    ``outer.parse_sync`` of the command's --sync, unless the candidate
    carries a searched one)."""
    from clawcomm.cost_model import CostModel
    from clawcomm.cost_model import predict as comm_time

    cost, codec = cost or CostModel(), codec or {}
    if c.sync is not None:  # searched
        from clawcomm.train.outer import parse_sync

        sync = parse_sync(c.sync)
    stages = c.pp * c.v
    span, share = plan_cores.stages(c, prof)
    crossing, dp_layout = _placement(c, hosts)
    slow = 1.0 if gpu else max(1.0, c.dp * c.pp / hosts / cores)  # ranks sharing cores
    mbs = c.micro_batch_size
    # Only the share of a layer's time spent on a core slows down (waiting layers do not).
    scale = [1.0 + (slow - 1.0) * sh for sh in share]

    def per_stage(times: list[float], scale: list[float]) -> list[float]:
        return [sum(scale[i] * times[i] for i in r) for r in span]

    def pass_costs(scale: list[float]) -> dict[str, list[float]]:  # each pass kind's, a stage
        out = {"F": per_stage(prof.forward[mbs], scale), "B": per_stage(prof.backward[mbs], scale)}
        if mbs in prof.input_grad:  # zero-bubble's split backward, as profiled
            out["I"] = per_stage(prof.input_grad[mbs], scale)
            out["W"] = per_stage(prof.weight_grad[mbs], scale)
        else:
            out["I"] = out["W"] = [b / 2 for b in out["B"]]
        return out

    order = plan_order.of(c, prof)

    def costing(table: dict[str, list[float]]):
        def action_cost(a) -> float:  # in the schedule's order (plan_order)
            kind = str(a.kind)
            return table[kind][a.stage] * order.get(kind, 1.0) if kind in table else 0.0

        return action_cost

    action_cost = costing(pass_costs(scale))

    act = max(prof.out_bytes[mbs][span[s][-1]] for s in range(stages))
    shm = cost.shm_alpha + act * cost.shm_beta

    def latency(p: int, q: int) -> float:
        # the replicas run the same schedule: those crossing here share the link
        k = crossing(p, q)
        return cost.net_alpha + k * act * cost.net_beta if k else shm

    pipeline = ScheduleClock(build_schedule(c.schedule, c.pp, c.microbatches, c.v))
    sim = pipeline.run(action_cost, latency if c.pp > 1 else 0.0)
    busy = max(sim.busy.values())
    # Per rank: its stages' parameters (the fullest rank decides).
    rank_params = [
        sum(prof.params[i] for s in range(stages) if s % c.pp == r for i in span[s])
        for r in range(c.pp)
    ]
    p_max = max(rank_params)
    grad_bytes = 4 * p_max
    comm = 0.0
    if c.dp > 1 and sync[0] != "every-step":
        # local SGD / DiLoCo: no gradient exchange a step; the replicas' parameters
        # are averaged every H steps (on a thread of its own with --sync-delay)
        meeting = comm_time("all_reduce", "auto", grad_bytes, dp_layout, cost)
        comm = 0.0 if sync_delay else meeting / sync[1]
    elif c.dp > 1:
        # The buckets are reduced while the host's ranks still compute their
        # backward: where ranks outnumber cores, the reduction's copies, sums
        # and sockets get a core's share as the layers do (the cost model's
        # figures are for a rank with a core of its own).
        crowded = 1.0 + (slow - 1.0) * sum(share) / len(share)
        wire = c.compression or ""  # searched, so costed (the command's own: as float32)
        tensors = prof.tensors or [[(int(n),)] for n in prof.params]
        w_layers = prof.weight_grad.get(mbs) or [b / 2 for b in prof.backward[mbs]]
        passes = {"F": prof.forward[mbs], "B": prof.backward[mbs], "W": w_layers}
        gathers = 0.0
        gather = lambda b: crowded * comm_time("all_gather", "auto", b, dp_layout, cost)  # noqa: E731
        for r in range(c.pp):
            rank = rank_timeline(sim, r, span, lambda k, i: scale[i] * passes[k][i], tensors)
            bs = buckets(rank, cap_bytes)
            codec_s = slow * codec.get(wire, 0.0) * rank_params[r] / max(1.0, sum(prof.params))
            reduce = lambda b, share, shapes, cs=codec_s: reduction_seconds(  # noqa: E731
                wire, c.zero, b, dp_layout, cost, share * cs, crowded, shapes
            )
            comm = max(comm, exposed_reduction(bs, sim.makespan, reduce))
            if c.zero in (1, 2):  # the updated shards gathered behind the next forward
                gathers = max(gathers, exposed_gathers(rank, bs, gather))
        if c.zero == 3:  # gathered before forward and again before backward
            gathers = 2 * crowded * comm_time("all_gather", "auto", grad_bytes, dp_layout, cost)
        comm += gathers
    opt = slow * prof.opt_s_per_param * p_max / (c.dp if c.zero >= 1 else 1)
    # Memory: parameters, gradients, AdamW's two moments, as ZeRO divides them;
    # the activations saved for backward of the micro-batches in flight.
    shard = lambda stage_needed: c.dp if c.zero >= stage_needed else 1  # noqa: E731
    held = 4 * p_max / shard(3) + 4 * p_max / shard(2) + 8 * p_max / shard(1)
    feedback = c.compression and getattr(compressor(c.compression), "uses_error_feedback", False)
    if feedback and c.dp > 1 and sync[0] == "every-step":
        held += 4 * p_max  # the residual (top-k, PowerSGD): the gradient's size (ZeRO too)
    saved = max(
        sum(prof.saved[mbs][i] for s in range(stages) if s % c.pp == r
            for i in span[s])
        for r in range(c.pp)
    )  # fmt: skip
    if c.pp == 1:
        in_flight = 1  # each micro-batch's backward follows its forward
    else:
        in_flight = c.microbatches if c.schedule == "gpipe" else min(c.microbatches, c.pp)
    memory = (held + saved * in_flight) / 2**20
    busy += slow * prof.host_s  # the trainer's own time, on the busiest rank
    makespan = sim.makespan + slow * prof.host_s
    if plan_cores.crowded(c.dp * c.pp, hosts, cores, gpu):
        # the ranks take turns on the cores (plan_cores): a rank alone in a bubble
        # runs at a core's speed; and no less than the host's CPU over its cores,
        # tau a compute action included
        alone = pass_costs([1.0] * len(scale))
        on_core = plan_cores.core_shares(span, share, prof, mbs)
        shared = plan_cores.shared_makespan(pipeline, c, costing(alone), on_core,
                                            latency if c.pp > 1 else lambda p, q: 0.0,
                                            hosts, cores)  # fmt: skip
        per_rank = plan_cores.rank_seconds(c, prof, span, share, prof.action_s, sim.schedule)
        floor = plan_cores.floor(c, per_rank, hosts, cores)
        makespan = max(shared + slow * prof.host_s, floor)
        busy = min(busy, makespan)
    return Prediction(c, 1e3 * busy, 1e3 * (makespan - busy), 1e3 * comm, 1e3 * opt, memory)


def plan(cfg, world: int, memory_mb: float = 0.0, cores: int | None = None, cost=None,
         hosts: int = 1, compressions: list[str] | None = None,
         syncs: list[str] | None = None, trial_steps: int = plan_cores.TRIAL_STEPS,
         trial_on_hosts: bool = False, link: str | None = None):  # fmt: skip
    """(predictions best first, those over the memory limit, the profile).
    ``cores``: what the ranks of one host share (this machine's by default);
    ``compressions``: the wires to search (``plan_wire``; '' is none);
    ``syncs``: the sync methods to search (``outer.parse_sync``'s);
    ``trial_steps``: where ranks outnumber cores, the steps of the trial
    that measures a compute action's cost there (``plan_cores``; 0: none),
    on ``hosts`` namespace hosts with links at ``link`` if ``trial_on_hosts``."""
    from clawcomm.train import models
    from clawcomm.train.outer import parse_sync

    if hosts < 1 or world % hosts:
        raise ValueError(f"--hosts {hosts} does not divide the world of {world} ranks")
    built = models.build(dataclasses.replace(cfg, dp=1, pp=1))
    layers = len(list(built[0]))
    batch = global_batch(cfg)
    wires = check_specs(compressions) if compressions else [None]
    if compressions:
        cfg = dataclasses.replace(cfg, compression="")  # the search decides it
    methods = check_syncs(syncs) if syncs else [None]
    cands = [c for c in candidates(world, layers, batch, wires, methods)
             if _runs(apply(cfg, c), world)]  # fmt: skip
    if not cands:
        raise ValueError(
            f"no layout runs a global batch of {batch} on {world} ranks with {layers} layers: "
            "choose a global batch that dp and the micro-batches divide"
        )
    gpu = on_gpu(cfg)
    split = any(c.schedule == "zb1" for c in cands)
    t0 = time.perf_counter()
    prof = profile(cfg, [c.micro_batch_size for c in cands], built=built, gpu=gpu, split=split)
    cores = cores or os.cpu_count() or 1
    cap = cfg.bucket_cap_mb * 2**20
    shapes = [shape for layer in prof.tensors for shape in layer]
    codec = {w: codec_seconds(w, int(sum(prof.params)), shapes=shapes) for w in wires if w}
    sync = parse_sync(cfg.sync)

    def predict_all() -> list[Prediction]:
        return [predict(c, prof, cores, cost, gpu, hosts, cap, codec, sync, cfg.sync_delay)
                for c in cands]  # fmt: skip

    tried = plan_cores.settle(cfg, cands, prof, world, hosts, cores, gpu, trial_steps,
                              predict_all, trial_on_hosts, link)  # fmt: skip
    if not gpu:  # the orders get what the plan's time has left (plan_order.PLAN_SECONDS)
        left = plan_order.PLAN_SECONDS - (time.perf_counter() - t0)
        prof.order, seconds = plan_order.measure(cfg, cands, prof, built, left)
        prof.seconds += seconds
    if tried:  # tau, with the trial's passes in its schedule's order
        prof.action_s = plan_cores.measured_tau(*tried, prof)
    preds = predict_all()
    fits = [p for p in preds if not memory_mb or p.memory_mb <= memory_mb]
    over = [p for p in preds if memory_mb and p.memory_mb > memory_mb]
    fits.sort(key=lambda p: (p.step_ms, p.memory_mb))
    return fits, over, prof


def on_gpu(cfg) -> bool:
    """Whether the ranks compute on GPUs (``--device``, as the trainer resolves it)."""
    from clawcomm.train import device

    return device.check(cfg.device) == "cuda"


def check_syncs(specs: list[str]) -> list[str]:
    """The searched sync methods, or ValueError naming one ``--sync`` would
    refuse."""
    from clawcomm.train.outer import parse_sync

    out = []
    for s in specs:
        try:
            parse_sync(s)
        except ValueError as e:
            raise ValueError(f"--search-sync: {e}") from None
        out += [s] if s not in out else []
    return out


def global_batch(cfg) -> int:
    """The samples per step the plan keeps: --global-batch, else what the
    command's own micro-batch settings make at its dp."""
    return cfg.global_batch or cfg.effective_batch


def cost_model(path: str | None = None, link: str | None = None):
    """The cost model from ``path`` (or the engine's defaults), with each
    host's link at ``link`` (tc syntax) when given."""
    from clawcomm.cost_model import CostModel
    from clawcomm.experiments.lab import rate_bytes_per_s

    model = CostModel.load(path) if path else CostModel()
    if link:
        model.net_beta = 1 / rate_bytes_per_s(link)
    return model


def choose(cfg, world: int, say=print):
    """``cfg`` with the plan's first layout (``clawcomm train --layout auto``)."""
    preds, over, prof = plan(cfg, world, cfg.max_memory_mb)
    if not preds:
        raise ValueError(f"--layout auto: every layout needs more than --max-memory-mb "
                         f"{cfg.max_memory_mb:g}")  # fmt: skip
    say(report(preds, over, prof, ["--nproc", str(world), *model_flags(cfg)], 3))
    crowded = plan_cores.caveat(prof, world, os.cpu_count() or 1)
    if crowded:
        say("# " + crowded)
    return apply(cfg, preds[0].cand)
