"""Replays a Chakra execution trace (clawcomm/chakra.py) with the cost model:
``clawcomm simulate --chakra DIR``.

Every rank runs its nodes as their dependencies allow, with:

* compute nodes taking their recorded ``duration_micros``, one at a time
  per rank (one host thread or one device runs them), the earliest ready
  first, ties in file order;
* a collective starting once every member of its process group has reached
  it (the k-th collective of a group on each member is one collective) and
  the group's previous collective is done (a communicator runs one at a
  time), and taking clawcomm.cost_model's time for its kind, bytes and the
  group's topology of hosts (``choose``: the algorithm ``CLAWCOMM_ALGO=auto``
  would take);
* a send starting when ready and once the previous message from that rank
  to that peer is through, taking one message's time over shared memory or
  the link (``shm_alpha + bytes * shm_beta``, ``net_alpha + bytes *
  net_beta``); the receive with the same source, destination and tag (the
  k-th such pair) completes when both it is ready and the message is in;
* any other node completing once ready.

The predicted step is the last node's end. Its critical path is walked back
from there, each node to whatever it waited for last: a dependency, the
rank's previous compute, the slowest member of a collective, or a message.

An all-to-all costs the engine's pairwise exchange of its input bytes (the
experts' uneven ones priced as even); gather and scatter cost an all-gather
of the same bytes, and a barrier an all-reduce of 8 bytes: the model has no
formulas for them (the report says when it used these stand-ins).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

from clawcomm import chakra
from clawcomm.cost_model import CostModel, Topology, predict

_STAND_INS = {
    "gather": "all_gather",
    "scatter": "all_gather",
    "reduce_scatter_block": "reduce_scatter",
}


@dataclass
class Span:
    rank: int
    node: chakra.Node
    start: float  # seconds
    end: float
    cause: tuple[int, int] | None = None  # (rank, node id) it waited for last
    why: str = ""  # what held it back: "dependency", "compute", "collective", "message"


@dataclass
class Replay:
    step: float  # seconds
    spans: dict[tuple[int, int], Span]
    critical: list[Span]
    stand_ins: set = field(default_factory=set)

    def contributions(self) -> list[tuple[Span, float]]:
        """Each critical-path node with the time it adds to the path (what
        it runs past the end of the node before it on the path)."""
        out, prev_end = [], 0.0
        for s in self.critical:
            out.append((s, max(0.0, s.end - max(s.start, prev_end))))
            prev_end = max(prev_end, s.end)
        return out

    def share(self) -> dict[str, float]:
        """The critical path's time by kind: compute, collective, message,
        and idle (time no node on the path accounts for)."""
        out = defaultdict(float)
        for s, added in self.contributions():
            out[_kind(s.node)] += added
        out["idle"] = max(0.0, self.step - sum(out.values()))
        return dict(out)


_KINDS = {
    chakra.COMP_NODE: "compute",
    chakra.COMM_COLL_NODE: "collective",
    chakra.COMM_SEND_NODE: "message",
    chakra.COMM_RECV_NODE: "message",
}


def _kind(n: chakra.Node) -> str:
    return _KINDS.get(n.type, "other")


def group_topology(members: list[int], host_of) -> Topology:
    """The hosts x ranks-per-host topology a group's members sit on (the most
    ranks on one host, when hosts hold different numbers)."""
    per_host = defaultdict(int)
    for r in members:
        per_host[host_of(r)] += 1
    return Topology(len(per_host), max(per_host.values()))


def replay(
    trace: chakra.Trace,
    model: CostModel,
    host_of=None,
    project_hosts: int = 0,
) -> Replay:
    """Runs ``trace``; ``host_of(rank)`` says where each rank is (default:
    the traces' ``host`` metadata, else a host per rank). ``project_hosts``
    > 0: every collective as if its group spanned that many hosts, with the
    group's ranks per host kept (data parallelism scaled out, the work per
    rank unchanged)."""
    if host_of is None:
        hosts = {r: m.get("host", r) for r, m in trace.metadata.items()}
        host_of = lambda r: hosts.get(r, r)  # noqa: E731
    every = sorted(trace.ranks)
    nodes = {(r, n.id): n for r, ns in trace.ranks.items() for n in ns}
    order = {(r, n.id): i for r, ns in trace.ranks.items() for i, n in enumerate(ns)}
    for (r, nid), n in nodes.items():
        for d in n.deps:
            if (r, d) not in nodes:
                raise ValueError(
                    f"Chakra trace: rank {r}'s node {nid} ({n.name}) depends on "
                    f"node {d}, which rank {r}'s file does not have"
                )
    # The k-th collective of each group on each member, and each message's pair.
    coll_index, coll_members = {}, {}
    seen = defaultdict(int)
    for r in every:
        for n in trace.ranks[r]:
            if n.type == chakra.COMM_COLL_NODE:
                pg = str(n.attrs.get("pg_name", ""))
                members = trace.groups.get(pg, every) if pg else every
                if r not in members:
                    raise ValueError(
                        f"Chakra trace: rank {r}'s collective {n.name!r} is in group {pg!r}, "
                        f"whose ranks {members} do not include it"
                    )
                coll_index[(r, n.id)] = (pg, seen[(r, pg)])
                coll_members[pg] = members
                seen[(r, pg)] += 1
    msg_key = {}
    for r in every:
        count = defaultdict(int)
        for n in trace.ranks[r]:
            if n.type in (chakra.COMM_SEND_NODE, chakra.COMM_RECV_NODE):
                send = n.type == chakra.COMM_SEND_NODE
                src = int(n.attrs.get("comm_src", r)) if not send else r
                dst = r if not send else int(n.attrs["comm_dst"])
                base = (src, dst, int(n.attrs.get("comm_tag", 0)))
                msg_key[(r, n.id)] = base + (count[base],)
                count[base] += 1

    stand_ins = set()

    def collective_time(n: chakra.Node, members: list[int]) -> float:
        kind = n.collective
        if kind == "barrier":
            kind, nbytes = "all_reduce", 8
        else:
            nbytes = n.comm_size
        if kind in _STAND_INS:
            stand_ins.add(kind)
            kind = _STAND_INS[kind]
        if kind == "unknown":
            raise ValueError(
                f"Chakra trace: collective {n.name!r} has comm_type "
                f"{n.attrs.get('comm_type')!r}, not one of Chakra's"
            )
        topology = group_topology(members, host_of)
        if project_hosts:
            topology = Topology(project_hosts, topology.ranks_per_host)
        return predict(kind, "auto", nbytes, topology, model) if topology.size > 1 else 0.0

    def message_time(src: int, dst: int, nbytes: int) -> float:
        if host_of(src) == host_of(dst):
            return model.shm_alpha + nbytes * model.shm_beta
        return model.net_alpha + nbytes * model.net_beta

    waiting = {k: len(set(n.deps)) for k, n in nodes.items()}
    dependents = defaultdict(list)
    for (r, nid), n in nodes.items():
        for d in set(n.deps):
            dependents[(r, d)].append((r, nid))
    ready_at, ready_cause = {}, {}
    spans: dict[tuple[int, int], Span] = {}
    events = []  # (time, seq, what, key)
    seq = 0

    def push(t, what, key):
        nonlocal seq
        heapq.heappush(events, (t, seq, what, key))
        seq += 1

    compute_free = defaultdict(float)
    compute_last = {}
    compute_queue = defaultdict(list)  # rank -> heap of (ready, order, key)
    arrived = defaultdict(dict)  # (pg, k) -> {rank: key}
    pg_next = defaultdict(int)  # the next collective index each group may start
    pg_free, pg_last = defaultdict(float), {}
    sent = {}  # message key -> (arrival time, send key)
    recv_waiting = {}  # message key -> recv key
    link_free, link_last = defaultdict(float), {}

    def finish(key, span):
        spans[key] = span
        push(span.end, "done", key)

    def start_compute(r, now):
        if not compute_queue[r] or compute_free[r] > now:
            return
        _, _, key = heapq.heappop(compute_queue[r])
        start = max(now, ready_at[key])
        cause, why = ready_cause[key], "dependency"
        if r in compute_last and compute_free[r] >= ready_at[key]:
            cause, why = compute_last[r], "compute"
        end = start + nodes[key].duration_us / 1e6
        compute_free[r], compute_last[r] = end, key
        finish(key, Span(r, nodes[key], start, end, cause, why))

    def try_collectives(pg, now):
        while True:
            k = pg_next[pg]
            here = arrived.get((pg, k), {})
            if len(here) < len(coll_members[pg]):
                return
            last_key = max(here.values(), key=lambda key: ready_at[key])
            start = max(ready_at[last_key], pg_free[pg])
            # What it waited for last: the group's previous collective, or
            # what its slowest member waited for.
            cause = ready_cause[last_key]
            if pg in pg_last and pg_free[pg] > ready_at[last_key]:
                cause = pg_last[pg]
            end = start + collective_time(nodes[last_key], coll_members[pg])
            for r, key in here.items():
                finish(key, Span(r, nodes[key], start, end, cause, "collective"))
            pg_free[pg], pg_last[pg] = end, last_key
            pg_next[pg] += 1
            del arrived[(pg, k)]

    def became_ready(key, t):
        r, _ = key
        n = nodes[key]
        if n.type == chakra.COMP_NODE:
            heapq.heappush(compute_queue[r], (t, order[key], key))
            start_compute(r, t)
        elif n.type == chakra.COMM_COLL_NODE:
            pg, k = coll_index[key]
            arrived[(pg, k)][r] = key
            try_collectives(pg, t)
        elif n.type == chakra.COMM_SEND_NODE:
            mk = msg_key[key]
            link = mk[:2]
            start = max(t, link_free[link])
            cause, why = ready_cause[key], "dependency"
            if link in link_last and link_free[link] >= t:
                cause, why = link_last[link], "message"
            end = start + message_time(mk[0], mk[1], n.comm_size)
            link_free[link], link_last[link] = end, key
            finish(key, Span(r, n, start, end, cause, why))
            sent[mk] = (end, key)
            if mk in recv_waiting:
                _complete_recv(recv_waiting.pop(mk), end, key)
        elif n.type == chakra.COMM_RECV_NODE:
            mk = msg_key[key]
            if mk in sent:
                _complete_recv(key, *sent[mk])
            else:
                recv_waiting[mk] = key
        else:
            finish(key, Span(r, n, t, t, ready_cause[key], "dependency"))

    def _complete_recv(key, arrival, send_key):
        t = max(arrival, ready_at[key])
        cause = send_key if arrival >= ready_at[key] else ready_cause[key]
        finish(key, Span(key[0], nodes[key], ready_at[key], t, cause, "message"))

    for key, count in waiting.items():
        if count == 0:
            ready_at[key], ready_cause[key] = 0.0, None
            push(0.0, "ready", key)
    while events:
        t, _, what, key = heapq.heappop(events)
        if what == "ready":
            became_ready(key, t)
            continue
        r = key[0]
        if nodes[key].type == chakra.COMP_NODE:
            start_compute(r, t)
        for dep in dependents[key]:
            if ready_at.get(dep, -1.0) <= t:
                ready_at[dep], ready_cause[dep] = t, key
            waiting[dep] -= 1
            if waiting[dep] == 0:
                push(t, "ready", dep)
    stuck = [k for k in nodes if k not in spans]
    if stuck:
        names = ", ".join(f"rank {r} {nodes[(r, i)].name!r}" for r, i in stuck[:6])
        raise ValueError(
            f"Chakra replay: {len(stuck)} node(s) never ran ({names}"
            f"{', ...' if len(stuck) > 6 else ''}): a collective some member never reaches, a "
            "receive with no matching send (source, destination, tag), or a dependency cycle"
        )
    if not spans:
        return Replay(0.0, {}, [], stand_ins)
    last = max(spans.values(), key=lambda s: (s.end, -order[(s.rank, s.node.id)]))
    path, key = [], (last.rank, last.node.id)
    while key is not None and key in spans and len(path) <= len(spans):
        path.append(spans[key])
        key = spans[key].cause
    return Replay(last.end, spans, path[::-1], stand_ins)


def report(result: Replay, top: int = 8) -> str:
    """The predicted step, its critical path's shares and its longest nodes."""
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    lines = [f"predicted step: {ms(result.step)}"]
    if result.stand_ins:
        lines.append(f"(costed as stand-ins: {', '.join(sorted(result.stand_ins))}; see docs)")
    share = result.share()
    parts = ", ".join(f"{k} {ms(v)} ({v / result.step:.0%})" for k, v in share.items() if v > 0)
    lines.append(f"critical path: {len(result.critical)} nodes: {parts}")
    lines.append(f"its {top} largest parts (start, time added, rank, kind, node):")
    longest = sorted(result.contributions(), key=lambda p: p[1], reverse=True)[:top]
    for s, added in sorted(longest, key=lambda p: p[0].start):
        extra = ""
        if s.node.type in (chakra.COMM_COLL_NODE, chakra.COMM_SEND_NODE, chakra.COMM_RECV_NODE):
            extra = f" ({s.node.comm_size} B)"
        lines.append(
            f"  {ms(s.start):>10} +{ms(added):>10}  rank {s.rank:<3} "
            f"{_kind(s.node):<10} {s.node.name}{extra}"
        )
    return "\n".join(lines)
