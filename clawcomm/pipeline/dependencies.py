"""What each action of a pipeline schedule needs before it can run, and the
error a schedule that cannot run raises: the one rule the validator
(``validate``) and the clock (``clock``) both read."""

from __future__ import annotations

from collections.abc import Callable

from clawcomm.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    I,
    W,
)


class ScheduleError(ValueError):
    """A schedule that cannot run: ``rank``, ``step`` (index in the rank's
    list) and ``action`` say where; the message says what is missing."""

    def __init__(self, rank: int | None, step: int | None, action: Action | None, why: str):
        self.rank, self.step, self.action = rank, step, action
        where = "" if rank is None else f"rank {rank}"
        if action is not None:
            where += f", action {step} ({action})"
        super().__init__(f"pipeline schedule: {where + ': ' if where else ''}{why}")


def needs(a: Action, num_stages: int, rank_of: Callable[[int], int], on_rank: bool):
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


def describe(a: Action) -> str:
    s, mb = a.stage, a.microbatch
    return {
        F: f"the forward of micro-batch {mb} on stage {s}",
        B: f"the backward of micro-batch {mb} on stage {s}",
        I: f"the input-gradient pass of micro-batch {mb} on stage {s}",
        W: f"the weight-gradient pass of micro-batch {mb} on stage {s}",
        RECV_F: f"the activation of micro-batch {mb} from stage {s - 1} ({a})",
        RECV_B: f"the gradient of micro-batch {mb} from stage {s + 1} ({a})",
    }.get(a.kind, str(a))
