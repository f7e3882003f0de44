"""The plan's model of one training step of a candidate layout (step 3 of
``clawcomm.plan``): its time in four terms and the memory of its fullest
rank, from the profile and the answers of the rooms that own each rule.

- **Pipeline**: the schedule played on the pipeline's clock
  (``pipeline.clock``) with the profiled costs of each stage (stages cut by
  parameters, as the trainer cuts them; each pass kind scaled by its
  schedule's order, ``pass_order``), and the cost model's latency per
  activation (over the link where two stages sit on different hosts: ranks
  numbered host by host). Where a host's CPU ranks outnumber its cores,
  the ranks take turns on the cores (``shared_cores``).
- **Data-parallel traffic**: what the compressor says one reduction sends
  (``Compressor.wire``, dense float32 by default) priced by the cost model
  on the hosts the dp group spans, plus its codec's passes, in the
  trainer's buckets on the rank's timeline (``dp_timeline``: what runs past
  the pipeline's end, and what the next forward waits for ZeRO's gathers,
  is exposed; ZeRO-3's gathers as many as ``parallel.zero3`` says, each
  behind the layer before it); local SGD and DiLoCo meet once every H
  steps instead.
- **Tensor parallelism** (tp > 1): each layer's passes take 1/tp of their
  profiled time, plus the collectives its split form makes over the TP
  group (what ``parallel.tensor`` says each layer sends) priced by the cost
  model on one host; overlapped (``--tp-overlap``), only what the pass's
  computation does not cover. Parameters, gradients, optimizer state and
  activations per rank are 1/tp of the layer's (the replicated LayerNorms
  and biases are not counted apart).
- **Context parallelism** (gpt, cp > 1): each layer's passes take 1/cp of
  their profiled time (the load-balanced mask gives every rank 1/cp of
  attention's work too), plus what the ring's key/value hops take beyond
  the pass's computation (cost model: a message between two ranks); the
  activations are 1/cp; the gradients are reduced, and ZeRO shards, over
  dp x cp ranks.
- **Expert parallelism** (--model moe, ep > 1): each MoE layer's passes
  add its all-to-alls over the ep group (``parallel.expert.traffic``:
  every token slot's activation, priced as an even exchange, though a
  router's are uneven); a rank holds 1/ep of the experts' parameters and
  optimizer state. Their gradients are priced in the data-parallel
  reduction as the dense ones' (the trainer reduces them after it, over
  the dp/ep ranks holding the same experts).
- **Activation checkpointing** (searched under a memory limit): each
  layer's backward as profiled with the recomputation, and the activations
  it keeps as measured against no recomputation (``profile.recompute``).
- **Optimizer**: the profiled step on the stage's (shard of its) parameters.
- **Memory**: the model state ZeRO leaves a rank (``parallel.zero``), what
  the compressor keeps between steps (``Compressor.state_bytes``), and the
  activations the schedule holds for backward (``pipeline.schedules``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from clawcomm.compression import get_compressor
from clawcomm.cost_model import CostModel, Topology, predict_sequence
from clawcomm.cost_model import predict as comm_time
from clawcomm.parallel.zero import step_peak_bytes
from clawcomm.parallel.zero3 import gathered_bytes, gathers_per_round
from clawcomm.pipeline.clock import ScheduleClock
from clawcomm.pipeline.schedules import build as build_schedule
from clawcomm.pipeline.schedules import held_for_backward
from clawcomm.plan import pass_order, shared_cores
from clawcomm.plan.dp_timeline import (
    buckets,
    exposed_gathers,
    exposed_reduction,
    exposed_unit_gathers,
    rank_timeline,
)
from clawcomm.plan.profile import Profile
from clawcomm.train.config import TrainConfig


@dataclass
class Prediction:
    cand: object  # the search's Candidate
    compute_ms: float  # the busiest rank's compute in the pipeline
    bubble_ms: float  # the pipeline's makespan beyond it
    comm_ms: float  # exposed data-parallel communication
    opt_ms: float  # the optimizer step
    memory_mb: float  # the fullest rank's tensors

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.bubble_ms + self.comm_ms + self.opt_ms


@functools.lru_cache(maxsize=64)
def compressor(spec: str | None):
    """The compressor of a ``--compression`` spec ('' or None: dense),
    cached: the plan asks for every bucket of every candidate, and only
    reads it."""
    return get_compressor(spec or "none")


def reduction_seconds(comp, zero: int, nbytes: float, topology: Topology, cost: CostModel,
                      codec_s: float, stretch: float = 1.0, shapes=None) -> float:  # fmt: skip
    """One reduction of ``nbytes`` of float32 gradients (parameters of
    ``shapes`` laid out back to back) over ``topology`` with ``comp`` on the
    wire (ZeRO: its sharded reduction): what the compressor says it sends,
    priced by the cost model, times ``stretch`` (ranks that share cores),
    plus its codec passes at ``codec_s`` each."""
    wire = comp.wire(max(1, int(nbytes // 4)), topology.size, zero >= 1, shapes)
    seconds = predict_sequence(wire.collectives, topology, cost)
    return stretch * seconds + wire.codec_passes * codec_s


def placement(c, hosts: int):
    """Where the candidate's ranks sit on ``hosts`` hosts (numbered host by
    host, as torchrun numbers them; the trainer's rank is (pp_rank * dp +
    dp_rank) * tp + tp_rank): (how many replicas' pipeline ranks p and q are
    on different hosts, the cost model's topology of the widest dp group;
    both for TP rank 0)."""
    dp = c.averaged_over  # (every replica's cp ranks: each its own pipeline, one dp group)
    per_host = dp * c.tp * c.pp // hosts
    host = lambda d, p: (p * dp + d) * c.tp // per_host  # noqa: E731

    def crossing(p: int, q: int) -> int:
        return sum(host(d, p) != host(d, q) for d in range(dp))

    spans = max(len({host(d, p) for d in range(dp)}) for p in range(c.pp))
    return crossing, Topology(spans, -(-dp // spans))


def predict(c, prof: Profile, cores: int, cost=None, gpu: bool = False, hosts: int = 1,
            cap_bytes: float = 25 * 2**20, codec=None, sync=("every-step", 1),
            sync_delay: int = 0, compression: str = "",
            reshard: bool | None = None, tp_overlap: bool = False) -> Prediction:  # fmt: skip
    """The candidate's step time and memory (the module docstring) on
    ``hosts`` hosts of ``cores`` cores each. ``codec``: (wire, dp) -> seconds
    of one codec pass of a searched compression over the whole model's
    gradient (``search.codec_seconds``);
    ``sync``: ``outer.parse_sync`` of the command's --sync, unless the
    candidate carries a searched one; ``compression``: the command's own
    wire, for the memory it keeps (its time is costed only where searched);
    ``reshard``: ZeRO-3 resharding after forward (None: the trainer's
    default for the candidate, ``TrainConfig.reshards_after_forward``);
    ``tp_overlap``: the candidate's TP collectives overlapped with the
    layers' computation (``TrainConfig.tp_overlap_on``)."""
    cost, codec = cost or CostModel(), codec or {}
    if reshard is None:
        reshard = TrainConfig(dp=c.dp, pp=c.pp, zero=c.zero).reshards_after_forward
    if c.sync is not None:  # searched
        from clawcomm.train.outer import parse_sync

        sync = parse_sync(c.sync)
    stages = c.pp * c.virtual_stages
    span, share = shared_cores.stages(c, prof)
    crossing, dp_topology = placement(c, hosts)
    world = c.averaged_over * c.tp * c.pp
    slow = 1.0 if gpu else max(1.0, world / hosts / cores)  # ranks sharing cores
    mbs = c.micro_batch_size
    # Only the share of a layer's time spent on a core slows down (waiting layers do not).
    scale = [1.0 + (slow - 1.0) * sh for sh in share]

    def per_stage(times: list[float], scale: list[float], tp_pass: str = "") -> list[float]:
        split = [scale[i] * times[i] / c.work_split for i in range(len(times))]
        if tp_pass:  # what the split layers' collectives and the exchanges add
            split = [t + tp_seconds(i, tp_pass, t) + ep_seconds(i, tp_pass)
                     + cp_seconds(i, tp_pass, t) for i, t in enumerate(split)]  # fmt: skip
        return [sum(split[i] for i in r) for r in span]

    def cp_seconds(i: int, kind: str, compute: float) -> float:
        """What the cp ring adds to attention layer i's pass: its keys and
        values sent cp - 1 times forward, and cp - 1 times with cp sums of
        their gradients backward, between neighbours (the cost model's
        message between two ranks), where the pass's computation does not
        cover them."""
        if c.cp == 1 or not prof.kv_bytes or not prof.kv_bytes[i]:
            return 0.0
        nbytes = prof.kv_bytes[i] * c.micro_batch_size / (c.cp * c.tp)
        hops = c.cp - 1 if kind == "F" else 2 * c.cp - 1
        net = c.tp * c.cp > c.averaged_over * c.tp * c.pp // hosts  # (a ring across hosts)
        alpha, beta = (cost.net_alpha, cost.net_beta) if net else (cost.shm_alpha, cost.shm_beta)
        return max(0.0, slow * hops * (alpha + nbytes * beta) - compute)

    def ep_seconds(i: int, kind: str) -> float:
        """What layer i's experts add to a pass at ep > 1: its all-to-alls
        (forward: the counts, then the tokens there and back; backward: their
        gradients there and back), each priced as an even exchange of every
        slot's activation, CPU work that slows where ranks outnumber cores."""
        nbytes = prof.ep_traffic[mbs][i][1] if c.ep > 1 else 0.0
        if not nbytes:
            return 0.0
        group = expert_topology(c, hosts)
        counts = comm_time("all_to_all", "auto", 8.0 * c.ep, group, cost) if kind == "F" else 0.0
        return slow * (2 * comm_time("all_to_all", "auto", nbytes, group, cost) + counts)

    def tp_seconds(i: int, kind: str, compute: float) -> float:
        """What layer i's split form adds to a pass of ``compute`` seconds:
        each collective as the cost model prices it, plus the copy that
        puts its tokens in order (the whole tensor, at memory speed), both
        CPU work that slows where ranks outnumber cores (whatever share of
        the layer's own time is on a core); overlapped, the all-gathers and
        reduce-scatters only where the pass's computation does not cover
        them."""
        if c.tp == 1:
            return 0.0
        group = Topology(1, c.tp)

        def seconds(op: str, nbytes: float) -> float:
            return slow * (comm_time(op, "auto", nbytes, group, cost) + nbytes * cost.shm_beta)

        sent = prof.tp_traffic[mbs][i][kind]
        split = sum(seconds(op, b) for op, b in sent if op != "all_reduce")
        blocking = sum(seconds(op, b) for op, b in sent if op == "all_reduce")
        if tp_overlap:  # exchanged block by block, behind the blocks computed meanwhile
            split = max(0.0, split - compute)
        return split + blocking

    def pass_costs(scale: list[float]) -> dict[str, list[float]]:  # each pass kind's, a stage
        out = {"F": per_stage(prof.forward[mbs], scale, "F"),
               "B": per_stage(backward, scale, "B")}  # fmt: skip
        if mbs in prof.input_grad:  # zero-bubble's split backward, as profiled
            again = [b - p for b, p in zip(backward, prof.backward[mbs], strict=True)]
            i_pass = [i + a for i, a in zip(prof.input_grad[mbs], again, strict=True)]
            out["I"] = per_stage(i_pass, scale, "B")  # (the recomputation runs in I)
            out["W"] = per_stage(prof.weight_grad[mbs], scale)
        else:
            out["I"] = out["W"] = [b / 2 for b in out["B"]]
        return out

    order = pass_order.of(c, prof)
    backward = prof.backward[mbs]
    recomputed = prof.recompute.get(c.activation_checkpoint or "none", {}).get(mbs)
    if recomputed:  # each layer's backward with its recomputation
        backward = recomputed[1]

    def costing(table: dict[str, list[float]]):
        def action_cost(a) -> float:  # in the schedule's order (pass_order)
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

    pipeline = ScheduleClock(build_schedule(c.schedule, c.pp, c.microbatches, c.virtual_stages))
    sim = pipeline.run(action_cost, latency if c.pp > 1 else 0.0)
    busy = max(sim.busy.values())
    # Per rank: its stages' parameters (the fullest rank decides).
    held = held_params(c, prof)
    rank_params = [
        sum(held[i] for s in range(stages) if s % c.pp == r for i in span[s]) / c.tp
        for r in range(c.pp)
    ]
    p_max = max(rank_params)
    grad_bytes = 4 * p_max
    comm = 0.0
    if c.averaged_over > 1 and sync[0] != "every-step":
        # local SGD / DiLoCo: no gradient exchange a step; the replicas' parameters
        # are averaged every H steps (on a thread of its own with --sync-delay)
        meeting = comm_time("all_reduce", "auto", grad_bytes, dp_topology, cost)
        comm = 0.0 if sync_delay else meeting / sync[1]
    elif c.averaged_over > 1:
        # The buckets are reduced while the host's ranks still compute their
        # backward: where ranks outnumber cores, the reduction's copies, sums
        # and sockets get a core's share as the layers do (the cost model's
        # figures are for a rank with a core of its own).
        crowded = 1.0 + (slow - 1.0) * sum(share) / len(share)
        wire = c.compression or ""  # searched, so costed (the command's own: as float32)
        comp = compressor(wire)
        tensors = prof.tensors or [[(int(n),)] for n in prof.params]
        w_layers = prof.weight_grad.get(mbs) or [b / 2 for b in prof.backward[mbs]]
        passes = {"F": prof.forward[mbs], "B": backward, "W": w_layers}
        gathers = 0.0
        gather = lambda b: crowded * comm_time("all_gather", "auto", b / c.tp, dp_topology, cost)  # noqa: E731
        for r in range(c.pp):
            rank = rank_timeline(sim, r, span, lambda k, i: scale[i] * passes[k][i] / c.work_split,
                                 tensors)  # fmt: skip
            bs = buckets(rank, cap_bytes)
            pass_s = codec.get((wire, c.dp), 0.0)  # over the whole model's gradient
            codec_s = slow * pass_s * rank_params[r] / max(1.0, sum(prof.params))
            reduce = lambda b, share, shapes, cs=codec_s: reduction_seconds(  # noqa: E731
                comp, c.zero, b / c.tp, dp_topology, cost, share * cs, crowded, shapes
            )
            comm = max(comm, exposed_reduction(bs, sim.makespan, reduce))
            if c.zero in (1, 2):  # the updated shards gathered behind the next forward
                gathers = max(gathers, exposed_gathers(rank, bs, gather))
        if c.zero == 3:  # each layer gathered as zero3 says, behind the layer before it
            per_round = gathers_per_round(c.microbatches, reshard)
            layer_gather = lambda i: crowded * comm_time(  # noqa: E731
                "all_gather", "auto", 4 * prof.params[i] / c.tp, dp_topology, cost
            )
            gathers = max(
                exposed_unit_gathers(
                    [([(i, scale[i] * passes["F"][i] / c.work_split) for i in span[s]],
                      [(i, scale[i] * passes["B"][i] / c.work_split) for i in reversed(span[s])])
                     for s in range(stages) if s % c.pp == r],
                    layer_gather, per_round)
                for r in range(c.pp)
            )  # fmt: skip
        comm += gathers
    opt = slow * prof.opt_s_per_param * p_max / (c.averaged_over if c.zero >= 1 else 1)
    memory = _memory(c, prof, sim.schedule, span, compression, sync, reshard)
    busy += slow * prof.host_s  # the trainer's own time, on the busiest rank
    makespan = sim.makespan + slow * prof.host_s
    if shared_cores.crowded(world, hosts, cores, gpu):
        # the ranks take turns on the cores (shared_cores): a rank alone in a bubble
        # runs at a core's speed; and no less than the host's CPU over its cores,
        # tau a compute action included
        alone = pass_costs([1.0] * len(scale))
        on_core = shared_cores.core_shares(span, share, prof, mbs)
        shared = shared_cores.shared_makespan(pipeline, c, costing(alone), on_core,
                                              latency if c.pp > 1 else lambda p, q: 0.0,
                                              hosts, cores)  # fmt: skip
        per_rank = shared_cores.rank_seconds(c, prof, span, share, prof.action_s, sim.schedule)
        floor = shared_cores.floor(c, per_rank, hosts, cores)
        makespan = max(shared + slow * prof.host_s, floor)
        busy = min(busy, makespan)
    return Prediction(c, 1e3 * busy, 1e3 * (makespan - busy), 1e3 * comm, 1e3 * opt, memory)


def held_params(c, prof: Profile) -> list[float]:
    """Each layer's parameters a rank holds: its experts' 1/ep (at ep > 1),
    the rest whole."""
    if c.ep == 1:
        return list(prof.params)
    experts = [e for e, _ in prof.ep_traffic[c.micro_batch_size]]
    return [p - e + e / c.ep for p, e in zip(prof.params, experts, strict=True)]


def expert_topology(c, hosts: int) -> Topology:
    """An expert-parallel group's hosts: ep data-parallel neighbours, tp
    ranks apart, so ep x tp consecutive ranks."""
    per_host = c.averaged_over * c.tp * c.pp // hosts
    spanned = max(1, c.ep * c.tp // per_host)
    return Topology(spanned, c.ep // spanned)


def _memory(c, prof: Profile, schedule, span, compression: str, sync, reshard: bool) -> float:
    """The fullest rank's MB at its step's peak, as the trainer's
    ``--max-memory-mb`` counts it (``parallel.zero.step_peak_bytes``; at
    ZeRO-3 the layers held whole beside the shards, ``zero3.gathered_bytes``),
    plus what the wire keeps between steps (error feedback, momentum;
    replicas that meet every step only) and the activations the rank's
    schedule holds for backward, which the trainer's limit does not count."""
    wire = c.compression if c.compression is not None else compression
    keeps = c.averaged_over > 1 and sync[0] == "every-step"
    saved = prof.saved[c.micro_batch_size]
    recomputed = prof.recompute.get(c.activation_checkpoint or "none", {})
    if c.micro_batch_size in recomputed:  # what each layer keeps with the recomputation
        kept = recomputed[c.micro_batch_size][0]
        saved = [b * k for b, k in zip(saved, kept, strict=True)]
    most = 0.0
    local = held_params(c, prof)
    spread = [e / c.ep for e, _ in prof.ep_traffic[c.micro_batch_size]] if c.ep > 1 else None
    for r in range(c.pp):
        layers = [i for s in range(len(span)) if s % c.pp == r for i in span[s]]
        params = sum(local[i] for i in layers) / c.tp
        # ZeRO leaves the spread experts whole: not sharded, and never gathered.
        dense = [local[i] / c.tp - (spread[i] if spread else 0.0) for i in layers]
        whole = gathered_bytes([4.0 * d for d in dense], reshard)
        experts = params - sum(dense)
        held = sum(step_peak_bytes(params - experts, c.averaged_over, c.zero, whole).values())
        held += sum(step_peak_bytes(experts, 1, 0).values())
        held += compressor(wire).state_bytes(params) if keeps else 0.0
        acts = held_for_backward(
            schedule[r], lambda s: sum(saved[i] for i in span[s]) / c.work_split
        )
        most = max(most, held + acts)
    return most / 2**20
