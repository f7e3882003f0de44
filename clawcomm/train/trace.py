"""The trainer's step, seen from every rank: a Chrome/Perfetto trace and a
timeline picture.

Each rank records, per step, on the host's monotonic clock (the executor's
``time.perf_counter``, which is CLOCK_MONOTONIC and so one clock for every
process of a host):

* compute: each forward (F), backward (B), input-gradient (I) and
  weight-gradient (W) pass, with its stage and micro-batch, and the
  optimizer step;
* communication: every wait for a received activation or gradient, the
  final wait for sends, and the exposed part of the data-parallel
  reduction (what the step waited for after the pipeline drained);
* the step itself, and the wait for its batch before it (a "data" track);
* engine ops: the data-parallel group's collectives (the bucket reductions,
  which overlap compute) and the pipeline group's sends and receives, from
  the engine's flight recorder, whose clock (steady_clock) is the same;
* tensor parallel: the TP group's collectives and ring sends, which run
  inside the compute actions (their own track);
* expert parallel: the experts' all-to-alls (``--ep``), inside the compute
  actions too (their own track);
* context parallel: the ring's sends and receives of keys and values
  (``--cp``), inside the compute actions (their own track).

``write_chrome_trace`` merges every rank's events into one JSON file that
chrome://tracing and ui.perfetto.dev open: a process per rank, a track for
compute and one for communication. ``draw_timeline`` draws one step: ranks
against time, compute and waits coloured, bubbles left blank.
"""

from __future__ import annotations

import json

import torch.distributed as dist

# (track, name, start s, end s, args)
Event = tuple[int, str, float, float, dict]
COMPUTE, COMM, STEP, ENGINE, DATA, TP, EP, CP = 0, 1, 2, 3, 4, 5, 6, 7
TRACKS = {
    COMPUTE: "compute",
    COMM: "communication",
    STEP: "steps",
    ENGINE: "engine ops",
    DATA: "data",  # the wait for the step's batch, before the step
    TP: "tensor parallel",
    EP: "expert parallel",
    CP: "context parallel",
}
INSIDE = {"tp": TP, "ep": EP, "cp": CP}  # groups whose every op runs inside compute actions
COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868", "opt": "#8172B3"}
INSIDE_COLORS = {TP: "#DA8BC3", EP: "#CCB974", CP: "#64B5CD"}


class StepRecorder:
    """The events of this rank's steps (bounded to the last ``keep``)."""

    def __init__(self, keep: int = 1000):
        self.keep = keep
        self.steps: list[list[Event]] = []

    def add_step(self, events: list[Event]) -> None:
        self.steps.append(events)
        del self.steps[: -self.keep]

    def gather(self, rank: int, label: str) -> list | None:
        """Every rank's (rank, label, steps) on rank 0 (collective)."""
        mine = (rank, label, self.steps)
        if not dist.is_initialized():
            return [mine]
        out = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, out, dst=0)
        return out


def run_events(stats, accumulation_round: int | None = None) -> list[Event]:
    """A pipeline run's compute actions and waits (the executor's RunStats);
    ``accumulation_round`` is noted on each action when there are several."""
    out = []
    for act, s0, s1 in stats.timeline:
        args = {"kind": act.kind, "stage": act.stage, "mb": act.microbatch}
        if accumulation_round is not None:
            args["round"] = accumulation_round
        out.append((COMPUTE, f"{act.kind}{act.microbatch} s{act.stage}", s0, s1, args))
    out += [(COMM, what, s0, s1, {}) for what, s0, s1 in stats.waits]
    for act, nbytes, t in stats.messages:  # instants: what a Chakra trace needs
        args = {"kind": act.kind, "stage": act.stage, "mb": act.microbatch, "bytes": nbytes}
        if accumulation_round is not None:
            args["round"] = accumulation_round
        out.append((COMM, str(act), t, t, args))
    return out


def engine_events(named_engines: dict, t0: float, t1: float) -> list[Event]:
    """The dp group's collectives, the pp group's sends and receives and
    every op of the tp and ep groups that ran in [t0, t1], from the
    engines' flight records."""
    out = []
    for label, eng in named_engines.items():
        for op in json.loads(eng.flight_record())["ops"]:
            s0, s1 = op["start_us"] / 1e6, op["end_us"] / 1e6
            p2p = op["op"] in ("send", "recv")
            if op["state"] != "done" or s1 < t0 or s0 > t1:
                continue
            if label not in INSIDE and label.startswith("dp") == p2p:
                continue
            name = f"{label} {op['op']}" + (f" #{op['seq']}" if "seq" in op else "")
            args = {"group": label, "op": op["op"], "seq": op.get("seq"), "bytes": op["bytes"]}
            out.append((INSIDE.get(label, ENGINE), name, s0, s1, args))
    return out


def write_chrome_trace(path: str, ranks: list) -> None:
    """ranks: [(rank, label, steps)] from StepRecorder.gather."""
    origin = min((e[2] for _, _, steps in ranks for s in steps for e in s), default=0.0)
    events = []
    for rank, label, steps in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": label}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}
        )
        for tid, name in TRACKS.items():
            events.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}
            )
        for step in steps:
            for track, name, t0, t1, args in step:
                events.append(
                    {
                        "name": name,
                        "cat": TRACKS[track],
                        "ph": "X",
                        "ts": (t0 - origin) * 1e6,
                        "dur": max(0.0, (t1 - t0) * 1e6),
                        "pid": rank,
                        "tid": track,
                        "args": args,
                    }
                )
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def draw_timeline(path: str, ranks: list, step: int = -1, title: str = "") -> None:
    """One step (default: the last recorded), ranks against time."""
    from clawcomm._optional import require

    require("matplotlib", "clawcomm train --timeline").use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = sorted(ranks, key=lambda r: r[0])
    chosen = [[e for e in r[2][step] if e[0] != DATA] for r in rows if r[2]]  # the step itself
    origin = min(e[2] for s in chosen for e in s)
    end = max(e[3] for s in chosen for e in s)
    fig, ax = plt.subplots(figsize=(11, 0.7 * len(rows) + 1.4))
    for y, (_rank, _label, steps) in enumerate(rows):
        if not steps:
            continue
        for track, _name, t0, t1, args in steps[step]:
            x, w = (t0 - origin) * 1e3, (t1 - t0) * 1e3
            if track == COMPUTE:
                kind = args.get("kind", "opt")
                ax.broken_barh([(x, w)], (y - 0.35, 0.7), color=COLORS.get(kind, "#999999"))
                if kind in "FBIW" and w > (end - origin) * 1e3 / 80:
                    ax.text(x + w / 2, y, f"{args.get('mb', '')}", ha="center", va="center",
                            fontsize=7, color="white")  # fmt: skip
            elif track == COMM:
                ax.broken_barh([(x, w)], (y - 0.35, 0.18), color="#333333")
            elif track == ENGINE and args.get("group") == "dp":
                ax.broken_barh([(x, w)], (y + 0.22, 0.13), color="#937860")
            elif track in INSIDE_COLORS:
                ax.broken_barh([(x, w)], (y + 0.22, 0.13), color=INSIDE_COLORS[track])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for _, label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began (blank: bubble)")
    ax.set_xlim(0, (end - origin) * 1e3)
    handles = [Patch(color=c, label=k if k != "opt" else "optimizer") for k, c in COLORS.items()]
    handles.append(Patch(color="#333333", label="waiting on communication"))
    handles.append(Patch(color="#937860", label="dp reduction in flight"))
    for track, what in ((TP, "tp collective"), (EP, "ep all-to-all"), (CP, "cp ring transfer")):
        if any(e[0] == track for s in chosen for e in s):
            handles.append(Patch(color=INSIDE_COLORS[track], label=what))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=6, fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def record_step(trainer, events, t0, t_pipe, dp_wait, t_opt, t_end, data_wait=None) -> None:
    """Adds one step's events (those of its pipeline runs, ``events``) to
    ``trainer.recorder``, with the wait for its batch (start, end) if any."""
    if data_wait is not None and data_wait[1] > data_wait[0]:
        events.append((DATA, "data wait", data_wait[0], data_wait[1], {}))
    events.append((COMM, "dp reduction (exposed)", t_pipe, t_pipe + dp_wait, {}))
    events.append((COMPUTE, "optimizer", t_opt, t_end, {"kind": "opt"}))
    events.append((STEP, f"step {trainer.step_index + 1}", t0, t_end, {}))
    events += engine_events(trainer.traffic.engines()[1], t0, t_end)
    trainer.recorder.add_step(events)


def write_recorded(trainer, trace_path: str | None, timeline_path: str | None) -> None:
    """Gathers every rank's recorded steps (``trainer.recorder``) on rank 0
    and writes the Chrome trace and/or the timeline picture (collective)."""
    g, cfg = trainer.grid, trainer.cfg
    tp = f", tp {g.tp_rank}" if cfg.tp > 1 else ""
    ep = f", ep {g.dp_rank % cfg.ep}" if cfg.ep > 1 else ""
    cp = f", cp {g.cp_rank}" if cfg.cp > 1 else ""
    label = f"rank {g.rank} (dp {g.dp_rank}{ep}{cp}{tp}, pp {g.pp_rank})"
    ranks = trainer.recorder.gather(g.rank, label)
    if g.rank != 0:
        return
    if trace_path:
        write_chrome_trace(trace_path, ranks)
    if timeline_path:
        title = (
            f"step {trainer.step_index}: dp {cfg.dp} x "
            + (f"tp {cfg.tp} x " if cfg.tp > 1 else "")
            + f"pp {cfg.pp}"
            + (f" (ep {cfg.ep})" if cfg.ep > 1 else "")
            + f", {cfg.schedule}, "
            f"{cfg.microbatches} micro-batches"
        )
        draw_timeline(timeline_path, ranks, -1, title)
