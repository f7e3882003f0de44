"""The cost model: what a collective takes on a topology of hosts x ranks.

The engine's ``CLAWCOMM_ALGO=auto`` chooses by the same closed forms
(``csrc/algorithms/selection.cc``; tests compare the two), and
``clawcomm simulate`` prints them at any scale. ``clawcomm.simulate.messages`` runs
the same algorithms message by message as a check.

A message between ranks of one host costs ``shm_alpha + bytes * shm_beta``.
One between hosts costs ``net_alpha + bytes * net_beta`` per stream, and the
streams that leave one host in the same step share its link, so ``s`` of
them take ``net_alpha + s * bytes * net_beta``. A step costs its slowest
message; reducing costs ``gamma`` per byte. docs/algorithms.md derives each
formula.

    from clawcomm.cost_model import CostModel, Topology, predict
    model = CostModel.load("model.json")            # clawcomm bench --calibrate
    predict("all_reduce", "hierarchical", 1 << 30, Topology(128, 8), model)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields, replace

__all__ = [
    "ALGORITHMS",
    "CostModel",
    "Topology",
    "busbw_factor",
    "choose",
    "hierarchical_pieces",
    "link_bits_per_s",
    "predict",
]

# Mirrors csrc/algorithms/algorithms.h.
PIECE_BYTES = 4 << 20
MAX_PIECES = 16

# Mirrors csrc/algorithms/algorithms.h: direct algorithms run on one host of
# at most this many ranks.
DIRECT_MAX_RANKS = 16

# Mirrors csrc/common/settings.h: frames of at least this many bytes go by
# single copy (CLAWCOMM_SINGLE_COPY_BYTES's default).
SINGLE_COPY_BYTES = 1 << 20

# Which algorithms each collective has: the engine's table
# (csrc/algorithms/selection.cc), its names and its order (ties in cost go
# to the later row).
ALGORITHMS = {
    "all_reduce": ("oneshot", "twoshot", "ring", "tree", "hierarchical"),
    "reduce_scatter": ("ring", "hierarchical", "direct"),
    "all_gather": ("ring", "hierarchical", "direct"),
    "broadcast": ("direct", "scatter_allgather", "tree"),
    "reduce": ("reducescatter_gather", "tree"),
}

# The rows auto passes over (selection.cc's chooseAlgorithm): the two-shot
# all-reduce runs only where named (measured behind the ring at 3 ranks).
NAMED_ONLY = {("all_reduce", "twoshot")}


@dataclass
class CostModel:
    """Seconds per message (alpha), per byte (beta) and per byte reduced
    (gamma); the defaults are the engine's (csrc/common/cost_model.h)."""

    shm_alpha: float = 8e-6
    shm_beta: float = 1 / 5e9
    net_alpha: float = 50e-6
    net_beta: float = 1 / 1.25e9
    gamma: float = 1 / 4e9

    @classmethod
    def load(cls, path: str) -> CostModel:
        with open(path) as f:
            data = json.load(f)
        missing = [f.name for f in fields(cls) if f.name not in data]
        if missing:
            raise ValueError(f"cost model {path}: missing {', '.join(missing)}")
        return cls(**{f.name: float(data[f.name]) for f in fields(cls)})

    def save(self, path: str, **extra) -> None:
        with open(path, "w") as f:
            json.dump({**asdict(self), **extra}, f, indent=2)
            f.write("\n")

    def with_link(self, rate: str | None) -> CostModel:
        """This model with each host's link at ``rate`` (tc's syntax, as
        ``--link`` takes it: ``1gbit``, ``200mbit``); unchanged for None."""
        return replace(self, net_beta=8 / link_bits_per_s(rate)) if rate else self


def link_bits_per_s(rate: str) -> float:
    """A link rate in tc's syntax (``10gbit``, ``200mbit``, ``500kbit``) in
    bits per second: the one parser of ``--link`` for the cost model, the
    compression lab and the namespace hosts that shape their links with it."""
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmg]?)bit", str(rate).strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r} is not like '1gbit', '200mbit' or '10gbit'")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


@dataclass(frozen=True)
class Topology:
    """`hosts` hosts of `ranks_per_host` ranks, numbered host by host (as
    torchrun numbers them)."""

    hosts: int
    ranks_per_host: int

    @property
    def size(self) -> int:
        return self.hosts * self.ranks_per_host

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    @property
    def hierarchical(self) -> bool:
        return self.hosts >= 2 and self.ranks_per_host >= 2


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth."""
    if n <= 1:
        return 1.0
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(collective, (n - 1) / n)


def hierarchical_pieces(nbytes: float) -> int:
    return int(min(MAX_PIECES, max(1, nbytes // PIECE_BYTES)))


def _streams(topology: Topology, partner) -> tuple[bool, int]:
    """Whether some message of the step stays inside a host, and the most
    streams leaving one host, when rank r sends to partner(r) (None: r
    sends nothing)."""
    local, leaving = False, {}
    for r in range(topology.size):
        p = partner(r)
        if p is None or p == r:
            continue
        if topology.host_of(p) == topology.host_of(r):
            local = True
        else:
            h = topology.host_of(r)
            leaving[h] = leaving.get(h, 0) + 1
    return local, max(leaving.values(), default=0)


def _step(topology: Topology, m: CostModel, nbytes: float, partner) -> float:
    local, streams = _streams(topology, partner)
    cost = m.shm_alpha + nbytes * m.shm_beta if local else 0.0
    if streams:
        cost = max(cost, m.net_alpha + streams * nbytes * m.net_beta)
    return cost


def _ring_steps(
    topology: Topology, m: CostModel, chunk: float, reducing: int, copying: int
) -> float:
    """`reducing` then `copying` steps of the ring 0 -> 1 -> ... -> n-1 -> 0
    over ranks numbered host by host: one stream leaves each host (two
    hosts or more), the other edges stay inside hosts. On one host every
    step is a copy and a reduction. Across hosts the link is the
    bottleneck: the ranks behind a shared-memory edge reduce while the
    link carries the next chunk, so a step costs the slower of the link's
    message and a local message plus its reduction, and one reduction is
    left at the end."""
    k, hosts = topology.ranks_per_host, topology.hosts
    shm = m.shm_alpha + chunk * m.shm_beta if k > 1 else 0.0
    reduce = chunk * m.gamma
    if hosts == 1:
        return reducing * (shm + reduce) + copying * shm
    net = m.net_alpha + chunk * m.net_beta
    if k == 1:  # every edge crosses a link
        return reducing * (net + reduce) + copying * net
    cost = reducing * max(net, shm + reduce) + copying * max(net, shm)
    return cost + (reduce if reducing else 0.0)


def ring_all_reduce(N: float, topology: Topology, m: CostModel) -> float:
    n = topology.size
    if n <= 1:
        return 0.0
    return _ring_steps(topology, m, N / n, n - 1, n - 1)


def ring_reduce_scatter(N: float, topology: Topology, m: CostModel) -> float:
    """n-1 reducing steps, after a working copy of the input (the ring
    reduces in place)."""
    n = topology.size
    return _ring_steps(topology, m, N / n, n - 1, 0) + N * m.shm_beta


def ring_all_gather(N: float, topology: Topology, m: CostModel) -> float:
    n = topology.size
    if n <= 1:
        return 0.0
    return _ring_steps(topology, m, N / n, 0, n - 1)


def tree_all_reduce(N: float, topology: Topology, m: CostModel) -> float:
    n = topology.size
    p = 1
    while p * 2 <= n:
        p *= 2
    extra = n - p
    cost = 0.0
    if extra > 0:
        fold = _step(topology, m, N, lambda r: (r ^ 1) if r < 2 * extra else None)
        cost += 2 * fold + N * m.gamma
    survivor = [r for r in range(n) if r >= 2 * extra or r % 2 == 1]
    index = {r: i for i, r in enumerate(survivor)}
    mask = 1
    while mask < p:
        cost += _step(
            topology,
            m,
            N,
            lambda r, mask=mask: survivor[index[r] ^ mask] if r in index else None,
        )
        cost += N * m.gamma
        mask *= 2
    return cost


def _cross_host(shard: float, hosts: int, streams: int, m: CostModel, pieces: int) -> float:
    """The hierarchical all-reduce's network phase: ring (or, unpipelined,
    the cheaper of ring and tree) over one rank per host, `streams` of them
    sharing each link."""
    shared = CostModel(m.shm_alpha, m.shm_beta, m.net_alpha, m.net_beta * streams, m.gamma)
    across = Topology(hosts, 1)
    ring = ring_all_reduce(shard, across, shared)
    if pieces > 1:
        return ring
    return min(ring, tree_all_reduce(shard, across, shared))


def hierarchical_all_reduce(N: float, topology: Topology, m: CostModel) -> float:
    if not topology.hierarchical:
        return math.inf
    k, hosts = topology.ranks_per_host, topology.hosts
    pieces = hierarchical_pieces(N)
    piece = N / pieces
    shm = 2 * (k - 1) * (m.shm_alpha + piece / k * m.shm_beta) + (k - 1) / k * piece * m.gamma
    net = _cross_host(piece / k, hosts, k, m, pieces)
    if pieces == 1:
        return shm + net
    return pieces * max(shm, net) + min(shm, net)


def _shared(m: CostModel, streams: int) -> CostModel:
    return CostModel(m.shm_alpha, m.shm_beta, m.net_alpha, m.net_beta * streams, m.gamma)


def _pipelined(shm: float, net: float, pieces: int) -> float:
    """Two phases per piece, overlapping from piece to piece."""
    return shm + net if pieces == 1 else pieces * max(shm, net) + min(shm, net)


def hierarchical_reduce_scatter(N: float, topology: Topology, m: CostModel) -> float:
    """Per piece, a ring reduce-scatter inside each host, then one across
    hosts over the part this rank owns, k streams sharing each link;
    pipelined (hierarchical_gather_scatter.cc)."""
    if not topology.hierarchical:
        return math.inf
    k, hosts = topology.ranks_per_host, topology.hosts
    pieces = hierarchical_pieces(N)
    piece = N / pieces
    inside = _ring_steps(Topology(1, k), m, piece / k, k - 1, 0)
    across = _ring_steps(Topology(hosts, 1), _shared(m, k), piece / (k * hosts), hosts - 1, 0)
    return _pipelined(inside, across, pieces)


def hierarchical_all_gather(N: float, topology: Topology, m: CostModel) -> float:
    """Per piece, across hosts first (a k-th per local index), then inside
    each host; pipelined."""
    if not topology.hierarchical:
        return math.inf
    k, hosts = topology.ranks_per_host, topology.hosts
    pieces = hierarchical_pieces(N)
    piece = N / pieces
    across = ring_all_gather(piece / k, Topology(hosts, 1), _shared(m, k))
    return _pipelined(ring_all_gather(piece, Topology(1, k), m), across, pieces)


def _direct_topology(topology: Topology) -> bool:
    return topology.hosts == 1 and topology.size <= DIRECT_MAX_RANKS


def direct_reduce_scatter(N: float, topology: Topology, m: CostModel) -> float:
    """Each rank reads its piece from the n-1 others and reduces it
    (direct_gather_scatter.cc): one host only."""
    if not _direct_topology(topology):
        return math.inf
    n = topology.size
    return (n - 1) * (m.shm_alpha + N / n * (m.shm_beta + m.gamma))


def direct_all_gather(N: float, topology: Topology, m: CostModel) -> float:
    """Each rank copies the n-1 others' pieces in one step: one host only."""
    if not _direct_topology(topology):
        return math.inf
    n = topology.size
    return m.shm_alpha + (n - 1) * N / n * m.shm_beta


def direct_broadcast(N: float, topology: Topology, m: CostModel) -> float:
    """direct_broadcast.cc, one host: from the single-copy size every peer
    reads the root at once (one copy of N), below it the root copies N into
    n-1 rings one after another; then the acknowledgement."""
    if not _direct_topology(topology):
        return math.inf
    n = topology.size
    if n <= 1:
        return 0.0
    copies = 1 if N >= SINGLE_COPY_BYTES else n - 1
    return copies * (m.shm_alpha + N * m.shm_beta) + m.shm_alpha


def one_shot_all_reduce(N: float, topology: Topology, m: CostModel) -> float:
    """mesh_all_reduce.cc: one step in which every rank sends N to each of
    its n-1 peers (on one host, its copies into n-1 rings; across hosts,
    every message leaving a host shares its link), then n-1 reductions of
    N. Any topology."""
    n = topology.size
    if n <= 1:
        return 0.0
    k = topology.ranks_per_host
    local, leaving = k - 1, k * (n - k)
    cost = m.shm_alpha + local * N * m.shm_beta if local > 0 else 0.0
    if leaving > 0:
        cost = max(cost, m.net_alpha + leaving * N * m.net_beta)
    return cost + (n - 1) * N * m.gamma


def two_shot_all_reduce(N: float, topology: Topology, m: CostModel) -> float:
    """The direct reduce-scatter, then the direct all-gather: one host. At 2
    ranks those are the ring's two messages, and cost what it costs."""
    if topology.size == 2 and _direct_topology(topology):
        return ring_all_reduce(N, topology, m)
    return direct_reduce_scatter(N, topology, m) + direct_all_gather(N, topology, m)


def _topology_algorithm(topology: Topology) -> str:
    """What the split algorithms run inside them (selection.cc's
    layoutAlgorithm): direct on one host, hierarchical over hosts of several
    ranks, else the ring."""
    if _direct_topology(topology):
        return "direct"
    return "hierarchical" if topology.hierarchical else "ring"


def _root_cost(topology: Topology, m: CostModel, nbytes: float) -> float:
    """The root (rank 0) exchanging `nbytes` with every other rank in turn."""
    k = topology.ranks_per_host
    local = min(k, topology.size) - 1
    remote = topology.size - 1 - local
    return local * (m.shm_alpha + nbytes * m.shm_beta) + remote * (
        m.net_alpha + nbytes * m.net_beta
    )


def scatter_allgather_broadcast(N: float, topology: Topology, m: CostModel) -> float:
    """split_broadcast_reduce.cc: the root sends piece p to rank p, then
    the topology's all-gather, counted twice (the root sends and receives
    inside it too; measured: bench/results/split_broadcast_reduce.txt)."""
    return _root_cost(topology, m, N / topology.size) + 2 * _FORMULAS[
        ("all_gather", _topology_algorithm(topology))
    ](N, topology, m)


def reducescatter_gather_reduce(N: float, topology: Topology, m: CostModel) -> float:
    """The topology's reduce-scatter and its sends, counted twice (it runs at
    about half the model's rate, as measured), then every rank sends its
    piece to the root."""
    n = topology.size
    sent = N * (n - 1) / n * m.shm_beta
    return 2 * (
        _FORMULAS[("reduce_scatter", _topology_algorithm(topology))](N, topology, m) + sent
    ) + _root_cost(topology, m, N / n)


def binomial_broadcast(N: float, topology: Topology, m: CostModel) -> float:
    """binomial_broadcast.cc: each rank receives from its parent (its number
    with the lowest set bit cleared, root 0), which sends to its children
    largest subtree first: the ones on its host one after another (its one
    progress thread copies them), the cross-host ones queued on its link in
    that order. Each child acknowledges with an empty message; the time is
    when the last acknowledgement lands. On one host: ceil(log2 n) copies of
    N and one acknowledgement."""
    n = topology.size
    if n <= 1:
        return 0.0
    got = [0.0] * n  # when each rank has the data
    finish = 0.0
    for v in range(1, n):
        parent = v & (v - 1)
        local = topology.host_of(parent) == topology.host_of(v)
        # The parent's children sent up to v, largest subtree first, that
        # share v's way out (the progress thread's copies, or the link).
        low = (parent & -parent) if parent else 1 << n.bit_length()
        mask, queued = 1 << n.bit_length(), 0
        while mask >= v - parent:
            child = parent + mask
            if mask < low and child < n:
                queued += (topology.host_of(child) == topology.host_of(parent)) == local
            mask >>= 1
        if local:
            got[v] = got[parent] + queued * (m.shm_alpha + N * m.shm_beta)
            ack = m.shm_alpha
        else:
            got[v] = got[parent] + m.net_alpha + queued * N * m.net_beta
            ack = m.net_alpha
        finish = max(finish, got[v] + ack)
    return finish


def binomial_reduce(N: float, topology: Topology, m: CostModel) -> float:
    """binomial_reduce.cc: ceil(log2 n) steps; in the step of `mask`, rank
    r < mask takes N from r + mask and reduces it."""
    n = topology.size
    cost, mask = 0.0, 1
    while mask < n:
        cost += _step(
            topology, m, N, lambda r, mask=mask: r + mask if r < mask and r + mask < n else None
        )
        cost += N * m.gamma
        mask <<= 1
    return cost


_FORMULAS = {
    ("all_reduce", "ring"): ring_all_reduce,
    ("all_reduce", "tree"): tree_all_reduce,
    ("all_reduce", "hierarchical"): hierarchical_all_reduce,
    ("all_reduce", "oneshot"): one_shot_all_reduce,
    ("all_reduce", "twoshot"): two_shot_all_reduce,
    ("reduce_scatter", "ring"): ring_reduce_scatter,
    ("all_gather", "ring"): ring_all_gather,
    ("reduce_scatter", "hierarchical"): hierarchical_reduce_scatter,
    ("all_gather", "hierarchical"): hierarchical_all_gather,
    ("reduce_scatter", "direct"): direct_reduce_scatter,
    ("all_gather", "direct"): direct_all_gather,
    ("broadcast", "direct"): direct_broadcast,
    ("broadcast", "scatter_allgather"): scatter_allgather_broadcast,
    ("broadcast", "tree"): binomial_broadcast,
    ("reduce", "reducescatter_gather"): reducescatter_gather_reduce,
    ("reduce", "tree"): binomial_reduce,
}


def predict(
    collective: str, algo: str, nbytes: float, topology: Topology, model: CostModel
) -> float:
    """Seconds for `collective` of `nbytes` per rank (an all-reduce's whole
    buffer; all-gather's output, reduce-scatter's input, as nccl-tests
    counts them)."""
    if algo == "auto":
        algo = choose(collective, nbytes, topology, model)
    try:
        formula = _FORMULAS[(collective, algo)]
    except KeyError:
        raise ValueError(f"no {algo!r} algorithm for {collective}") from None
    return formula(float(nbytes), topology, model)


def choose(collective: str, nbytes: float, topology: Topology, model: CostModel) -> str:
    """What CLAWCOMM_ALGO=auto picks, as the engine does: the cheapest of
    the collective's algorithms but NAMED_ONLY, ties to the later row (one
    rank's all-reduce: the tree, which returns at once)."""
    try:
        algos = ALGORITHMS[collective]
    except KeyError:
        raise ValueError(f"no collective {collective!r}: one of {', '.join(ALGORITHMS)}") from None
    if collective == "all_reduce" and topology.size <= 1:
        return "tree"
    best, best_cost = algos[0], math.inf
    for a in algos:
        if (collective, a) in NAMED_ONLY:
            continue
        c = _FORMULAS[(collective, a)](float(nbytes), topology, model)
        if c <= best_cost:
            best, best_cost = a, c
    return best
