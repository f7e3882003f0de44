"""Each algorithm's closed form: seconds for a collective of N bytes per
rank on a topology, as docs/algorithms.md derives it (and
``csrc/algorithms/costs.cc`` computes it for the engine's own choices)."""

from __future__ import annotations

import math

from clawcomm.cost_model.parameters import CostModel, Topology

# Mirrors csrc/algorithms/algorithms.h.
PIECE_BYTES = 4 << 20
MAX_PIECES = 16

# Mirrors csrc/algorithms/algorithms.h: direct algorithms run on one host of
# at most this many ranks.
DIRECT_MAX_RANKS = 16

# Mirrors csrc/common/settings.h: frames of at least this many bytes go by
# single copy (CLAWCOMM_SINGLE_COPY_BYTES's default).
SINGLE_COPY_BYTES = 1 << 20


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


def pairwise_all_to_all(N: float, topology: Topology, m: CostModel) -> float:
    """pairwise_all_to_all.cc: each rank posts its n-1 sends of N/n at once
    and then waits. Inside a host they go one after another through the
    rank's channel; the k ranks of a host send k (n-k) of them over its
    link together."""
    n, k = topology.size, topology.ranks_per_host
    if n <= 1:
        return 0.0
    local = m.shm_alpha + (k - 1) * N / n * m.shm_beta if k > 1 else 0.0
    if topology.hosts == 1:
        return local
    return max(local, m.net_alpha + k * (n - k) * N / n * m.net_beta)


def hierarchical_all_to_all(N: float, topology: Topology, m: CostModel) -> float:
    """hierarchical_all_to_all.cc, on m >= 2 hosts of k >= 2 ranks: three
    steps one after the other. The sizes inside the host (one small
    message); the shuffle, each rank's (k-1) m blocks of N/n one after
    another through its channel; then k (m-1) messages of k blocks leave
    each host together: the pairwise all-to-all's bytes on each link, in
    fewer messages, which this model (one alpha per step) does not price."""
    if not topology.hierarchical:
        return math.inf
    k, hosts = topology.ranks_per_host, topology.hosts
    block = N / topology.size
    shuffle = m.shm_alpha + (k - 1) * hosts * block * m.shm_beta
    across = m.net_alpha + k * (hosts - 1) * k * block * m.net_beta
    return m.shm_alpha + shuffle + across


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
    ("all_to_all", "pairwise"): pairwise_all_to_all,
    ("all_to_all", "hierarchical"): hierarchical_all_to_all,
}
