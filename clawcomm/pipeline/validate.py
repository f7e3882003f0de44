"""Checking a schedule before it runs, and predicting its bubble.

``validate`` proves an action list can run: every action names a stage that
lives on its rank and a micro-batch that exists; every stage runs each
micro-batch's forward once and its backward once (B, or I then W); every
tensor a compute action needs is produced on the rank (earlier) or received
(a RECV posted earlier); every send has its receive on the peer and the
other way round; and the whole thing makes progress (no deadlock). A broken
list raises ``ScheduleError`` naming the rank, the action and what it is
missing.

``simulate`` runs the list on a clock: each rank executes its actions in
order; a compute action starts when the rank is free and its inputs are
there; a send costs the sender nothing (the executor posts it and goes on)
and its tensor arrives ``latency`` later; a receive is only posted, so it
never blocks (the compute action that needs it waits). Given per-action
costs (``{"F": 1.0, "B": 2.0}``, or a function of the action, e.g. measured
per stage) it returns each action's start and end, the step's makespan and
the bubble: the share of rank-time spent idle, ``1 - sum(busy) / (pp *
makespan)``. A measured per-action host overhead can be charged too (time a
rank spends around each action that is neither compute nor waiting).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from clawcomm.pipeline.actions import (
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    I,
    Schedule,
    W,
)
from clawcomm.pipeline.schedules import stage_to_rank as looped


class ScheduleError(ValueError):
    """A schedule that cannot run: ``rank``, ``step`` (index in the rank's
    list) and ``action`` say where; the message says what is missing."""

    def __init__(self, rank: int | None, step: int | None, action: Action | None, why: str):
        self.rank, self.step, self.action = rank, step, action
        where = "" if rank is None else f"rank {rank}"
        if action is not None:
            where += f", action {step} ({action})"
        super().__init__(f"pipeline schedule: {where + ': ' if where else ''}{why}")


def _inputs(a: Action, num_stages: int, rank_of: Callable[[int], int], on_rank: bool):
    """What ``a`` consumes, as groups of alternatives (any one action of a
    group provides that input). A tensor from a stage on another rank is,
    seen from this rank (``on_rank``), the RECV posted here; seen on the
    clock, the peer's SEND."""
    s, mb = a.stage, a.microbatch
    here = rank_of(s)

    def producer(stage: int, kinds: tuple[str, ...], recv: str, send: str) -> list[Action]:
        if rank_of(stage) == here:
            return [Action(stage, k, mb) for k in kinds]
        return [Action(s, recv, mb)] if on_rank else [Action(stage, send, mb)]

    if a.kind == F:
        return [] if s == 0 else [producer(s - 1, (F,), RECV_F, SEND_F)]
    if a.kind in (B, I):
        groups = [[Action(s, F, mb)]]
        if s < num_stages - 1:
            groups.append(producer(s + 1, (B, I), RECV_B, SEND_B))
        return groups
    if a.kind == W:
        return [[Action(s, I, mb)]]
    if a.kind == SEND_F:
        return [[Action(s, F, mb)]]
    if a.kind == SEND_B:
        return [[Action(s, B, mb), Action(s, I, mb)]]
    return []


def _describe(a: Action) -> str:
    s, mb = a.stage, a.microbatch
    return {
        F: f"the forward of micro-batch {mb} on stage {s}",
        B: f"the backward of micro-batch {mb} on stage {s}",
        I: f"the input-gradient pass of micro-batch {mb} on stage {s}",
        W: f"the weight-gradient pass of micro-batch {mb} on stage {s}",
        RECV_F: f"the activation of micro-batch {mb} from stage {s - 1} ({a})",
        RECV_B: f"the gradient of micro-batch {mb} from stage {s + 1} ({a})",
    }.get(a.kind, str(a))


def validate(
    schedule: Schedule,
    pp: int,
    num_stages: int,
    microbatches: int,
    stage_to_rank: Callable[[int, int], int] = looped,
) -> None:
    """Raises ``ScheduleError`` unless ``schedule`` can run to completion."""
    if sorted(schedule) != list(range(pp)):
        raise ScheduleError(None, None, None, f"has ranks {sorted(schedule)}, expected 0..{pp - 1}")
    seen: dict[Action, int] = {}  # action -> rank that runs it

    def rank_of(stage: int) -> int:
        return stage_to_rank(stage, pp)

    for rank in range(pp):
        done: set[Action] = set()
        for step, a in enumerate(schedule[rank]):
            _check_action(a, rank, step, pp, num_stages, microbatches, stage_to_rank)
            if a in done:
                raise ScheduleError(rank, step, a, "runs twice")
            for group in _inputs(a, num_stages, rank_of, on_rank=True):
                if not any(n in done for n in group):
                    need = group[0]
                    how = (
                        "has not posted before it"
                        if need.kind in (RECV_F, RECV_B)
                        else "has not run before it"
                    )
                    named = (
                        ""
                        if need.kind in (RECV_F, RECV_B)
                        else f" ({' or '.join(map(str, group))})"
                    )
                    raise ScheduleError(
                        rank, step, a, f"needs {_describe(need)}{named}, which rank {rank} {how}"
                    )
            if a.kind == REDUCE_GRAD:
                left = [
                    x
                    for x in schedule[rank][step + 1 :]
                    if x.stage == a.stage and x.kind in (B, I, W)
                ]
                if left:
                    raise ScheduleError(
                        rank, step, a, f"reduces stage {a.stage}'s gradients before {left[0]}"
                    )
            done.add(a)
            seen[a] = rank
    _check_complete(schedule, seen, num_stages, microbatches)
    _check_matched(schedule, seen, pp, stage_to_rank)
    simulate(schedule, num_stages=num_stages, rank_of=rank_of)  # raises on deadlock


def _check_action(a, rank, step, pp, num_stages, microbatches, stage_to_rank) -> None:
    if not isinstance(a, Action):
        raise ScheduleError(rank, step, None, f"{a!r} is not an Action")
    if not 0 <= a.stage < num_stages:
        raise ScheduleError(rank, step, a, f"stage {a.stage} does not exist (0..{num_stages - 1})")
    if stage_to_rank(a.stage, pp) != rank:
        raise ScheduleError(
            rank, step, a, f"stage {a.stage} lives on rank {stage_to_rank(a.stage, pp)}"
        )
    if a.kind != REDUCE_GRAD and not 0 <= a.microbatch < microbatches:
        raise ScheduleError(
            rank, step, a, f"micro-batch {a.microbatch} does not exist (0..{microbatches - 1})"
        )
    if (a.kind in (SEND_F, RECV_B) and a.stage == num_stages - 1) or (
        a.kind in (RECV_F, SEND_B) and a.stage == 0
    ):
        raise ScheduleError(rank, step, a, f"stage {a.stage} has no peer for {a.kind}")


def _check_complete(schedule, seen, num_stages, microbatches) -> None:
    for s in range(num_stages):
        for mb in range(microbatches):
            f, b, i, w = (Action(s, k, mb) in seen for k in (F, B, I, W))
            missing = None
            if not f:
                missing = Action(s, F, mb)
            elif b and (i or w):
                missing = "both B and I/W"
            elif not b and not i:
                missing = Action(s, B, mb)
            elif i and not w:
                missing = Action(s, W, mb)
            elif w and not i:
                missing = Action(s, I, mb)
            if missing is not None:
                raise ScheduleError(
                    None, None, None,
                    f"stage {s}, micro-batch {mb}: "
                    + (missing if isinstance(missing, str) else f"{missing} never runs"),
                )  # fmt: skip


def _check_matched(schedule, seen, pp, stage_to_rank) -> None:
    pairs = {SEND_F: (RECV_F, +1), SEND_B: (RECV_B, -1), RECV_F: (SEND_F, -1), RECV_B: (SEND_B, +1)}
    for rank in range(pp):
        for step, a in enumerate(schedule[rank]):
            if a.kind not in pairs:
                continue
            kind, delta = pairs[a.kind]
            peer = Action(a.stage + delta, kind, a.microbatch)
            peer_rank = stage_to_rank(peer.stage, pp)
            if peer_rank == rank:
                raise ScheduleError(
                    rank,
                    step,
                    a,
                    f"stages {a.stage} and {peer.stage} share rank {rank}: no message",
                )
            if seen.get(peer) != peer_rank:
                verb = "sends" if a.kind.startswith("SEND") else "waits for"
                raise ScheduleError(
                    rank, step, a,
                    f"{verb} micro-batch {a.microbatch}, but rank {peer_rank} never runs the "
                    f"matching {peer}",
                )  # fmt: skip


# ---- simulation -----------------------------------------------------------------


@dataclass
class Simulation:
    """``start``/``end``: per rank, per action (same order as the schedule)."""

    start: dict[int, list[float]]
    end: dict[int, list[float]]
    makespan: float
    busy: dict[int, float]
    schedule: Schedule = field(repr=False)

    @property
    def bubble(self) -> float:
        ranks = len(self.busy)
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (ranks * self.makespan)


def unit_costs(a: Action) -> float:
    return {F: 1.0, B: 2.0, I: 1.0, W: 1.0}.get(a.kind, 0.0)


def simulate(
    schedule: Schedule,
    costs: dict[str, float] | Callable[[Action], float] | None = None,
    latency: float = 0.0,
    num_stages: int | None = None,
    rank_of: Callable[[int], int] | None = None,
    overhead: float | Callable[[int], float] = 0.0,
) -> Simulation:
    """Runs ``schedule`` on a clock (see the module docstring). ``costs``: per
    kind, or a function of the action; missing kinds cost 0 (B defaults to
    I + W when only those are given). ``overhead`` (seconds, or a function of
    the rank): host time a rank spends before each compute action (posting
    transfers, bookkeeping); it delays the rank but is not busy time.
    Raises ``ScheduleError`` on deadlock."""
    return SimulationPlan(schedule, num_stages, rank_of).run(costs, latency, overhead)


class SimulationPlan:
    """A schedule's dependencies, worked out once, for simulating it many
    times with other costs (the trainer predicts every step's bubble)."""

    def __init__(self, schedule: Schedule, num_stages: int | None = None, rank_of=None):
        if num_stages is None:
            num_stages = 1 + max((a.stage for acts in schedule.values() for a in acts), default=0)
        if rank_of is None:  # where each stage runs, read off the schedule
            where = {a.stage: r for r, acts in schedule.items() for a in acts}
            rank_of = where.__getitem__
        self.schedule = schedule
        self.ranks = sorted(schedule)
        # Per rank, per action: its input groups as (action, is a transfer)
        # pairs; a RECV is only posted and waits for nothing.
        self.inputs = {
            r: [
                []
                if a.kind in (RECV_F, RECV_B)
                else [
                    [(n, n.kind in (SEND_F, SEND_B)) for n in group]
                    for group in _inputs(a, num_stages, rank_of, on_rank=False)
                ]
                for a in acts
            ]
            for r, acts in schedule.items()
        }
        self.owner = {a: r for r, acts in schedule.items() for a in acts}

    def ready(self, r: int, i: int, done_at: dict, latency) -> tuple[float | None, list]:
        """When rank ``r``'s action ``i`` has its inputs, given when each
        action done so far ended (``done_at``) and ``latency(src, dst)`` per
        transfer: (the time, []), or (None, the alternatives of an input
        none of which is done yet)."""
        t = 0.0
        for group in self.inputs[r][i]:
            got = [done_at[n] + (latency(self.owner[n], r) if moved else 0.0)
                   for n, moved in group if n in done_at]  # fmt: skip
            if not got:
                return None, group
            t = max(t, min(got))
        return t, []

    def run(self, costs=None, latency=0.0, overhead=0.0) -> Simulation:
        """``latency``: seconds a transfer takes, or ``latency(src, dst)``
        per pair of ranks (a link between hosts costs more than shared memory)."""
        cost = _cost_function(costs)
        host = overhead if callable(overhead) else (lambda r: overhead)
        schedule, ranks = self.schedule, self.ranks
        transfer = latency if callable(latency) else (lambda src, dst: latency)
        done_at: dict[Action, float] = {}  # when each action's result exists
        pos = dict.fromkeys(ranks, 0)
        clock = dict.fromkeys(ranks, 0.0)
        start = {r: [0.0] * len(schedule[r]) for r in ranks}
        end = {r: [0.0] * len(schedule[r]) for r in ranks}
        busy = dict.fromkeys(ranks, 0.0)
        overhead_of = {r: host(r) for r in ranks}
        waiters: dict[Action, list[int]] = {}  # action not done yet -> ranks blocked on it
        work = list(ranks)
        while work:
            r = work.pop()
            acts = schedule[r]
            while pos[r] < len(acts):
                i = pos[r]
                a = acts[i]
                ready, missing = self.ready(r, i, done_at, transfer)
                if ready is None:
                    for n, _ in missing:  # wake r when any of them is done
                        waiters.setdefault(n, []).append(r)
                    break
                compute = a.is_compute
                t0 = max(clock[r] + (overhead_of[r] if compute else 0.0), ready)
                t1 = t0 + (cost(a) if compute else 0.0)
                start[r][i], end[r][i] = t0, t1
                clock[r] = t1
                if compute:
                    busy[r] += t1 - t0
                done_at[a] = t1
                pos[r] = i + 1
                for w in waiters.pop(a, ()):
                    if w != r and w not in work:
                        work.append(w)
        if any(pos[r] < len(schedule[r]) for r in ranks):
            stuck = []
            for r in ranks:
                if pos[r] < len(schedule[r]):
                    a = schedule[r][pos[r]]
                    missing = next(
                        (g for g in self.inputs[r][pos[r]] if not any(n in done_at for n, _ in g)),
                        [],
                    )
                    what = " or ".join(str(n) for n, _ in missing) or "?"
                    stuck.append(f"rank {r} at action {pos[r]} ({a}) waits for {what}")
            raise ScheduleError(None, None, None, "deadlock: " + "; ".join(stuck))
        makespan = max((max(end[r], default=0.0) for r in ranks), default=0.0)
        return Simulation(start, end, makespan, busy, schedule)


def _cost_function(costs):
    if costs is None:
        return unit_costs
    if callable(costs):
        return costs
    table = dict(costs)
    if B not in table and (I in table or W in table):
        table[B] = table.get(I, 0.0) + table.get(W, 0.0)
    return lambda a: float(table.get(a.kind, 0.0))
