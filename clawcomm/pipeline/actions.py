"""Pipeline actions in torch.distributed.pipelining's notation.

An action is ``{stage}{kind}{micro-batch}``: ``1F0`` is stage 1's forward of
micro-batch 0, ``0SEND_F3`` stage 0 sending micro-batch 3's activation on,
``2REDUCE_GRAD`` stage 2's data-parallel gradient reduction. The kinds:

====== ===================================================================
F      forward
B      full backward (input and weight gradients)
I      backward for the input gradient only (zero-bubble schedules)
W      backward for the weight gradients only (after that micro-batch's I)
SEND_F send the stage's output activation to the next stage
RECV_F receive this stage's input activation from the previous stage
SEND_B send the gradient of the stage's input to the previous stage
RECV_B receive the gradient of this stage's output from the next stage
REDUCE_GRAD  start averaging the stage's gradients over its data-parallel
       group (no micro-batch; the executor also starts it on its own once
       the stage's last weight gradient is done)
====== ===================================================================

A schedule maps each pipeline rank to its list of actions, run in order. The
same strings load into torch's ``_Action.from_str``, so torch's own
validator and simulator can check our schedules (``to_torch``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

F, B, I, W = "F", "B", "I", "W"  # noqa: E741  (torch's letters)
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
REDUCE_GRAD = "REDUCE_GRAD"

COMPUTE = (F, B, I, W)
COMMS = (SEND_F, RECV_F, SEND_B, RECV_B)
KINDS = COMPUTE + COMMS + (REDUCE_GRAD,)

_PATTERN = re.compile(r"^(\d+)(REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d*)$")


class Action(NamedTuple):
    stage: int
    kind: str
    microbatch: int | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind}{mb}"

    def __repr__(self) -> str:
        return str(self)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @property
    def is_backward(self) -> bool:
        return self.kind in (B, I)

    @staticmethod
    def parse(text: str) -> Action:
        """``"1F0"`` -> ``Action(1, "F", 0)``; the inverse of ``str``."""
        m = _PATTERN.match(text.strip())
        if m is None:
            raise ValueError(
                f"pipeline action {text!r} is not [stage][kind][micro-batch], "
                f"kind one of {', '.join(KINDS)} (e.g. 1F0, 0SEND_F3, 2REDUCE_GRAD)"
            )
        stage, kind, mb = m.groups()
        if kind == REDUCE_GRAD and mb:
            raise ValueError(f"pipeline action {text!r}: REDUCE_GRAD takes no micro-batch")
        if kind != REDUCE_GRAD and not mb:
            raise ValueError(f"pipeline action {text!r}: {kind} needs a micro-batch index")
        return Action(int(stage), kind, int(mb) if mb else None)


Schedule = dict[int, list[Action]]


def parse_schedule(rows: dict[int, list[str]] | str) -> Schedule:
    """A schedule from strings: ``{rank: ["0F0", ...]}``, or CSV text with
    one row per rank (torch's ``_load_csv`` layout)."""
    if isinstance(rows, str):
        lines = [ln for ln in rows.strip().splitlines() if ln.strip()]
        rows = {r: [a for a in ln.split(",") if a.strip()] for r, ln in enumerate(lines)}
    return {int(r): [Action.parse(a) for a in acts] for r, acts in rows.items()}


def format_schedule(schedule: Schedule) -> str:
    """CSV text, one row per rank (loads back with ``parse_schedule``)."""
    return "\n".join(",".join(map(str, schedule[r])) for r in sorted(schedule)) + "\n"


def format_table(schedule: Schedule, width: int = 8) -> str:
    """The schedule as columns, one per rank, for error messages and docs."""
    ranks = sorted(schedule)
    depth = max((len(schedule[r]) for r in ranks), default=0)
    lines = ["step  " + "".join(f"rank {r}".ljust(width + 2) for r in ranks)]
    for step in range(depth):
        cells = [str(schedule[r][step]) if step < len(schedule[r]) else "" for r in ranks]
        lines.append(f"{step:4d}  " + "".join(c.ljust(width + 2) for c in cells))
    return "\n".join(lines)


def to_torch(schedule: Schedule, comms: bool = True) -> dict:
    """The same schedule as torch.distributed.pipelining ``_Action`` lists
    (REDUCE_GRAD dropped, since torch's simulator does not model it; with
    ``comms=False`` only the compute actions, as its validator wants)."""
    from torch.distributed.pipelining.schedules import _Action

    keep = COMPUTE + (COMMS if comms else ())
    return {
        r: [_Action.from_str(str(a)) for a in acts if a.kind in keep]
        for r, acts in schedule.items()
    }
