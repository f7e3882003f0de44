"""Checking a schedule before it runs.

``validate`` proves an action list can run: every action names a stage that
lives on its rank and a micro-batch that exists; every stage runs each
micro-batch's forward once and its backward once (B, or I then W); every
tensor a compute action needs is produced on the rank (earlier) or received
(a RECV posted earlier); every send has its receive on the peer and the
other way round; and the whole thing makes progress (no deadlock: the
schedule played on ``clock``). A broken list raises ``ScheduleError``
naming the rank, the action and what it is missing.
"""

from __future__ import annotations

from collections.abc import Callable

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
from clawcomm.pipeline.clock import timing
from clawcomm.pipeline.dependencies import ScheduleError, describe, needs
from clawcomm.pipeline.schedules import stage_to_rank as looped

__all__ = ["ScheduleError", "validate"]


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
            for group in needs(a, num_stages, rank_of, on_rank=True):
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
                        rank, step, a, f"needs {describe(need)}{named}, which rank {rank} {how}"
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
    timing(schedule, num_stages=num_stages, rank_of=rank_of)  # raises on deadlock


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
