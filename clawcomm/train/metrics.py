"""What a trainer step measures, by name: each rank's figures
(:class:`RankSample`), one all-gather of them, and the step's metrics made
from every rank's (:func:`summarise`), the bubble predicted by the schedule's
simulation included.

    sample = RankSample(loss=..., sumsq=..., costs=totals.mean_costs(stages))
    everyone = gather(sample)                      # one collective
    metrics = summarise(everyone, cfg, grid, ...)  # the dict a step returns
"""

from __future__ import annotations

import json
import resource
import time
from dataclasses import astuple, dataclass, field, fields

import torch
import torch.distributed as dist

from clawcomm._torch_names import all_gather_single
from clawcomm.pipeline.actions import B, F, I, W

KINDS = (F, B, I, W)


@dataclass
class RankSample:
    """One rank's figures for one step (seconds, bytes, MB)."""

    loss: float = 0.0  # the loss summed over its micro-batches (last stage's rank)
    sumsq: float = 0.0  # squared norm of the gradients it owns
    bytes_sent: float = 0.0  # every group
    busy: float = 0.0  # in compute actions
    span: float = 0.0  # the pipeline runs, from barrier to drain
    recv_wait: float = 0.0  # waiting for activations and gradients
    dp_wait: float = 0.0  # the data-parallel reduction's exposed tail
    rss_mb: float = 0.0  # peak resident set
    host: float = 0.0  # host time per compute action
    bytes_pp: float = 0.0
    bytes_dp: float = 0.0
    bytes_tp: float = 0.0  # its tensor-parallel group's (activations and their gradients)
    tp_wait: float = 0.0  # blocked on tensor-parallel communication (the exposed part)
    bytes_ep: float = 0.0  # its expert-parallel group's (tokens to their experts and back)
    ep_wait: float = 0.0  # blocked on the experts' all-to-alls
    bytes_cp: float = 0.0  # its context-parallel group's (keys and values, their gradients)
    cp_wait: float = 0.0  # blocked on the context-parallel ring's transfers
    cp_attention: float = 0.0  # CPU seconds of attention's arithmetic over the cp group
    # its MoE layers' routing (train/moe.py): token slots, dropped slots, the
    # load-balancing and z-losses summed, and the layer forwards they sum over
    moe_slots: float = 0.0
    moe_dropped: float = 0.0
    moe_balance: float = 0.0
    moe_z: float = 0.0
    moe_layers: float = 0.0
    # bytes_dp by kind: reduce-scatter, all-gather, all-reduce, all-to-all
    # (int8/int4 compression reduce-scatters through one)
    bytes_rs: float = 0.0
    bytes_ag: float = 0.0
    bytes_ar: float = 0.0
    bytes_a2a: float = 0.0
    # the seconds those collectives ran, by kind (the engine's busy_us)
    time_rs: float = 0.0
    time_ag: float = 0.0
    time_ar: float = 0.0
    time_a2a: float = 0.0
    gpu_mb: float = 0.0  # peak GPU memory
    # Tensor bytes held once the step's gradients are reduced, before the
    # optimizer steps: parameters, gradient buffers, optimizer state (see
    # held_bytes); and the most parameter and gradient bytes held during the
    # step (ZeRO-3's gathered layers; the full gradient buffers, which
    # ZeRO-2 lets go after their reduce-scatter).
    param_bytes: float = 0.0
    grad_bytes: float = 0.0
    optim_bytes: float = 0.0
    param_peak_bytes: float = 0.0
    grad_peak_bytes: float = 0.0
    # Device memory its communicators hold outside torch's allocator: the
    # CUDA IPC buffers of each group's (comm_device_bytes); 0 on the CPU.
    comm_bytes: float = 0.0
    stop: float = 0.0  # the signal that asked this rank to stop (clawcomm.train.stop), or 0
    energy_j: float = -1.0  # joules its meter counted over the step (energy.py), -1: none
    cpu_s: float = 0.0  # CPU-seconds its process used over the step (every thread)
    # The mean time of F, B, I and W of each local stage, stage by stage.
    costs: list[float] = field(default_factory=list)

    @staticmethod
    def routing(figures, counted: bool = True) -> dict:
        """``moe.ROUTING.lap()``'s figures as fields (zeros where not
        ``counted``: the TP ranks but the first, which route alike)."""
        names = ("moe_slots", "moe_dropped", "moe_balance", "moe_z", "moe_layers")
        return dict(zip(names, figures if counted else (0,) * len(names), strict=True))

    def cost(self, local_stage: int, kind: str) -> float:
        return self.costs[4 * local_stage + KINDS.index(kind)]


_SCALARS = len(fields(RankSample)) - 1


def gather(sample: RankSample) -> list[RankSample]:
    """Every rank's sample, in rank order (one all-gather of float64s)."""
    sample.rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    own = [*astuple(sample)[:_SCALARS], *sample.costs]
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [sample]
    mine = torch.tensor(own, dtype=torch.float64)
    everyone = torch.zeros(dist.get_world_size() * len(own), dtype=torch.float64)
    all_gather_single(everyone, mine)
    rows = everyone.view(-1, len(own)).tolist()
    return [RankSample(*row[:_SCALARS], costs=row[_SCALARS:]) for row in rows]


def check_memory(rows: list[RankSample], limit_mb: float, step: int) -> None:
    """``max_memory_mb``: every rank raises the same error when a rank's
    tensors, each kind at its peak in the step, and its communicators'
    device buffers exceed ``limit_mb`` (the optimizer's state counts from
    the step after its first, which makes it)."""
    held = [r.param_peak_bytes + r.grad_peak_bytes + r.optim_bytes + r.comm_bytes for r in rows]
    worst = max(range(len(rows)), key=held.__getitem__)
    if limit_mb > 0 and held[worst] > limit_mb * 1e6:
        r = rows[worst]
        comm = f", CUDA IPC buffers {r.comm_bytes / 1e6:.2f} MB" if r.comm_bytes else ""
        raise MemoryError(
            f"clawcomm.train: stopped at step {step}: rank {worst} held {held[worst] / 1e6:.2f} MB "
            f"(parameters {r.param_peak_bytes / 1e6:.2f}, gradients "
            f"{r.grad_peak_bytes / 1e6:.2f}, optimizer state {r.optim_bytes / 1e6:.2f} MB at "
            f"their peaks{comm}), over max_memory_mb {limit_mb:g}: shard them (--zero 1, 2 or 3, "
            "--reshard-after-forward) or add ranks"
        )


def comm_device_bytes(engines) -> int:
    """The device memory ``engines`` (each group's CUDA communicator) hold
    outside torch's allocator: their CUDA IPC buffers, as each engine's
    ``memory_stats()`` counts them (sized by CLAWCOMM_CUDA_IPC_BYTES,
    CLAWCOMM_CUDA_GRAPH_BYTES and CLAWCOMM_CUDA_P2P_BYTES; docs/gpu.md)."""
    return sum(e.memory_stats()["device_ipc_bytes"] for e in engines)


def held_bytes(params, reducer, optimizer, shards=None) -> dict:
    """The bytes of the tensors a rank holds for training: its parameters
    (under ZeRO, ``shards``' flat buffers and shards, and the most they
    held during the step), its gradient buffers (the reducer's
    buckets and, under ZeRO, their shards; else the parameters' gradients)
    and its optimizer's state."""

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    outside, inside = 0, set()  # gradients the reducer does not hold (spread experts')
    if reducer is not None:
        inside = {id(p) for p in reducer.params}
        outside = nbytes(p.grad for p in params if id(p) not in inside)
    grads = (
        reducer.grad_bytes() + outside if reducer is not None else nbytes(p.grad for p in params)
    )
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    sharded = shards is not None and not shards.stale()  # (laid out from the first step's end)
    whole = nbytes(p for p in params if id(p) not in inside) if reducer is not None else 0
    held = shards.param_bytes() + whole if sharded else nbytes(params)
    return {
        "param_bytes": held,
        "grad_bytes": grads,
        "optim_bytes": nbytes(state),
        "param_peak_bytes": max(held, shards.peak_bytes) if shards is not None else held,
        "grad_peak_bytes": reducer.peak_grad_bytes + outside if reducer is not None else grads,
    }


class PipelineTotals:
    """A step's pipeline runs (one per accumulation round) added up."""

    def __init__(self):
        self.busy = self.recv_wait = self.host = 0.0
        self.computes = 0
        self.losses: list = []
        self._costs: dict = {}  # (stage, kind) -> [seconds, count]

    def add(self, stats) -> None:
        self.busy += stats.busy
        self.recv_wait += stats.recv_wait
        self.host += stats.host
        self.computes += len(stats.timeline)
        self.losses += stats.losses
        for act, s0, s1 in stats.timeline:
            c = self._costs.setdefault((act.stage, act.kind), [0.0, 0])
            c[0] += s1 - s0
            c[1] += 1

    def mean_costs(self, stages) -> list[float]:
        """The mean cost of each kind of action, for ``stages`` in order."""
        out = []
        for s in stages:
            for k in KINDS:
                total, count = self._costs.get((s, k), (0.0, 0))
                out.append(total / count if count else 0.0)
        return out


def summarise(rows: list[RankSample], cfg, grid, plan, p2p_latency: float, cuda: bool) -> dict:
    """The step's metrics from every rank's sample. Rank 0 also gets the
    bubble the schedule predicts with the measured costs (``plan.run``)."""
    bubble = []
    for d in range(cfg.dp):
        replica = [rows[grid.rank_of(d, p)] for p in range(cfg.pp)]
        span = max(r.span for r in replica)
        busy = sum(r.busy for r in replica)
        bubble.append(1.0 - busy / (cfg.pp * span) if span > 0 else 0.0)
    metrics = {
        "bubble": sum(bubble) / len(bubble),
        "bytes_sent": int(sum(r.bytes_sent for r in rows)),
        "dp_wait_ms": max(r.dp_wait for r in rows) * 1e3,
        "recv_wait_ms": max(r.recv_wait for r in rows) * 1e3,
        "max_rss_mb": max(r.rss_mb for r in rows),
        # the busiest rank's compute, and the longest exposed communication
        # (waits for tensors + the reduction's tail)
        "compute_ms": max(r.busy for r in rows) * 1e3,
        "exposed_comm_ms": max(
            r.recv_wait + r.dp_wait + r.tp_wait + r.ep_wait + r.cp_wait for r in rows
        )
        * 1e3,
        "bytes_sent_pp": int(sum(r.bytes_pp for r in rows)),
        "bytes_sent_dp": int(sum(r.bytes_dp for r in rows)),
        "bytes_sent_tp": int(sum(r.bytes_tp for r in rows)),
        # the rank that waited longest for its tensor-parallel collectives
        "tp_ms": max(r.tp_wait for r in rows) * 1e3,
        "bytes_sent_dp_reduce_scatter": int(sum(r.bytes_rs for r in rows)),
        "bytes_sent_dp_all_gather": int(sum(r.bytes_ag for r in rows)),
        "bytes_sent_dp_all_reduce": int(sum(r.bytes_ar for r in rows)),
        "bytes_sent_dp_all_to_all": int(sum(r.bytes_a2a for r in rows)),
        # the rank whose data-parallel collectives of each kind ran longest
        "dp_ms_reduce_scatter": max(r.time_rs for r in rows) * 1e3,
        "dp_ms_all_gather": max(r.time_ag for r in rows) * 1e3,
        "dp_ms_all_reduce": max(r.time_ar for r in rows) * 1e3,
        "dp_ms_all_to_all": max(r.time_a2a for r in rows) * 1e3,
        # the rank that holds the most of each
        "param_bytes": int(max(r.param_bytes for r in rows)),
        "grad_bytes": int(max(r.grad_bytes for r in rows)),
        "optim_bytes": int(max(r.optim_bytes for r in rows)),
        "param_peak_bytes": int(max(r.param_peak_bytes for r in rows)),
        "grad_peak_bytes": int(max(r.grad_peak_bytes for r in rows)),
        "comm_device_bytes": int(max(r.comm_bytes for r in rows)),
    }
    if cfg.model == "moe":
        metrics.update(_routing(rows))
    if cfg.cp > 1:
        metrics.update(_context(rows))
    metrics["cpu_s"] = sum(r.cpu_s for r in rows)
    metered = [r.energy_j for r in rows if r.energy_j >= 0]
    if metered:  # every host's packages (CPUs) or every GPU
        metrics["energy_j"] = sum(metered)
        metrics["energy_per_sample_j"] = sum(metered) / cfg.effective_batch
    if cuda:
        metrics["max_gpu_mem_mb"] = max(r.gpu_mb for r in rows)
    if grid.rank == 0:
        metrics.update(_predicted_bubble(rows, cfg, grid, plan, p2p_latency))
    return metrics


def _routing(rows: list[RankSample]) -> dict:
    """The MoE layers' figures over every rank: dropped token slots (a
    token's slot at one of its top-k experts) and their share, the mean
    load-balancing and z-losses per layer and micro-batch, and the experts'
    all-to-alls (bytes, and the rank that waited longest for them)."""
    slots, layers = sum(r.moe_slots for r in rows), sum(r.moe_layers for r in rows)
    return {
        "dropped_tokens": int(sum(r.moe_dropped for r in rows)),
        "dropped_fraction": sum(r.moe_dropped for r in rows) / slots if slots else 0.0,
        "balance_loss": sum(r.moe_balance for r in rows) / layers if layers else 0.0,
        "z_loss": sum(r.moe_z for r in rows) / layers if layers else 0.0,
        "bytes_sent_ep": int(sum(r.bytes_ep for r in rows)),
        "ep_ms": max(r.ep_wait for r in rows) * 1e3,
    }


def _context(rows: list[RankSample]) -> dict:
    """Context parallelism's figures: the bytes the cp rings carried, the
    rank that waited longest for them, and the CPU time of attention's
    arithmetic on the slowest and the fastest rank (the load-balanced
    mask's evenness)."""
    attention = [r.cp_attention for r in rows]
    return {
        "bytes_sent_cp": int(sum(r.bytes_cp for r in rows)),
        "cp_ms": max(r.cp_wait for r in rows) * 1e3,
        "cp_attention_cpu_ms_max": max(attention) * 1e3,
        "cp_attention_cpu_ms_min": min(attention) * 1e3,
    }


def _predicted_bubble(rows, cfg, grid, plan, p2p_latency: float) -> dict:
    replica0 = [rows[grid.rank_of(0, p)] for p in range(cfg.pp)]
    cost = {}
    for p_rank, row in enumerate(replica0):
        for j in range(cfg.virtual_stages):
            for k in KINDS:
                cost[(j * cfg.pp + p_rank, k)] = row.cost(j, k)
    host = [row.host for row in replica0]

    def costs_of(a):
        return cost.get((a.stage, a.kind), 0.0)

    # The prediction charges what was measured besides compute: the p2p
    # latency per transfer and each rank's host time per action.
    return {
        "bubble_predicted": plan.run(
            costs_of, latency=p2p_latency, overhead=host.__getitem__
        ).bubble,
        "bubble_ideal": plan.run(costs_of).bubble,
        "host_us_per_action": sum(host) / len(host) * 1e6,
    }


class Traffic:
    """Bytes this rank sent through its groups' engines: every group, the
    pipeline group and the data-parallel group, the last by kind of
    collective, and the tensor- and expert-parallel groups (clawcomm
    groups only).
    ``second_dp``: a second group of the data-parallel ranks (ZeRO-3's
    parameter gathers, the delayed exchanges of --sync-delay), counted as
    data-parallel."""

    DP_KINDS = ("reduce_scatter", "all_gather", "all_reduce", "all_to_all")

    def __init__(
        self,
        pp_group,
        dp_group,
        other_groups=(),
        second_dp=None,
        tp_group=None,
        ep_group=None,
        cp_group=None,
    ):
        inside = (tp_group, ep_group, cp_group)
        self._groups = (pp_group, dp_group, second_dp, inside, tuple(other_groups))
        self._engines: dict = {}  # per device, found on first use (after every group exists)

    def engines(self, device: str = "cpu") -> tuple[list, dict]:
        """(every group's engine, {"pp"/"dp"/"dp 2": engine}) for
        ``device``'s tensors ("cuda" has communicators of its own); empty
        off clawcomm."""
        if not dist.is_initialized() or dist.get_backend() != "clawcomm":
            return [], {}
        if device not in self._engines:
            import clawcomm

            pp, dp, params, (tp, ep, cp), others = self._groups
            groups = (None, pp, dp, params, tp, ep, cp, *others)
            engines = {id(g): clawcomm.engine_of(g, device) for g in groups}
            labelled = (("pp", pp), ("dp", dp), ("dp 2", params), ("tp", tp), ("ep", ep),
                        ("cp", cp))  # fmt: skip
            named = {k: engines[id(g)] for k, g in labelled if g is not None}
            self._engines[device] = (list(engines.values()), named)
        return self._engines[device]

    def sent(self) -> list[float]:
        """[every group, pp, dp, and dp's by DP_KINDS] bytes sent so far,
        then dp's seconds busy by DP_KINDS."""
        every, named = self.engines()
        stats = {id(e): e.comm_stats() for e in every}  # once each (named ones are among them)

        def total(e) -> int:
            return sum(v["bytes_sent"] for v in stats[id(e)].values())

        dps = [named[k] for k in ("dp", "dp 2") if k in named]

        def by_kind(field: str) -> list[int]:
            return [sum(stats[id(e)].get(k, {}).get(field, 0) for e in dps) for k in self.DP_KINDS]

        pp = total(named["pp"]) if "pp" in named else 0
        tp = total(named["tp"]) if "tp" in named else 0
        ep = total(named["ep"]) if "ep" in named else 0
        cp = total(named["cp"]) if "cp" in named else 0
        busy = [us / 1e6 for us in by_kind("busy_us")]
        return (
            [sum(total(e) for e in every), pp, sum(total(e) for e in dps)]
            + by_kind("bytes_sent")
            + busy
            + [tp, ep, cp]
        )

    @staticmethod
    def fields(sent: list[int]) -> dict:
        """``sent``'s figures (or differences of them) as RankSample fields."""
        names = (
            "bytes_sent",
            "bytes_pp",
            "bytes_dp",
            "bytes_rs",
            "bytes_ag",
            "bytes_ar",
            "bytes_a2a",
            "time_rs",
            "time_ag",
            "time_ar",
            "time_a2a",
            "bytes_tp",
            "bytes_ep",
            "bytes_cp",
        )
        return dict(zip(names, sent, strict=True))


def measure_p2p_latency(pp_group, pp_rank: int, pp: int, rounds: int = 20) -> float:
    """One-way latency of a small message between the first two stages'
    ranks (the median of ``rounds`` round trips, halved): the link cost
    the bubble prediction charges per transfer. 0 where pp == 1."""
    if pp_group is None:
        return 0.0
    # The other ranks wait for the end in a blocking receive, so that
    # neither their start-up nor a spinning barrier slows the ping-pong
    # down (two cores, four ranks).
    dist.barrier()
    done = torch.zeros(1)
    if pp_rank > 1:
        pp_group.recv([done], 0, 999_999).wait()
        return 0.0
    peer = 1 - pp_rank
    buf = torch.zeros(256)
    times = []
    for i in range(rounds):
        t0 = time.perf_counter()
        if pp_rank == 0:
            pp_group.send([buf], peer, 1_000_000 + i).wait()
            pp_group.recv([buf], peer, 1_000_000 + i).wait()
        else:
            pp_group.recv([buf], peer, 1_000_000 + i).wait()
            pp_group.send([buf], peer, 1_000_000 + i).wait()
        times.append(time.perf_counter() - t0)
    if pp_rank == 0:
        for r in range(2, pp):
            pp_group.send([done], r, 999_999).wait()
    return sorted(times)[rounds // 2] / 2  # the median round trip, halved


def step_metrics(step: int, loss, lr, grad_norm, step_s: float, samples: int) -> dict:
    """The metrics every rank has without the all-gather."""
    return {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "step_ms": step_s * 1e3,
        "samples_per_s": samples / step_s,
    }


class MetricsSink:
    """Where rank 0's step metrics go: a JSON-lines file (appended to when
    resuming), TensorBoard scalars (``train/<metric>``) and a tqdm progress
    bar over ``steps``; each is off when its argument is empty."""

    def __init__(self, path: str | None, tensorboard: str, steps: int, append: bool = False):
        self.file = open(path, "a" if append else "w") if path else None  # noqa: SIM115
        self.board = None
        if tensorboard:
            from clawcomm._optional import require

            require("tensorboard", "clawcomm train --tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(tensorboard)
        self.bar = None
        if steps:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, unit="step", leave=False)

    def write(self, m: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(m) + "\n")
            self.file.flush()
        if self.board is not None:
            for key, value in m.items():
                if key != "step" and isinstance(value, int | float):
                    self.board.add_scalar(f"train/{key}", value, m["step"])
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{m['loss']:.4f}", bubble=f"{m['bubble']:.2f}")

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, *exc) -> None:
        for thing in (self.bar, self.file, self.board):
            if thing is not None:
                thing.close()
