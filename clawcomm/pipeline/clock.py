"""A pipeline schedule played on a clock: when each action would start and
end, the step's makespan and its bubble, for given action costs.

Each rank executes its actions in order; a compute action starts when the
rank is free and its inputs are there (``dependencies.needs``); a send
costs the sender nothing (the executor posts it and goes on) and its tensor
arrives ``latency`` later; a receive is only posted, so it never blocks
(the compute action that needs it waits). Given per-action costs
(``{"F": 1.0, "B": 2.0}``, or a function of the action, e.g. measured per
stage) ``timing`` returns each action's start and end, the step's makespan
and the bubble: the share of rank-time spent idle, ``1 - sum(busy) / (pp *
makespan)``. A measured per-action host overhead can be charged too (time a
rank spends around each action that is neither compute nor waiting).

The trainer predicts every step's bubble with it and the planner every
candidate's pipeline; ``ScheduleClock`` works a schedule's dependencies
out once for both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from clawcomm.pipeline.actions import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, Schedule, W
from clawcomm.pipeline.dependencies import ScheduleError, needs

__all__ = ["ScheduleClock", "Timing", "timing"]


@dataclass
class Timing:
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


def timing(
    schedule: Schedule,
    costs: dict[str, float] | Callable[[Action], float] | None = None,
    latency: float = 0.0,
    num_stages: int | None = None,
    rank_of: Callable[[int], int] | None = None,
    overhead: float | Callable[[int], float] = 0.0,
) -> Timing:
    """Plays ``schedule`` on a clock (see the module docstring). ``costs``: per
    kind, or a function of the action; missing kinds cost 0 (B defaults to
    I + W when only those are given). ``overhead`` (seconds, or a function of
    the rank): host time a rank spends before each compute action (posting
    transfers, bookkeeping); it delays the rank but is not busy time.
    Raises ``ScheduleError`` on deadlock."""
    return ScheduleClock(schedule, num_stages, rank_of).run(costs, latency, overhead)


class ScheduleClock:
    """A schedule's dependencies, worked out once, for playing it many
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
                    for group in needs(a, num_stages, rank_of, on_rank=False)
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

    def run(self, costs=None, latency=0.0, overhead=0.0) -> Timing:
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
        return Timing(start, end, makespan, busy, schedule)


def _cost_function(costs):
    if costs is None:
        return unit_costs
    if callable(costs):
        return costs
    table = dict(costs)
    if B not in table and (I in table or W in table):
        table[B] = table.get(I, 0.0) + table.get(W, 0.0)
    return lambda a: float(table.get(a.kind, 0.0))
