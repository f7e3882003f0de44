"""A message-level event simulator of clawcomm's collectives: every rank
runs the algorithm's steps (the same peers, bytes and order as the engine),
and every message queues on the links it crosses.

    from clawcomm.cost_model import CostModel, Topology
    from clawcomm.simulate.messages import simulate
    simulate("all_reduce", "hierarchical", 64 << 20, Topology(2, 4), CostModel())

What it models, with the cost model's numbers (clawcomm.cost_model):
  * a message inside a host takes shm_alpha + bytes * shm_beta; a rank's
    messages of one step inside its host are copied one after another;
  * a message between hosts waits net_alpha, then crosses the sender's
    host uplink and the receiver's host downlink, each a first-come,
    first-served queue moving 1 / net_beta bytes a second (cut-through: the
    downlink can carry what the uplink is still sending);
  * a received message that is reduced takes gamma per byte on the
    receiving rank, one reduction at a time;
  * a step starts once the steps it depends on have ended (the previous
    step of its lane, and for the hierarchical all-reduce the phase of the
    other lane it waits for) and ends when its sends have left and its
    receives have arrived and been reduced.

It checks the closed forms in clawcomm.cost_model where both apply (tests assert
they agree within 5%), and shows what the closed forms leave out: queueing
of several streams on one link, and the pipelined overlap of the
hierarchical algorithms' phases. It runs every message in Python, so it is
meant for up to a few dozen ranks; clawcomm.cost_model projects further.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from clawcomm.cost_model import CostModel, Topology, hierarchical_pieces

__all__ = ["simulate", "simulates"]

# What the simulator runs message by message; the other rows of the
# engine's table (direct, the split broadcast and reduce, the binomial
# reduce) have closed forms only.
SIMULATED = {
    ("all_reduce", "ring"), ("all_reduce", "tree"), ("all_reduce", "hierarchical"),
    ("reduce_scatter", "ring"), ("reduce_scatter", "hierarchical"),
    ("all_gather", "ring"), ("all_gather", "hierarchical"), ("broadcast", "tree"),
}  # fmt: skip


def simulates(collective: str, algo: str) -> bool:
    """Whether ``simulate`` runs ``algo`` for ``collective``."""
    return (collective, algo) in SIMULATED


@dataclass
class _Step:
    rank: int
    deps: list[int]
    sends: list[tuple[int, float, int]] = field(default_factory=list)  # (peer, bytes, seq)
    recvs: list[tuple[int, float, bool, int]] = field(default_factory=list)  # + reduce
    work: float = 0.0  # seconds of local work (a copy) before it ends
    start: float = -1.0
    end: float = 0.0
    waiting: int = 0  # sends and receives not done yet
    unmet: int = 0  # dependencies not ended yet
    dependents: list[int] = field(default_factory=list)


class _Program:
    """Every rank's steps, with messages numbered per (sender, receiver) in
    program order, as the engine numbers its frames."""

    def __init__(self, n: int):
        self.steps: list[_Step] = []
        self.sent: dict[tuple[int, int], int] = {}
        self.received: dict[tuple[int, int], int] = {}
        self.last = [None] * n  # per rank: the last step of the default lane

    def step(self, rank: int, deps: list[int | None]) -> int:
        self.steps.append(_Step(rank, [d for d in deps if d is not None]))
        return len(self.steps) - 1

    def local(self, rank: int, seconds: float, deps: list[int | None]) -> int:
        """A step of local work only (a copy), no messages."""
        s = self.step(rank, deps)
        self.steps[s].work = seconds
        return s

    def send(self, s: int, peer: int, nbytes: float) -> None:
        key = (self.steps[s].rank, peer)
        self.steps[s].sends.append((peer, nbytes, self.sent.get(key, 0)))
        self.sent[key] = self.sent.get(key, 0) + 1

    def recv(self, s: int, peer: int, nbytes: float, reduce: bool) -> None:
        key = (peer, self.steps[s].rank)
        self.steps[s].recvs.append((peer, nbytes, reduce, self.received.get(key, 0)))
        self.received[key] = self.received.get(key, 0) + 1


def _ring(prog: _Program, members: list[int], chunk: float, reduce_steps: int,
          plain_steps: int, after: dict[int, int | None]) -> dict[int, int | None]:  # fmt: skip
    """A ring over `members`: reduce_steps steps that reduce, then
    plain_steps that copy, chunk bytes each; returns each member's last
    step."""
    g = len(members)
    last = dict(after)
    if g <= 1:
        return last
    for s in range(reduce_steps + plain_steps):
        for i, r in enumerate(members):
            st = prog.step(r, [last[r]])
            prog.send(st, members[(i + 1) % g], chunk)
            prog.recv(st, members[(i - 1) % g], chunk, s < reduce_steps)
            last[r] = st
    return last


def _tree(prog: _Program, members: list[int], nbytes: float,
          after: dict[int, int | None]) -> dict[int, int | None]:  # fmt: skip
    n = len(members)
    last = dict(after)
    p = 1
    while p * 2 <= n:
        p *= 2
    extra = n - p

    def exchange(pairs, one_way):
        for a, b in pairs:
            sa = prog.step(members[a], [last[members[a]]])
            sb = prog.step(members[b], [last[members[b]]])
            prog.send(sa, members[b], nbytes)
            prog.recv(sb, members[a], nbytes, True)
            if not one_way:
                prog.send(sb, members[a], nbytes)
                prog.recv(sa, members[b], nbytes, True)
            last[members[a]], last[members[b]] = sa, sb

    if extra:
        exchange([(2 * i, 2 * i + 1) for i in range(extra)], one_way=True)
    survivor = [r for r in range(n) if r >= 2 * extra or r % 2 == 1]
    mask = 1
    while mask < p:
        exchange([(survivor[i], survivor[i ^ mask]) for i in range(p) if i < i ^ mask], False)
        mask *= 2
    if extra:
        for i in range(extra):
            a, b = members[2 * i + 1], members[2 * i]
            sa, sb = prog.step(a, [last[a]]), prog.step(b, [last[b]])
            prog.send(sa, b, nbytes)
            prog.recv(sb, a, nbytes, False)
            last[a], last[b] = sa, sb
    return last


def _broadcast(prog: _Program, n: int, nbytes: float) -> None:
    """binomial_broadcast.cc: receive from the parent, then send to every
    child at once (largest subtree first) and acknowledge to the parent,
    then wait for the children's acknowledgements."""
    for v in range(n):
        parent = v & (v - 1) if v else None
        received = None
        if parent is not None:
            received = prog.step(v, [])
            prog.recv(received, parent, nbytes, False)
        rest = prog.step(v, [received])
        low = (v & -v) if v else 1 << n.bit_length()
        mask = 1 << (n.bit_length())
        while mask:
            if mask < low and v + mask < n:
                prog.send(rest, v + mask, nbytes)
                prog.recv(rest, v + mask, 0.0, False)
            mask >>= 1
        if parent is not None:
            prog.send(rest, parent, 0.0)


def _hierarchical(prog: _Program, topology: Topology, N: float) -> None:
    """The engine's schedule (hierarchical_all_reduce.cc): a shared-memory
    lane running RS 0, RS 1, AG 0, RS 2, AG 1, ..., AG P-1 and a network
    lane running the pieces' cross-host rings in order."""
    k, hosts = topology.ranks_per_host, topology.hosts
    pieces = hierarchical_pieces(N)
    piece = N / pieces
    local = [[h * k + i for i in range(k)] for h in range(hosts)]
    cross = [[h * k + i for h in range(hosts)] for i in range(k)]
    shm_last: dict[int, int | None] = dict.fromkeys(range(topology.size))
    net_last: dict[int, int | None] = dict.fromkeys(range(topology.size))
    rs_end: dict[int, dict] = {}
    ar_end: dict[int, dict] = {}

    def reduce_scatter(p):
        for group in local:
            shm_last.update(_ring(prog, group, piece / k, k - 1, 0, shm_last))
        rs_end[p] = dict(shm_last)

    def cross_host(p):
        after = {r: _latest(prog, net_last[r], rs_end[p][r]) for r in range(topology.size)}
        for group in cross:
            if pieces == 1 and _tree_is_cheaper(piece / k, hosts, k, prog):
                after.update(_tree(prog, group, piece / k, after))
            else:
                after.update(_ring(prog, group, piece / k / hosts, hosts - 1, hosts - 1, after))
        net_last.update(after)
        ar_end[p] = dict(after)

    def all_gather(p):
        after = {r: _latest(prog, shm_last[r], ar_end[p][r]) for r in range(topology.size)}
        for group in local:
            after.update(_ring(prog, group, piece / k, 0, k - 1, after))
        shm_last.update(after)

    # The network lane's steps are built as soon as their piece is
    # scattered; the order of building does not matter to the simulation,
    # only the dependencies and the per-pair message order.
    reduce_scatter(0)
    cross_host(0)
    for p in range(1, pieces):
        reduce_scatter(p)
        cross_host(p)
        all_gather(p - 1)
    all_gather(pieces - 1)


def _hierarchical_gather_scatter(prog: _Program, topology: Topology, N: float, reducing: bool):
    """hierarchical_gather_scatter.cc, pipelined in pieces: the reduce-
    scatter runs each piece inside the hosts, then across them; the all-
    gather across, then inside. Each lane takes the pieces in order, and a
    piece's second ring waits for its first."""
    k, hosts = topology.ranks_per_host, topology.hosts
    pieces = hierarchical_pieces(N)
    piece = N / pieces
    local = [[h * k + i for i in range(k)] for h in range(hosts)]
    cross = [[h * k + i for h in range(hosts)] for i in range(k)]
    inside = (local, piece / k, k - 1)
    across = (cross, piece / (k * hosts), hosts - 1)
    lanes = (inside, across) if reducing else (across, inside)
    first_last: dict[int, int | None] = dict.fromkeys(range(topology.size))
    second_last: dict[int, int | None] = dict.fromkeys(range(topology.size))

    def ring(groups, chunk, steps, after):
        for g in groups:
            after = _ring(prog, g, chunk, steps if reducing else 0, 0 if reducing else steps, after)
        return after

    for _ in range(pieces):
        first_last = ring(*lanes[0], first_last)
        after = {r: _latest(prog, second_last[r], first_last[r]) for r in range(topology.size)}
        second_last = ring(*lanes[1], after)


def _latest(prog: _Program, a: int | None, b: int | None) -> int | None:
    """A join step with no messages that waits for both (None: nothing)."""
    if a is None or b is None:
        return a if b is None else b
    rank = prog.steps[a].rank
    return prog.step(rank, [a, b])


def _tree_is_cheaper(shard: float, hosts: int, streams: int, prog: _Program) -> bool:
    from clawcomm.cost_model.formulas import _cross_host, ring_all_reduce

    model = prog.model
    shared = CostModel(model.shm_alpha, model.shm_beta, model.net_alpha,
                       model.net_beta * streams, model.gamma)  # fmt: skip
    return _cross_host(shard, hosts, streams, model, 1) < ring_all_reduce(
        shard, Topology(hosts, 1), shared
    )


def _build(collective: str, algo: str, N: float, topology: Topology, model: CostModel) -> _Program:
    n = topology.size
    prog = _Program(n)
    prog.model = model
    everyone: dict[int, int | None] = dict.fromkeys(range(n))
    if (collective, algo) == ("all_reduce", "ring"):
        _ring(prog, list(range(n)), N / n, n - 1, n - 1, everyone)
    elif (collective, algo) == ("all_reduce", "tree"):
        _tree(prog, list(range(n)), N, everyone)
    elif (collective, algo) == ("all_reduce", "hierarchical"):
        if not topology.hierarchical:
            raise ValueError(f"the hierarchical all-reduce needs 2+ hosts of 2+ ranks: {topology}")
        _hierarchical(prog, topology, N)
    elif (collective, algo) == ("reduce_scatter", "ring"):
        # The ring reduces in place, in a working copy of the input.
        copied = {r: prog.local(r, N * model.shm_beta, []) for r in range(n)}
        _ring(prog, list(range(n)), N / n, n - 1, 0, copied)
    elif (collective, algo) == ("all_gather", "ring"):
        _ring(prog, list(range(n)), N / n, 0, n - 1, everyone)
    elif algo == "hierarchical" and collective in ("reduce_scatter", "all_gather"):
        if not topology.hierarchical:
            raise ValueError(
                f"the hierarchical {collective} needs 2+ hosts of 2+ ranks: {topology}"
            )
        _hierarchical_gather_scatter(prog, topology, N, collective == "reduce_scatter")
    elif (collective, algo) == ("broadcast", "tree"):
        _broadcast(prog, n, N)
    else:
        raise ValueError(f"the simulator has no {algo!r} algorithm for {collective}")
    return prog


def simulate(
    collective: str, algo: str, nbytes: float, topology: Topology, model: CostModel
) -> float:
    """Seconds until the last rank finishes `collective` of `nbytes` (sized
    as clawcomm.cost_model.predict sizes it)."""
    prog = _build(collective, algo, float(nbytes), topology, model)
    steps = prog.steps
    for i, st in enumerate(steps):
        st.unmet = len(st.deps)
        st.waiting = len(st.sends) + len(st.recvs)
        for d in st.deps:
            steps[d].dependents.append(i)
    host = topology.host_of
    up_free = [0.0] * topology.hosts
    down_free = [0.0] * topology.hosts
    compute_free = [0.0] * topology.size
    arrived: dict[tuple[int, int, int], float] = {}  # message -> arrival time
    posted: dict[tuple[int, int, int], tuple[int, float, bool]] = {}  # -> (step, bytes, reduce)
    events: list = []
    order = 0

    def push(t, kind, *payload):
        nonlocal order
        heapq.heappush(events, (t, order, kind, payload))
        order += 1

    def part_done(i: int, t: float) -> None:
        st = steps[i]
        st.end = max(st.end, t)
        st.waiting -= 1
        if st.waiting == 0:
            push(st.end, "end", i)

    def receive(i: int, t: float, nbytes: float, reduce: bool) -> None:
        r = steps[i].rank
        if reduce and nbytes:
            t = max(t, compute_free[r]) + nbytes * model.gamma
            compute_free[r] = t
        part_done(i, t)

    def start(i: int, t: float) -> None:
        st = steps[i]
        st.start = st.end = t
        if st.waiting == 0:
            st.end = t + st.work
            push(st.end, "end", i)
            return
        copied = t  # the rank's progress thread copies its local sends one at a time
        for peer, nbytes, seq in st.sends:
            if host(peer) == host(st.rank):
                copied += model.shm_alpha + nbytes * model.shm_beta
                push(copied, "sent", i)
                push(copied, "arrive", (st.rank, peer, seq), nbytes)
            else:
                push(t + model.net_alpha, "up", i, st.rank, peer, seq, nbytes)
        for peer, nbytes, reduce, seq in st.recvs:
            key = (peer, st.rank, seq)
            if key in arrived:
                receive(i, max(t, arrived.pop(key)), nbytes, reduce)
            else:
                posted[key] = (i, nbytes, reduce)

    for i, st in enumerate(steps):
        if st.unmet == 0:
            push(0.0, "start", i)
    finish = 0.0
    while events:
        t, _, kind, payload = heapq.heappop(events)
        if kind == "start":
            start(payload[0], t)
        elif kind == "end":
            i = payload[0]
            finish = max(finish, t)
            for d in steps[i].dependents:
                steps[d].unmet -= 1
                if steps[d].unmet == 0:
                    push(max(t, max(steps[x].end for x in steps[d].deps)), "start", d)
        elif kind == "sent":
            part_done(payload[0], t)
        elif kind == "up":
            i, src, dst, seq, nbytes = payload
            begin = max(t, up_free[host(src)])
            up_free[host(src)] = begin + nbytes * model.net_beta
            push(up_free[host(src)], "sent", i)
            push(begin, "down", (src, dst, seq), nbytes, up_free[host(src)])
        elif kind == "down":
            key, nbytes, up_done = payload
            dst = key[1]
            begin = max(t, down_free[host(dst)])
            down_free[host(dst)] = max(begin + nbytes * model.net_beta, up_done)
            push(down_free[host(dst)], "arrive", key, nbytes)
        elif kind == "arrive":
            key, nbytes = payload
            if key in posted:
                i, _, reduce = posted.pop(key)
                receive(i, t, nbytes, reduce)
            else:
                arrived[key] = t
    unfinished = [i for i, st in enumerate(steps) if st.start < 0]
    if unfinished:
        raise RuntimeError(f"simulate: {len(unfinished)} steps never started (a deadlock)")
    return finish
