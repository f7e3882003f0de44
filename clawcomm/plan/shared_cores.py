"""The plan where a host's CPU ranks outnumber its cores (``plan.predict``'s
makespan with the ranks taking turns, its floor, and the trial that
measures what the floor needs).

There the ranks' threads take turns on the cores, so a step takes at least
the CPU-seconds the host's ranks spend in it over its cores, however well
the schedule overlaps them: a pipeline's bubble is then not idle time but
another rank's turn, and what a schedule saves in bubble it can lose in
actions. Each candidate's makespan is at least

    max over hosts of  sum over its ranks of (CPU of the rank's compute actions,
                       as profiled + tau x its compute actions + the trainer's own time)
                       / the host's cores

where tau is what a compute action costs there beyond its profile: the
executor's bookkeeping around it, the progress thread moving its tensors,
the caches refilled after another rank's turn. In one process that is a few
microseconds; with 4 GPT ranks on the 2-core reference machine it is about
half a millisecond, which is what makes a zero-bubble schedule (three
actions a micro-batch) slower there than 1F1B (two), though it idles less.

Within that bound, ``shared_makespan`` runs the schedule with the ranks
taking turns: a rank alone in its bubble has a core to itself, where
slowing every action alike (ranks / cores) priced gpipe at pp 4 with 4
micro-batches 39% above its measured step at 4 GPT ranks on 2 cores.

``trial`` measures tau on this machine: one candidate (``trial_candidate``)
trains for a few steps (``clawcomm train``), and tau is the
ranks' CPU-seconds a step (its ``cpu_s`` metric: every thread of every
rank's process) beyond what the profile accounts for, per compute action.
"""

from __future__ import annotations

import os

from clawcomm.pipeline.schedules import build as build_schedule
from clawcomm.plan import pass_order
from clawcomm.train.stage_cuts import balanced_cuts

TRIAL_STEPS = 6  # the trial's steps; its figure is the median of the second half
TRIAL_MAX_RANKS_PER_CORE = 4  # beyond this the trial would take too long to be part of a plan
# No trial where even this much CPU a compute action would change no
# layout's step: 2.5x the most measured here (0.5 ms on one host, 0.8 on
# namespace hosts, for 4 GPT ranks on 2 cores).
TAU_BOUND = 2e-3


def stages(c, prof) -> tuple[list[range], list[float]]:
    """The candidate's stages as ranges of layers (cut by parameters, as the
    trainer cuts them), and each layer's share of its time on a core at the
    candidate's micro-batch size."""
    cuts = balanced_cuts(prof.params, c.pp * c.virtual_stages)
    span = [range(cuts[s], cuts[s + 1]) for s in range(c.pp * c.virtual_stages)]
    return span, prof.cpu_share.get(c.micro_batch_size) or [1.0] * len(prof.params)


def copies(c) -> int:
    """Ranks that run each pipeline rank's actions: its data-parallel
    replicas, each split over cp x tp ranks (``rank_seconds`` gives each
    1/(tp cp) of the layers' time)."""
    return c.averaged_over * c.tp


def host_of(c, p: int, k: int, per_host: int) -> int:
    """The host of copy ``k`` (``k = d * tp + t``) of pipeline rank ``p``:
    the trainer numbers ranks ``(p * dp + d) * tp + t``, host by host."""
    return (p * copies(c) + k) // per_host


def crowded(world: int, hosts: int, cores: int, gpu: bool) -> bool:
    """Whether a host's CPU ranks outnumber its cores."""
    return not gpu and world // hosts > cores


def compute_actions(schedule) -> dict[int, list]:
    """Each pipeline rank's compute actions (F, B, I, W) in ``schedule``."""
    return {r: [a for a in acts if a.is_compute] for r, acts in schedule.items()}


def rank_seconds(c, prof, span, share, tau: float, schedule) -> dict[int, float]:
    """Each pipeline rank's CPU-seconds a step, unshared: its compute
    actions as profiled (the share of each layer's time on a core; 1/tp of
    it split over tp ranks), tau a compute action, and the trainer's own
    time; each pass as its schedule's order makes it (``pass_order``)."""
    mbs = c.micro_batch_size
    order = pass_order.of(c, prof)
    split = c.work_split

    def cpu(times: list[float]) -> list[float]:
        return [sum(share[i] * times[i] for i in r) / split for r in span]

    back = cpu(prof.backward[mbs])
    table = {"F": cpu(prof.forward[mbs]), "B": back}
    if mbs in prof.input_grad:  # zero-bubble's split backward, as profiled
        table["I"], table["W"] = cpu(prof.input_grad[mbs]), cpu(prof.weight_grad[mbs])
    else:
        table["I"] = table["W"] = [b / 2 for b in back]
    return {
        r: sum(table[str(a.kind)][a.stage] * order.get(str(a.kind), 1.0) for a in acts)
        + tau * len(acts)
        + prof.host_s
        for r, acts in compute_actions(schedule).items()
    }


def floor(c, per_rank: dict[int, float], hosts: int, cores: int) -> float:
    """The step's pipeline phase can take no less than its busiest host's
    CPU-seconds over its cores (``per_rank``: ``rank_seconds``; every replica
    of pipeline rank p spends what p does; ranks numbered host by host)."""
    per_host = copies(c) * c.pp // hosts
    load: dict[int, float] = {}
    for p in range(c.pp):
        for k in range(copies(c)):
            h = host_of(c, p, k, per_host)
            load[h] = load.get(h, 0.0) + per_rank[p]
    return max(load.values()) / cores


def trial_candidate(cands: list):
    """The layout the trial trains: the deepest pipeline's, at the median of
    its layouts' compute actions a rank (the first of equals). The figure
    is per action, and what a step costs beyond its actions (the trainer's
    own time, the progress thread, the caches) is spread over them: measured
    at the middle grain, neither the finest layouts nor the coarsest are
    priced far off."""
    deepest = max(c.pp for c in cands)
    actions = {}  # the deepest pipeline's layouts, in order: their compute actions a rank
    for c in cands:
        if c.pp == deepest:
            schedule = build_schedule(c.schedule, c.pp, c.microbatches, c.virtual_stages)
            actions[c] = max(len(acts) for acts in compute_actions(schedule).values())
    counts = sorted(set(actions.values()))
    middle = counts[len(counts) // 2]
    return next(c for c, n in actions.items() if n == middle)


def trial_unavailable(world: int) -> str | None:
    """Why this machine cannot run the trial for ``world`` ranks, or None."""
    here = os.cpu_count() or 1
    if world <= here:
        return f"{world} ranks have this machine's {here} core(s) to themselves"
    if world > TRIAL_MAX_RANKS_PER_CORE * here:
        return (f"{world} ranks on this machine's {here} core(s) would take too long "
                f"(at most {TRIAL_MAX_RANKS_PER_CORE} a core)")  # fmt: skip
    return None


def measured_tau(cpu_s: float, c, prof) -> float:
    """tau from a trial of ``c`` whose ranks used ``cpu_s`` CPU-seconds a step
    (all ranks together): what the profile does not account for (each
    rank's compute, the trainer's own time, its optimizer step) per compute
    action, never below 0."""
    span, share = stages(c, prof)
    schedule = build_schedule(c.schedule, c.pp, c.microbatches, c.virtual_stages)
    per_rank = rank_seconds(c, prof, span, share, 0.0, schedule)
    params = [sum(prof.params[i] for s, r in enumerate(span) if s % c.pp == p for i in r)
              for p in range(c.pp)]  # fmt: skip
    opt = [prof.opt_s_per_param * n / (copies(c) if c.zero >= 1 else c.tp)
           for n in params]  # fmt: skip
    accounted = copies(c) * sum(per_rank[p] + opt[p] for p in range(c.pp))
    actions = copies(c) * sum(len(a) for a in compute_actions(schedule).values())
    return max(0.0, (cpu_s - accounted) / max(1, actions))


def trial(cfg, cands: list, prof, world: int, steps: int = TRIAL_STEPS, hosts: int = 1,
          link: str | None = None) -> tuple[float, object]:  # fmt: skip
    """(its ranks' CPU-seconds a step, the candidate tried; ``measured_tau``
    makes tau of them): ``trial_candidate(cands)`` trained for
    ``steps`` steps here (``check.measure``, its ``cpu_s``), on
    ``hosts`` namespace hosts of this machine with links at ``link`` where
    hosts > 1 (as ``--check`` trains)."""
    from clawcomm.plan.check import measure, on_hosts

    c = trial_candidate(cands)
    if hosts > 1:
        with on_hosts(hosts, link, world) as launch:
            cpu_s = measure(cfg, c, steps, world, launch=launch, key="cpu_s")
    else:
        cpu_s = measure(cfg, c, steps, world, launch=None, key="cpu_s")
    return cpu_s, c


def settle(cfg, cands: list, prof, world: int, hosts: int, cores: int, gpu: bool, steps: int,
           predict_all, on_hosts: bool = False, link: str | None = None):  # fmt: skip
    """Where a host's CPU ranks outnumber its cores, runs a trial and returns
    (its ranks' CPU-seconds a step, the candidate tried), for
    ``measured_tau`` once the schedules' orders are measured too; sets
    ``prof.trial`` to what ran, or why none did (then returns None): none
    asked (``steps`` 0), none that runs here (``trial_unavailable``), or
    none that could change a prediction (at ``TAU_BOUND`` a compute action,
    ``predict_all()`` gives the same steps as at 0: the layers spend little
    of their time on a core). ``on_hosts``: train it on ``hosts`` namespace
    hosts (links at ``link``) rather than on this one host."""
    if not crowded(world, hosts, cores, gpu):
        return None
    why = trial_unavailable(world) or ("" if steps else "--trial-steps 0")
    if not why:
        before = [p.step_ms for p in predict_all()]
        prof.action_s = TAU_BOUND
        after = [p.step_ms for p in predict_all()]
        prof.action_s = 0.0
        if after == before:
            why = (f"at {1e3 * TAU_BOUND:g} ms a compute action no layout's step would change, "
                   "its layers spending little of their time on a core")  # fmt: skip
    if why:
        prof.trial = "no trial: " + why
        return None
    where, failed = "", ""
    if hosts > 1 and on_hosts:
        try:
            cpu_s, tried = trial(cfg, cands, prof, world, steps, hosts, link)
            where = f" on {hosts} namespace hosts, links {link or 'unshaped'}"
        except (RuntimeError, OSError, ValueError) as e:  # made, but they failed: here instead
            failed = f"on one host: {hosts} namespace hosts failed ({e})"
    if not where:
        cpu_s, tried = trial(cfg, cands, prof, world, steps)
        if hosts > 1:
            where = f" {failed or 'on one host (namespace hosts need root and iproute2)'}"
    prof.trial = f"a trial: {steps} steps of {tried.name()}{where}"
    return cpu_s, tried


def caveat(prof, ranks: int, cores: int) -> str | None:
    """What the report says where a host's CPU ranks outnumber its cores
    (``prof.trial`` is set there: the trial run, or why none ran)."""
    if not prof.trial:
        return None
    if prof.trial.startswith("no trial"):
        what = f"the profiled compute alone ({prof.trial})"
    else:
        what = f"{1e3 * prof.action_s:.2f} ms a compute action beyond its profile ({prof.trial})"
    return (
        f"{ranks} ranks a host share {cores} core(s): each layout's step is at least the "
        f"host's CPU-seconds over its cores, with {what}; which rank's turn comes when "
        "is not modelled, so layouts within about 10% can swap (docs/plan.md)"
    )


def core_shares(span, share, prof, mbs: int):
    """A compute action's share of its time on a core: its stage's layers'
    shares (``stages``), weighted by their forward time for F and their
    backward time for the backward's passes (B, I, W)."""

    def weighted(times: list[float]) -> list[float]:
        return [sum(share[i] * times[i] for i in r) / max(1e-12, sum(times[i] for i in r))
                for r in span]  # fmt: skip

    forward, backward = weighted(prof.forward[mbs]), weighted(prof.backward[mbs])
    return lambda a: (forward if str(a.kind) == "F" else backward)[a.stage]


def shared_makespan(plan, c, alone, on_core, latency, hosts: int, cores: int) -> float:
    """The pipeline's makespan where a host's ranks take turns on its cores:
    ``plan`` (a ``ScheduleClock``) run in global time, each compute action
    taking ``alone(a)`` seconds on a core of its own (as profiled; what a
    trial measures beyond that, tau, is ``floor``'s) and progressing, while
    the host's busy ranks outnumber its cores, at the host's cores over them
    (processor sharing; only the share of an action's time on a core,
    ``on_core(a)``, slows). Every replica of pipeline rank p runs p's
    actions at once (ranks numbered host by host, as ``floor`` counts them),
    so a rank runs at its slowest host's rate. A rank alone in a bubble has
    a core to itself, and a pipeline whose ranks share a host fills one
    rank's bubble with another's turn, which a makespan with every action
    slowed alike does not see; replicas of one rank on one host idle
    together, and keep their bubble. ``latency(p, q)``: a transfer's
    seconds."""
    from collections import Counter

    sched, ranks = plan.schedule, plan.ranks
    per_host = copies(c) * c.pp // hosts
    where = {p: Counter(host_of(c, p, k, per_host) for k in range(copies(c))) for p in ranks}
    done: dict = {}
    pos = dict.fromkeys(ranks, 0)
    left: dict[int, float] = {}  # computing: seconds alone left of its action
    until: dict[int, float] = {}  # waiting for a transfer to land, until then
    now = 0.0

    def start(r: int) -> None:  # at ``now``, action pos[r], its inputs there
        a = sched[r][pos[r]]
        if a.is_compute:
            left[r] = alone(a)
        else:  # posted: costs the rank nothing
            done[a] = now
            pos[r] += 1

    while True:
        moved = True
        while moved:  # instant actions, and whatever they unblock
            moved = False
            for r in ranks:
                if r in left or r in until or pos[r] >= len(sched[r]):
                    continue
                t, _ = plan.ready(r, pos[r], done, latency)
                if t is None:
                    continue
                if t > now:
                    until[r] = t
                else:
                    start(r)
                    moved = True
        if not left and not until:
            break
        share = {r: on_core(sched[r][pos[r]]) for r in left}
        demand: Counter = Counter()  # each host's busy ranks, by their share on a core
        for r in left:
            for h, n in where[r].items():
                demand[h] += n * share[r]
        rates = {}
        for r in left:  # its slowest host's
            k = max(max(1.0, demand[h] / cores) for h in where[r])
            rates[r] = 1.0 / (1.0 + share[r] * (k - 1.0))
        dt = min([left[r] / rates[r] for r in left] + [t - now for t in until.values()])
        now += dt
        for r in list(left):
            left[r] -= rates[r] * dt
            if left[r] <= 1e-12:
                del left[r]
                done[sched[r][pos[r]]] = now
                pos[r] += 1
        for r in [r for r, t in until.items() if t <= now]:
            del until[r]
            start(r)
    if any(pos[r] < len(sched[r]) for r in ranks):
        raise ValueError(f"{c.name()}: its schedule cannot finish")  # validate() says why
    return now
