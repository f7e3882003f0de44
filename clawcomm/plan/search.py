"""The plan's search (step 2 of ``clawcomm.plan``): the candidate layouts,
each predicted (``step``), ranked within the memory limit.

A candidate is named by ``TrainConfig``'s own fields (``dp``, ``tp``, ``pp``,
``schedule``, ``virtual_stages``, ``microbatches``, ``micro_batch_size``,
``zero``, ``compression``, ``sync``), so that applying it to a config is
one ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

from clawcomm.parallel.context import kv_bytes
from clawcomm.parallel.expert import traffic as expert_traffic
from clawcomm.parallel.tensor.parallelize import traffic as tensor_traffic
from clawcomm.pipeline.schedules import check_schedule_args
from clawcomm.plan import pass_order, shared_cores
from clawcomm.plan.check import model_flags
from clawcomm.plan.profile import profile, rank_threads, recompute_profile
from clawcomm.plan.report import report
from clawcomm.plan.step import Prediction, compressor, predict
from clawcomm.train.moe import layers_of

SCHEDULE_CHOICES = (("gpipe", 1), ("1f1b", 1), ("zb1", 1), ("interleaved", 2))
# What --search-compression can price: a compressor whose Compressor.wire is
# known from the gradient's size (check_wires asks it).
PRICED_WIRES = ("every compressor spec but those whose bytes the values decide (threshold, dgc, "
                "a coded +ec wire)")  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    dp: int
    pp: int
    schedule: str
    virtual_stages: int
    microbatches: int
    micro_batch_size: int
    zero: int
    compression: str | None = None  # searched ('' none); None: the command's own
    sync: str | None = None  # searched; None: the command's own
    tp: int = 1
    activation_checkpoint: str | None = None  # searched under a memory limit; None: the command's
    ep: int = 1  # --model moe: experts spread over ep of the dp ranks
    cp: int = 1  # gpt: each sequence split over cp ranks

    @property
    def averaged_over(self) -> int:
        """The ranks each gradient is averaged over (``TrainConfig``'s rule)."""
        return self.dp * self.cp

    @property
    def work_split(self) -> int:
        """The ranks a layer's passes are split over: its TP group's, each on
        1/cp of the tokens."""
        return self.tp * self.cp

    def flags(self) -> list[str]:
        out = ["--dp", str(self.dp)] + (["--tp", str(self.tp)] if self.tp > 1 else [])
        out += ["--ep", str(self.ep)] if self.ep > 1 else []
        out += ["--cp", str(self.cp)] if self.cp > 1 else []
        out += ["--pp", str(self.pp)]
        if self.pp > 1:
            out += ["--schedule", self.schedule, "-v", str(self.virtual_stages)]
        out += ["--microbatches", str(self.microbatches)]
        out += ["--micro-batch-size", str(self.micro_batch_size), "--zero", str(self.zero)]
        out += ["--compression", self.compression] if self.compression else []
        if self.activation_checkpoint:
            out += ["--activation-checkpoint", self.activation_checkpoint]
        return out + (["--sync", self.sync] if self.sync else [])

    def name(self) -> str:
        v = self.virtual_stages
        pipe = f" {self.schedule}" + (f" v{v}" if v > 1 else "") if self.pp > 1 else ""
        zero = f" ZeRO-{self.zero}" if self.zero else ""
        wire = f" {self.compression}" if self.compression else ""
        sync = f" {self.sync}" if self.sync else ""
        if self.activation_checkpoint not in (None, "none"):
            sync += f" recompute {self.activation_checkpoint}"
        tp = f"tp {self.tp} x " if self.tp > 1 else ""
        ep = f" (ep {self.ep})" if self.ep > 1 else ""
        ep += f" x cp {self.cp}" if self.cp > 1 else ""
        return (f"dp {self.dp}{ep} x {tp}pp {self.pp}{pipe}, {self.microbatches} x "
                f"{self.micro_batch_size}{zero}{wire}{sync}")  # fmt: skip

    def shape(self) -> tuple:
        """The layout's shape: (dp, pp, schedule, virtual_stages, tp, ep),
        and cp where it is above 1."""
        out = self.dp, self.pp, self.schedule, self.virtual_stages, self.tp, self.ep
        return out + (self.cp,) if self.cp > 1 else out


def apply(cfg, c: Candidate):
    """``cfg`` with the candidate's layout (a searched field it leaves None
    keeps the command's)."""
    chosen = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
    chosen = {k: v for k, v in chosen.items() if v is not None}
    return dataclasses.replace(cfg, **chosen, accumulation=1, global_batch=0, layout="")


def _runs(cfg, world: int) -> bool:
    try:
        cfg.check(world)
        return True
    except ValueError:  # (ZeRO beside a sync method, say)
        return False


def microbatch_counts(schedule: str, pp: int, v: int, per_replica: int) -> list[int]:
    """The micro-batch counts tried for a replica's batch of ``per_replica``
    samples: pp, 2 pp and 4 pp (1, 2, 4 at pp 1) where the schedule runs
    with them and the batch divides; where none does, the others from pp to
    4 pp; where none of those, the smallest count above that runs."""

    def runs(m: int) -> bool:
        try:
            check_schedule_args(schedule, pp, m, v)
        except ValueError:
            return False
        return per_replica % m == 0

    first = [m for m in (pp, 2 * pp, 4 * pp) if runs(m)]
    if first:
        return first
    within = [m for m in range(pp, 4 * pp + 1) if runs(m)]
    if within:
        return within
    beyond = next((m for m in range(4 * pp + 1, per_replica + 1) if runs(m)), None)
    return [beyond] if beyond else []


def candidates(world: int, layers: int, global_batch: int, compressions=(None,), syncs=(None,),
               tps=(1,), recomputes=(None,), eps=(1,), cps=(1,)):  # fmt: skip
    """Every layout the trainer can run ``global_batch`` samples a step with
    (with each of ``compressions`` and ``syncs`` where dp > 1), at each
    tensor-parallel width of ``tps`` that divides the world, with each
    activation-checkpointing mode of ``recomputes``, each expert-parallel
    width of ``eps`` that divides dp, and each context-parallel width of
    ``cps`` that divides the world."""
    splits = ((t, p, c) for t in tps for c in cps for p in range(1, min(world, layers) + 1))
    for tp, pp, cp in splits:
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        if global_batch % dp:
            continue
        per_replica = global_batch // dp
        schedules = SCHEDULE_CHOICES if pp > 1 else (("1f1b", 1),)
        for schedule, v in schedules:
            if pp * v > layers:
                continue
            for m in microbatch_counts(schedule, pp, v, per_replica):
                for zero in range(4) if dp > 1 else (0,):
                    for wire in compressions if dp > 1 else compressions[:1]:
                        for sync in syncs if dp > 1 else (None,):
                            for mode, ep in ((r, e) for r in recomputes for e in eps):
                                if dp % ep == 0:
                                    yield Candidate(dp, pp, schedule, v, m, per_replica // m,
                                                    zero, wire, sync, tp, mode, ep, cp)  # fmt: skip


def plan(cfg, world: int, memory_mb: float = 0.0, cores: int | None = None, cost=None,
         hosts: int = 1, compressions: list[str] | None = None,
         syncs: list[str] | None = None, trial_steps: int = shared_cores.TRIAL_STEPS,
         trial_on_hosts: bool = False, link: str | None = None,
         tps: list[int] | None = None):  # fmt: skip
    """(predictions best first, those over the memory limit, the profile).
    ``cores``: what the ranks of one host share (this machine's by default);
    ``compressions``: the wires to search (``check_wires``; '' is none);
    ``syncs``: the sync methods to search (``outer.parse_sync``'s);
    ``trial_steps``: where ranks outnumber cores, the steps of the trial
    that measures a compute action's cost there (``shared_cores``; 0: none),
    on ``hosts`` namespace hosts with links at ``link`` if ``trial_on_hosts``;
    ``tps``: the tensor-parallel widths to search (None: every divisor of
    the world that the model splits by)."""
    from clawcomm.train import models
    from clawcomm.train.outer import parse_sync

    if world < 1:
        raise ValueError(f"--nproc {world}: a world needs at least 1 rank")
    if hosts < 1 or world % hosts:
        raise ValueError(f"--hosts {hosts} does not divide the world of {world} ranks")
    built = models.build(dataclasses.replace(cfg, dp=1, pp=1))
    layers = len(list(built[0]))
    batch = global_batch(cfg)
    wires = check_wires(compressions) if compressions else [None]
    if compressions:
        cfg = dataclasses.replace(cfg, compression="")  # the search decides it
    methods = check_syncs(syncs) if syncs else [None]
    tps = tps or [t for t in range(1, world + 1) if world % t == 0]
    # Under a memory limit, recomputing activations is one more way to fit.
    modes = [None]
    if memory_mb:
        modes = ["none", "full"] if cfg.model != "gpt" else ["none", "selective", "full"]
    # --model moe: the experts spread over any width the world's dp can take
    eps = [e for e in range(1, world + 1) if world % e == 0] if cfg.model == "moe" else [1]
    # the gpt: its sequences split over any width that cuts them in 2 cp chunks
    cps = [c for c in range(1, world + 1) if world % c == 0 and cfg.seq_len % (2 * c) == 0]
    cps = cps if cfg.model == "gpt" and not cfg.cp > 1 else [cfg.cp]
    cands = [c for c in candidates(world, layers, batch, wires, methods, tps, modes, eps, cps)
             if _runs(apply(cfg, c), world)]  # fmt: skip
    if not cands:
        raise ValueError(
            f"no layout runs a global batch of {batch} on {world} ranks with {layers} layers: "
            "choose a global batch that some dp (a divisor of the world) divides"
        )
    gpu = on_gpu(cfg)
    split = any(c.schedule == "zb1" for c in cands)
    t0 = time.perf_counter()
    prof = profile(cfg, [c.micro_batch_size for c in cands], built=built, gpu=gpu, split=split)
    if memory_mb:  # what each recomputation keeps and costs
        recompute_profile(cfg, prof, [m for m in modes if m != "none"],
                          [c.micro_batch_size for c in cands], built, gpu)  # fmt: skip
    if any(c.tp > 1 for c in cands):  # what each layer sends split (the TP room says)
        sp = dataclasses.replace(cfg, tp=2).sequence_parallel_on
        prof.tp_traffic = {mbs: tensor_traffic(built[0], mbs, cfg.seq_len, sp)
                           for mbs in {c.micro_batch_size for c in cands}}  # fmt: skip
    if any(c.ep > 1 for c in cands):  # what each layer's experts hold and send (the EP room says)
        moes = [layers_of(layer) for layer in built[0]]
        prof.ep_traffic = {mbs: expert_traffic(moes, mbs, cfg.seq_len)
                           for mbs in {c.micro_batch_size for c in cands}}  # fmt: skip
    if any(c.cp > 1 for c in cands):  # what each layer's ring passes (the CP room says)
        prof.kv_bytes = kv_bytes(built[0], cfg.seq_len)
    cores = cores or os.cpu_count() or 1
    cap = cfg.bucket_cap_mb * 2**20
    shapes = [shape for layer in prof.tensors for shape in layer]
    replicas = sorted({c.dp for c in cands if c.dp > 1})  # a decode adds each replica's pairs
    codec = codec_seconds([w for w in wires if w], int(sum(prof.params)), replicas, shapes, gpu)
    sync = parse_sync(cfg.sync)

    def predict_all() -> list[Prediction]:
        return [predict(c, prof, cores, cost, gpu, hosts, cap, codec, sync, cfg.sync_delay,
                        cfg.compression, apply(cfg, c).reshards_after_forward,
                        apply(cfg, c).tp_overlap_on)
                for c in cands]  # fmt: skip

    tried = shared_cores.settle(cfg, cands, prof, world, hosts, cores, gpu, trial_steps,
                              predict_all, trial_on_hosts, link)  # fmt: skip
    if not gpu:  # the orders get what the plan's time has left (pass_order.PLAN_SECONDS)
        left = pass_order.PLAN_SECONDS - (time.perf_counter() - t0)
        prof.order, seconds = pass_order.measure(cfg, cands, prof, built, left)
        prof.seconds += seconds
    if tried:  # tau, with the trial's passes in its schedule's order
        prof.action_s = shared_cores.measured_tau(*tried, prof)
    preds = predict_all()
    fits = [p for p in preds if not memory_mb or p.memory_mb <= memory_mb]
    over = [p for p in preds if memory_mb and p.memory_mb > memory_mb]
    fits.sort(key=lambda p: (p.step_ms, p.memory_mb))
    return fits, over, prof


def on_gpu(cfg) -> bool:
    """Whether the ranks compute on GPUs (``--device``, as the trainer resolves it)."""
    from clawcomm.train import device

    return device.check(cfg.device) == "cuda"


def codec_seconds(wires: list[str], params: int, replicas: list[int], shapes=None,
                  gpu: bool = False) -> dict[tuple[str, int], float]:  # fmt: skip
    """(wire, dp) -> one codec pass over ``params`` gradients of ``shapes``
    with dp replicas' messages to decode, for each of ``replicas``, timed as
    a rank runs it (one intra-op thread on the CPU: with the machine's two,
    a loaded machine timed PowerSGD's small products 80x slower)."""
    with rank_threads(gpu):
        return {(w, dp): compressor(w).codec_seconds(params, dp, shapes)
                for w in wires for dp in replicas}  # fmt: skip


def check_wires(specs: list[str]) -> list[str]:
    """The searched compressions ('' for none), or ValueError naming one
    whose bytes on the wire the values decide (the plan cannot price it)."""
    out = []
    for s in specs:
        s = "" if s in ("none", "") else s
        try:
            comp = compressor(s)
        except ValueError as e:
            raise ValueError(f"--search-compression: {e}") from None
        if comp.coded:
            raise ValueError(f"--search-compression {s!r}: a coded wire sends what the values "
                             "decide; the plan costs it uncoded (drop +ec)")  # fmt: skip
        if comp.wire(1 << 20, 2) is None:
            raise ValueError(
                f"--search-compression {s!r}: what it sends depends on the gradient's values, "
                f"which the plan cannot price from the gradient's size (it prices "
                f"{PRICED_WIRES}): compare it with clawcomm experiment compression"
            )
        if s not in out:
            out.append(s)
    return out


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

    return (CostModel.load(path) if path else CostModel()).with_link(link)


def choose(cfg, world: int, say=print):
    """``cfg`` with the plan's first layout (``clawcomm train --layout auto``;
    a --tp above 1 is kept, else tp is searched too; ep is searched for
    --model moe)."""
    preds, over, prof = plan(cfg, world, cfg.max_memory_mb,
                             tps=[cfg.tp] if cfg.tp > 1 else None)  # fmt: skip
    if not preds:
        raise ValueError(f"--layout auto: every layout needs more than --max-memory-mb "
                         f"{cfg.max_memory_mb:g}")  # fmt: skip
    say(report(preds, over, prof, ["--nproc", str(world), *model_flags(cfg)], 3))
    crowded = shared_cores.caveat(prof, world, os.cpu_count() or 1)
    if crowded:
        say("# " + crowded)
    return apply(cfg, preds[0].cand)
