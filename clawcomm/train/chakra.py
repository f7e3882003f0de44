"""``clawcomm train --chakra DIR``: one recorded step of every rank as a
Chakra execution trace (clawcomm/chakra.py), which ``clawcomm simulate
--chakra DIR`` and ASTRA-sim replay.

Each rank's graph follows its own action list (the schedule, in order, once
per accumulation round), with times from the recorded step (trace.py):

* a compute node per F, B, I and W action, lasting what it took plus the
  host time before it that was not a wait for a peer (posting sends and
  receives, bookkeeping), each after the rank's previous compute node
  (``ctrl_deps``: one host thread runs them), and after the receive of its
  input when that comes from another rank (``data_deps``);
* a send node per SEND_F and SEND_B after the compute that produced the
  tensor, and a receive node per RECV_F and RECV_B, with source,
  destination, bytes and a tag that pairs them (the receiving stage, the
  micro-batch, the round and the direction);
* a collective node per data-parallel collective the engine ran in the step
  (its flight record: kind and bytes, as they went on the wire: compressed
  reductions count their compressed bytes), after the compute that was
  running when it started; the process group is ``dp<pp rank>`` (the
  second data-parallel communicator's ``dp<pp rank>.2``; at tp > 1
  ``dp<pp rank>t<tp rank>``);
* a prologue (the step's start to the rank's first action: slicing the
  batch) and the optimizer (from the last data-parallel wait to the step's
  end: clipping, the update, zeroing), after every collective that began
  before it; collectives that begin after it (ZeRO's parameter gathers)
  come after it, and it is shortened by the time they took.

* at tp > 1, each tensor-parallel collective the engine ran inside a
  compute action splits that action: a compute node up to it, a collective
  node (process group ``tp<pp rank>.<dp rank>``, ``c<cp rank>`` after it
  at cp > 1), a compute node after it,
  in a chain, so a replay keeps them on the critical path of every layer.
  The overlapped exchange's sends and receives (``--tp-overlap``) are not
  split out: their time stays in the compute nodes;
* at ep > 1, each of the experts' all-to-alls likewise (process group
  ``ep<pp rank>.<copy>``, the copy being dp rank // ep; ``t<tp rank>``
  after it at tp > 1, where each TP rank has its expert-parallel group).
  Context parallelism's ring sends and receives are not split out (as the
  overlapped TP exchange's): their time stays in the compute nodes.

Every rank's file says its host (``host`` in the global metadata, torchrun's
``GROUP_RANK``), so a replay knows which messages cross a link.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from clawcomm import chakra
from clawcomm.pipeline.actions import RECV_B, RECV_F, SEND_B, SEND_F, B, F, I, W
from clawcomm.pipeline.schedules import stage_to_rank
from clawcomm.train import trace


def _tag(receiving_stage: int, mb: int, rnd: int, backward: bool, cfg) -> int:
    key = (rnd * cfg.num_stages + receiving_stage) * cfg.microbatches + mb
    return 2 * key + int(backward)


def rank_nodes(events: list, actions: list, grid, cfg) -> list[chakra.Node]:
    """This rank's Chakra nodes for one recorded step (``events``: the
    step's events from trace.StepRecorder; ``actions``: its action list)."""
    rounds = cfg.accumulation
    compute, sizes, waits, dp_ops, inside_ops = {}, {}, [], [], []
    step = opt_from = None
    for track, name, t0, t1, args in events:
        rnd = args.get("round", 0)
        if track == trace.COMPUTE and args.get("kind") in (F, B, I, W):
            compute[(rnd, args["kind"], args["stage"], args["mb"])] = (t0, t1)
        elif track == trace.COMM and "bytes" in args:
            sizes[(rnd, args["kind"], args["stage"], args["mb"])] = args["bytes"]
        elif track == trace.COMM and name == "dp reduction (exposed)":
            opt_from = t1
        elif track == trace.COMM:
            waits.append((t0, t1))
        elif track == trace.STEP:
            step = (t0, t1)
        elif track == trace.ENGINE and args.get("group", "").startswith("dp"):
            dp_ops.append((t0, t1, name, args))
        elif track in (trace.TP, trace.EP) and args.get("op") in chakra.COLLECTIVES:
            inside_ops.append((t0, t1, name, args, _inside_group(track, grid, cfg)))
    inside_ops.sort()
    if step is None:
        raise ValueError("chakra: the recorded step has no step event")
    origin = step[0]
    us = lambda t: int(round(t * 1e6))  # noqa: E731
    nodes: list[chakra.Node] = []

    def add(name, kind, **kw) -> chakra.Node:
        n = chakra.Node(id=len(nodes), name=name, type=kind, **kw)
        nodes.append(n)
        return n

    me = grid.rank
    first = min([t0 for t0, _ in compute.values()] + [t0 for t0, _ in waits], default=origin)
    prev = add("prologue", chakra.COMP_NODE, duration_us=us(first - origin))
    prev_end = first
    running = []  # (start, end, node id) of compute nodes, for the collectives
    done = {}  # (round, kind, stage, mb) -> node id
    last = cfg.num_stages - 1
    for rnd in range(rounds):
        sfx = f" r{rnd}" if rounds > 1 else ""
        for a in actions:
            key = (rnd, a.kind, a.stage, a.microbatch)
            if a.is_compute:
                t0, t1 = compute[key]
                waited = sum(
                    min(w1, t0) - max(w0, prev_end) for w0, w1 in waits if w1 > prev_end and w0 < t0
                )
                host = max(0.0, t0 - prev_end - waited)
                deps = []
                elsewhere = lambda s: stage_to_rank(s, cfg.pp) != grid.pp_rank  # noqa: E731
                if a.kind == F and a.stage > 0 and elsewhere(a.stage - 1):
                    deps.append(done[(rnd, RECV_F, a.stage, a.microbatch)])
                if a.kind in (B, I) and a.stage < last and elsewhere(a.stage + 1):
                    deps.append(done[(rnd, RECV_B, a.stage, a.microbatch)])
                inside = [op for op in inside_ops if t0 <= op[0] < t1]
                start, cursor, part = t0 - host, t0, 0
                for s0, s1, name, args, pg in inside:  # compute up to it, then the collective
                    n = add(f"{a}{sfx} .{part}", chakra.COMP_NODE,
                            duration_us=us(max(0.0, s0 - cursor) + (host if part == 0 else 0.0)),
                            start_us=us(cursor - origin), data_deps=deps, ctrl_deps=[prev.id],
                            attrs={"is_cpu_op": True})  # fmt: skip
                    running.append((start, s0, n.id))
                    prev = _collective(add, name, args, grid, [n.id], pg)
                    start = cursor = max(s1, s0)
                    deps, part = [], part + 1
                n = add(
                    f"{a}{sfx}" + (f" .{part}" if part else ""),
                    chakra.COMP_NODE,
                    duration_us=us(max(0.0, t1 - cursor) + (host if part == 0 else 0.0)),
                    start_us=us(cursor - origin),
                    data_deps=deps,
                    ctrl_deps=[prev.id],
                    attrs={"is_cpu_op": True},
                )
                done[key] = n.id
                running.append((start, t1, n.id))
                prev, prev_end = n, t1
            elif a.kind in (SEND_F, SEND_B):
                fwd = a.kind == SEND_F
                to = a.stage + 1 if fwd else a.stage - 1
                mb = a.microbatch
                made = (
                    done[(rnd, F, a.stage, mb)]
                    if fwd
                    else done.get((rnd, B, a.stage, mb), done.get((rnd, I, a.stage, mb)))
                )
                attrs = {
                    "comm_src": me,
                    "comm_dst": grid.rank_of(grid.dp_rank, stage_to_rank(to, cfg.pp)),
                    "comm_size": sizes[key],
                    "comm_tag": _tag(to, mb, rnd, not fwd, cfg),
                }
                n = add(f"{a}{sfx}", chakra.COMM_SEND_NODE, data_deps=[made], attrs=attrs)
                done[key] = n.id
            elif a.kind in (RECV_F, RECV_B):
                fwd = a.kind == RECV_F
                peer = a.stage - 1 if fwd else a.stage + 1
                n = add(
                    f"{a}{sfx}",
                    chakra.COMM_RECV_NODE,
                    attrs={
                        "comm_src": grid.rank_of(grid.dp_rank, stage_to_rank(peer, cfg.pp)),
                        "comm_dst": me,
                        "comm_size": sizes[key],
                        "comm_tag": _tag(a.stage, a.microbatch, rnd, not fwd, cfg),
                    },
                )
                done[key] = n.id
    # The optimizer: from the last data-parallel wait to the step's end,
    # less the collectives that begin after that (they get nodes of their own).
    opt_from = prev_end if opt_from is None else opt_from
    before = sorted(op for op in dp_ops if op[0] < opt_from)
    after = sorted(op for op in dp_ops if op[0] >= opt_from)
    colls = []
    for t0, _t1, name, args in before:
        during = [nid for s0, _s1, nid in running if s0 <= t0] or [0]
        colls.append(_collective(add, name, args, grid, [during[-1]]).id)
    opt_end = step[1] if not after else after[0][0]
    opt = add(
        "optimizer",
        chakra.COMP_NODE,
        duration_us=us(opt_end - opt_from),
        data_deps=colls,
        ctrl_deps=[prev.id],
        attrs={"is_cpu_op": True},
    )
    dep = opt.id
    for _t0, _t1, name, args in after:
        dep = _collective(add, name, args, grid, [dep]).id
    return nodes


def _collective(add, name: str, args: dict, grid, deps: list[int], pg: str = "") -> chakra.Node:
    """A collective node of the data-parallel group (or of ``pg``)."""
    op, seq = args["op"], args.get("seq")
    if op not in chakra.COLLECTIVES:
        raise ValueError(f"chakra: the op {name!r} is not a collective")
    second = ".2" if args["group"] == "dp 2" else ""
    pg = pg or _dp_name(grid, grid.pp_rank, grid.tp_rank) + second
    return add(
        name,
        chakra.COMM_COLL_NODE,
        data_deps=deps,
        attrs={
            "comm_type": chakra.COLLECTIVES[op],
            "comm_size": int(args["bytes"]),
            "pg_name": pg,
            "clawcomm_seq": -1 if seq is None else int(seq),
        },
    )


def _inside_group(track: int, grid, cfg) -> str:
    """The process group of a collective that runs inside compute actions."""
    if track == trace.TP:
        return _tp_name(grid.pp_rank, grid.dp_rank, grid.cp_rank, cfg)
    return _ep_name(grid.pp_rank, grid.dp_rank // cfg.ep, grid.tp_rank, cfg)


def _tp_name(p: int, d: int, c: int, cfg) -> str:
    return f"tp{p}.{d}" + (f"c{c}" if cfg.cp > 1 else "")


def _ep_name(p: int, copy: int, t: int, cfg) -> str:
    return f"ep{p}.{copy}" + (f"t{t}" if cfg.tp > 1 else "")


def _dp_name(grid, pp_rank: int, tp_rank: int) -> str:
    return f"dp{pp_rank}" + (f"t{tp_rank}" if grid.tp > 1 else "")


def write(trainer, directory: str, step: int = -1) -> None:
    """Every rank's recorded ``step`` (default: the last) as a Chakra trace
    in ``directory``, written by rank 0 (collective)."""
    g, cfg = trainer.grid, trainer.cfg
    steps = trainer.recorder.steps
    mine = rank_nodes(steps[step], trainer.executor.actions, g, cfg) if steps else []
    host = int(os.environ.get("GROUP_RANK", "0"))
    gathered = [(g.rank, host, mine)]
    if dist.is_initialized():
        out = [None] * dist.get_world_size() if g.rank == 0 else None
        dist.gather_object((g.rank, host, mine), out, dst=0)
        gathered = out
    if g.rank != 0:
        return
    groups = {}
    for t in range(cfg.tp):
        for p in range(cfg.pp):
            members = g.replica_ranks(p, t)
            groups[_dp_name(g, p, t)] = groups[_dp_name(g, p, t) + ".2"] = members
        for d in range(cfg.dp):
            groups[f"pp{d}" + (f"t{t}" if cfg.tp > 1 else "")] = g.pipeline_ranks(d, t)
    for p in range(cfg.pp) if cfg.tp > 1 else ():
        for d in range(cfg.dp):
            for c in range(cfg.cp):
                groups[_tp_name(p, d, c, cfg)] = [g.rank_of(d, p, t, c) for t in range(cfg.tp)]
    for p in range(cfg.pp) if cfg.ep > 1 else ():
        for copy in range(cfg.dp // cfg.ep):
            for t in range(cfg.tp):
                ranks = [g.rank_of(copy * cfg.ep + j, p, t) for j in range(cfg.ep)]
                groups[_ep_name(p, copy, t, cfg)] = ranks
    ranks = {r: nodes for r, _h, nodes in gathered}
    _keep_common_collectives(ranks, groups)
    meta = {r: {"host": h, "clawcomm_label": _label(cfg, r)} for r, h, _ in gathered}
    chakra.write(directory, chakra.Trace(ranks=ranks, groups=groups, metadata=meta))


def _keep_common_collectives(ranks: dict, groups: dict) -> None:
    """A collective that one member's window caught and another's did not
    (it began as a step ended) would never complete in a replay: keep the
    sequence numbers every member of its group recorded."""
    seqs: dict[tuple[int, str], set] = {}
    for r, nodes in ranks.items():
        for n in nodes:
            if n.type == chakra.COMM_COLL_NODE:
                seqs.setdefault((r, n.attrs["pg_name"]), set()).add(n.attrs["clawcomm_seq"])
    for pg, members in groups.items():
        sets = [seqs.get((r, pg), set()) for r in members]
        common = set.intersection(*sets) if sets else set()
        for r in members:
            nodes = ranks.get(r, [])
            gone = {
                n.id
                for n in nodes
                if n.type == chakra.COMM_COLL_NODE
                and n.attrs["pg_name"] == pg
                and n.attrs["clawcomm_seq"] not in common
            }
            # a node after a dropped one waits for what that one waited for
            # (a chain through a tensor-parallel collective stays a chain)
            before = {n.id: n.data_deps + n.ctrl_deps for n in nodes if n.id in gone}

            def kept(deps: list[int], before=before) -> list[int]:
                out = []
                for d in deps:
                    out += kept(before[d]) if d in before else [d]
                return list(dict.fromkeys(out))

            for n in nodes:
                n.data_deps, n.ctrl_deps = kept(n.data_deps), kept(n.ctrl_deps)
            ranks[r] = [n for n in nodes if n.id not in gone]


def _label(cfg, rank: int) -> str:
    from clawcomm.train.grid import Grid

    g = Grid(cfg.dp, cfg.pp, rank, cfg.tp, cfg.cp)
    tp = f", tp {g.tp_rank}" if cfg.tp > 1 else ""
    ep = f", ep {g.dp_rank % cfg.ep}" if cfg.ep > 1 else ""
    cp = f", cp {g.cp_rank}" if cfg.cp > 1 else ""
    return f"dp {g.dp_rank}{ep}{cp}{tp}, pp {g.pp_rank}"
