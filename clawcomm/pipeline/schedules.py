"""Pipeline schedules as per-rank action lists.

Each schedule is a small function that returns, for every pipeline rank, the
compute actions it runs, in order (F, B, or I and W); ``add_communication``
then inserts the sends and receives. Stage ``s`` lives on rank ``s % pp``
(one stage per rank, or ``v`` "looped" stages per rank for the interleaved
schedule). With ``m`` micro-batches and equal costs ``f`` (forward) and
``b`` (backward) per stage, the idle share of the step (the bubble) is:

=============  =========================================  ====================
schedule       order on rank r                            bubble
=============  =========================================  ====================
gpipe          all m forwards, then all m backwards        (p-1)/(m+p-1)
1f1b           p-1-r forwards, then one forward and one    (p-1)/(m+p-1), with
               backward in turn, then the backwards left   at most p micro-
                                                           batches in flight
interleaved    1f1b over v stages per rank, p micro-       (p-1)/(v*m+p-1)
               batches at a time per stage (Megatron)
zb1            1f1b with the backward split into I (input  (p-1)(f+i-w) over
               gradient) and W (weight gradient); rank r   the step: about a
               holds back r W passes and runs them in the  third of 1f1b's when
               cool-down (ZB-H1)                           f = i = w
=============  =========================================  ====================

``clawcomm.pipeline.validate`` checks a schedule and ``clock`` plays it with
per-action costs, which is how these bubbles are predicted.
"""

from __future__ import annotations

from clawcomm.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    I,
    Schedule,
    W,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1")


def stage_to_rank(stage: int, pp: int) -> int:
    return stage % pp


def check_schedule_args(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Raises ValueError naming the setting a schedule cannot run with."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    for what, value in (("pp", pp), ("microbatches", microbatches), ("v", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"schedule {name}: {what} must be an int >= 1, got {value!r}")
    if name != "interleaved" and virtual_stages != 1:
        raise ValueError(
            f"schedule {name} runs one stage per rank; virtual stages v={virtual_stages} "
            "need --schedule interleaved"
        )
    if name in ("1f1b", "zb1", "interleaved") and microbatches < pp:
        raise ValueError(
            f"schedule {name} needs at least pp={pp} micro-batches (one in flight per "
            f"stage), got microbatches={microbatches}"
        )
    if name == "interleaved" and microbatches % pp:
        raise ValueError(
            f"schedule interleaved sends micro-batches through the stages in groups of "
            f"pp={pp}; microbatches={microbatches} is not a multiple of {pp}"
        )


def build(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The complete schedule (compute and communication) for every rank."""
    check_schedule_args(name, pp, microbatches, virtual_stages)
    compute = {
        "gpipe": gpipe,
        "1f1b": one_f_one_b,
        "interleaved": interleaved,
        "zb1": zero_bubble_h1,
    }[name](pp, microbatches, virtual_stages)
    return add_communication(compute, pp, pp * virtual_stages)


def held_for_backward(actions: list[Action], saved) -> float:
    """The most that one rank's ``actions`` hold for backward at once: a
    micro-batch's forward on stage s holds ``saved(s)`` (bytes, say) until
    its backward (B, or I: the input-gradient pass frees the graph; W keeps
    only what the weight gradients read). At pp 1 that is one micro-batch,
    under 1F1B a rank's pipeline depth at most, under GPipe all of them."""
    held = peak = 0.0
    for a in actions:
        if a.kind == F:
            held += saved(a.stage)
            peak = max(peak, held)
        elif a.kind in (B, I):
            held -= saved(a.stage)
    return peak


# ---- compute orders -----------------------------------------------------------


def gpipe(pp: int, m: int, v: int = 1) -> Schedule:
    """All forwards, then all backwards (in the same micro-batch order)."""
    return {
        r: [Action(r, F, i) for i in range(m)] + [Action(r, B, i) for i in range(m)]
        for r in range(pp)
    }


def one_f_one_b(pp: int, m: int, v: int = 1) -> Schedule:
    """PipeDream-flush: rank r runs p-1-r forwards to fill the pipeline, then
    alternates one forward and one backward, then drains the backwards."""
    out: Schedule = {}
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        acts = [Action(r, F, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action(r, F, warmup + i), Action(r, B, i)]
        acts += [Action(r, B, i) for i in range(m - warmup, m)]
        out[r] = acts
    return out


def interleaved(pp: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B. Rank r holds stages r, r+p, ..., r+(v-1)p.
    Forwards go through the rank's stages p micro-batches at a time (micro-
    batches 0..p-1 through its first stage, then through its second, ...);
    backwards go the same way from its last stage. Warm-up is
    (p-1-r)*2 + (v-1)*p forwards (all of them when m == p)."""
    total = m * v
    out: Schedule = {}

    def action(r: int, k: int, kind: str) -> Action:
        """The k-th forward (or backward) on rank r."""
        chunk = (k // pp) % v
        if kind == B:
            chunk = v - 1 - chunk
        mb = (k // (pp * v)) * pp + k % pp
        return Action(chunk * pp + r, kind, mb)

    for r in range(pp):
        warmup = total if m == pp else min((pp - 1 - r) * 2 + (v - 1) * pp, total)
        acts = [action(r, k, F) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [action(r, warmup + k, F), action(r, k, B)]
        acts += [action(r, k, B) for k in range(total - warmup, total)]
        out[r] = acts
    return out


def zero_bubble_h1(pp: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 (Qi et al., 2024): 1F1B with each backward split into I, which
    the previous stage waits for, and W, which nobody waits for. Rank r
    holds back its first r W passes (the last rank holds back the most, which
    shortens the chain of I passes the earlier ranks wait on), then runs one
    W after each I, and the held-back ones at the end, where they fill the
    cool-down. Memory in flight stays that of 1F1B."""
    out: Schedule = {}
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        acts = [Action(r, F, i) for i in range(warmup)]
        next_w = 0
        for i in range(m):
            if warmup + i < m:
                acts.append(Action(r, F, warmup + i))
            acts.append(Action(r, I, i))
            if i >= r:
                acts.append(Action(r, W, next_w))
                next_w += 1
        acts += [Action(r, W, j) for j in range(next_w, m)]
        out[r] = acts
    return out


# ---- communication ------------------------------------------------------------


def add_communication(compute: Schedule, pp: int, num_stages: int) -> Schedule:
    """Inserts the point-to-point actions a compute-only schedule needs: a
    send right after the action that produced its tensor, a receive right
    before the action that consumes it. This is the order torch's simulator
    expects (it treats a receive as blocking). Our executor posts each
    receive earlier anyway, one compute action ahead, so the bytes land
    straight in the buffer while the rank is still busy; posting never
    blocks, so that cannot deadlock. Stages on the same rank (pp == 1) hand
    tensors over without messages."""
    out: Schedule = {}
    for r, acts in compute.items():
        result: list[Action] = []
        for a in acts:
            if (recv := _recv_for(a, pp, num_stages)) is not None:
                result.append(recv)
            result.append(a)
            if (send := _send_for(a, pp, num_stages)) is not None:
                result.append(send)
        out[r] = result
    return out


def _send_for(a: Action, pp: int, num_stages: int) -> Action | None:
    if a.kind == F and a.stage < num_stages - 1:
        peer = a.stage + 1
        kind = SEND_F
    elif a.kind in (B, I) and a.stage > 0:
        peer = a.stage - 1
        kind = SEND_B
    else:
        return None
    if stage_to_rank(peer, pp) == stage_to_rank(a.stage, pp):
        return None
    return Action(a.stage, kind, a.microbatch)


def _recv_for(a: Action, pp: int, num_stages: int) -> Action | None:
    if a.kind == W:
        return None
    if a.kind == F and a.stage > 0:
        peer, kind = a.stage - 1, RECV_F
    elif a.kind in (B, I) and a.stage < num_stages - 1:
        peer, kind = a.stage + 1, RECV_B
    else:
        return None
    if stage_to_rank(peer, pp) == stage_to_rank(a.stage, pp):
        return None
    return Action(a.stage, kind, a.microbatch)
