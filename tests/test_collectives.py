"""Every collective against values computed locally, across world sizes 1-4,
both transports, both all-reduce algorithms, every dtype and reduce op, and
awkward sizes (0, 1, odd, not divisible by the world size, several MB).

Each configuration is one multi-rank run that sweeps all cases and returns
the list of mismatches, so a failure names every case that went wrong.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _cases import DTYPES, REDUCE_OPS, SIZES, check, expected_reduce, make_input, op_applies

from clawcomm.launch import run_ranks

CONFIGS = {
    "shm-ring": {"CLAWCOMM_TRANSPORT": "shm", "CLAWCOMM_ALGO": "ring"},
    "shm-tree": {"CLAWCOMM_TRANSPORT": "shm", "CLAWCOMM_ALGO": "tree"},
    "tcp-ring": {"CLAWCOMM_TRANSPORT": "tcp", "CLAWCOMM_ALGO": "ring"},
    "tcp-tree": {"CLAWCOMM_TRANSPORT": "tcp", "CLAWCOMM_ALGO": "tree"},
    # Each pair's stream striped over three sockets in 256 KiB units.
    "tcp-striped": {"CLAWCOMM_TRANSPORT": "tcp", "CLAWCOMM_SOCKETS_PER_PEER": "3"},
    # Every collective handed to the progress thread (none inline), and the
    # portable kernels instead of the CPU's best SIMD ones.
    "shm-threaded-portable": {
        "CLAWCOMM_TRANSPORT": "shm",
        "CLAWCOMM_INLINE_BYTES": "0",
        "CLAWCOMM_SIMD": "portable",
    },
    # The broadcast and reduce with the message split among the ranks,
    # whatever the size (auto takes them for large messages only).
    "shm-split": {
        "CLAWCOMM_TRANSPORT": "shm",
        "CLAWCOMM_ALGO": "broadcast:scatter_allgather,reduce:reducescatter_gather",
    },
    # Every op's direct algorithm where it has one: the broadcast's at every
    # size (auto takes it from the single-copy size, 1 MiB, on 3 ranks or
    # more), through the rings below that size.
    "shm-direct": {"CLAWCOMM_TRANSPORT": "shm", "CLAWCOMM_ALGO": "direct"},
    # The mesh all-reduces at every size: one-shot (every rank sends its
    # input to every peer and folds all of them in rank order; auto takes it
    # for small messages from 3 ranks) on both transports, and two-shot (the
    # direct reduce-scatter, then the direct all-gather; only where named).
    "shm-oneshot": {"CLAWCOMM_TRANSPORT": "shm", "CLAWCOMM_ALGO": "all_reduce:oneshot"},
    "tcp-oneshot": {"CLAWCOMM_TRANSPORT": "tcp", "CLAWCOMM_ALGO": "all_reduce:oneshot"},
    "shm-twoshot": {"CLAWCOMM_TRANSPORT": "shm", "CLAWCOMM_ALGO": "all_reduce:twoshot"},
    # Tiny rings and segments: every frame wraps around the ring and every
    # chunk is cut into many segments.
    "shm-tiny-ring": {
        "CLAWCOMM_TRANSPORT": "shm",
        "CLAWCOMM_SHM_RING_BYTES": "4096",
        "CLAWCOMM_SEGMENT_BYTES": "200",
    },
}


def all_inputs(case, ws, n, dtype, op="sum"):
    return [make_input(case, r, n, dtype, op) for r in range(ws)]


def sweep_reductions(rank, ws):
    failures = []
    for dtype in DTYPES:
        for op, redop in REDUCE_OPS.items():
            if not op_applies(dtype, op):
                continue
            for n in SIZES:
                case = f"ar/{dtype}/{op}/{n}"
                inputs = all_inputs(case, ws, n, dtype, op)
                want = expected_reduce(inputs, op)
                t = inputs[rank].clone()
                dist.all_reduce(t, redop)
                check(failures, case, t, want)

                root = n % ws
                t = inputs[rank].clone()
                dist.reduce(t, root, redop)
                check(failures, f"reduce/{case}", t, want if rank == root else inputs[rank])
        # reduce_scatter_tensor: n elements per rank.
        for n in [0, 1, 5]:
            case = f"rs/{dtype}/{n}"
            inputs = all_inputs(case, ws, n * ws, dtype)
            want = expected_reduce(inputs, "sum")[rank * n : (rank + 1) * n]
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, inputs[rank].clone())
            check(failures, case, out, want)
    return failures


def sweep_movement(rank, ws):
    failures = []
    for dtype in [torch.float32, torch.float16, torch.int64, torch.bool]:
        for n in SIZES:
            case = f"mv/{dtype}/{n}"
            inputs = all_inputs(case, ws, n, dtype)
            for root in range(ws):
                t = inputs[rank].clone()
                dist.broadcast(t, root)
                check(failures, f"broadcast/{root}/{case}", t, inputs[root])

            out = torch.empty(n * ws, dtype=dtype)
            dist.all_gather_into_tensor(out, inputs[rank])
            check(failures, f"all_gather_into_tensor/{case}", out, torch.cat(inputs))

            outs = [torch.empty(n, dtype=dtype) for _ in range(ws)]
            dist.all_gather(outs, inputs[rank])
            check(failures, f"all_gather/{case}", torch.cat(outs), torch.cat(inputs))

            root = (n + 1) % ws
            gathered = [torch.empty(n, dtype=dtype) for _ in range(ws)] if rank == root else None
            dist.gather(inputs[rank], gathered, dst=root)
            if rank == root:
                check(failures, f"gather/{case}", torch.cat(gathered), torch.cat(inputs))

            out = torch.empty(n, dtype=dtype)
            chunks = all_inputs(case + "/scatter", ws, n, dtype)
            dist.scatter(out, chunks if rank == root else None, src=root)
            check(failures, f"scatter/{case}", out, chunks[rank])

            # Even all-to-all: block j of rank i goes to rank j.
            blocks = [all_inputs(f"{case}/a2a/{src}", ws, n, dtype) for src in range(ws)]
            out = torch.empty(n * ws, dtype=dtype)
            dist.all_to_all_single(out, torch.cat(blocks[rank]))
            check(
                failures,
                f"all_to_all_single/{case}",
                out,
                torch.cat([blocks[src][rank] for src in range(ws)]),
            )

            outs = [torch.empty(n, dtype=dtype) for _ in range(ws)]
            dist.all_to_all(outs, [b.clone() for b in blocks[rank]])
            check(
                failures,
                f"all_to_all/{case}",
                torch.cat(outs),
                torch.cat([blocks[src][rank] for src in range(ws)]),
            )

    # Uneven all-to-all: rank i sends (i + j) % 3 rows of 2 to rank j (some empty).
    def rows(i, j):
        return (i + j) % 3

    send = torch.cat(
        [torch.full((rows(rank, j), 2), rank * 10 + j, dtype=torch.int32) for j in range(ws)]
    )
    out = torch.empty(sum(rows(i, rank) for i in range(ws)), 2, dtype=torch.int32)
    dist.all_to_all_single(
        out, send, [rows(i, rank) for i in range(ws)], [rows(rank, j) for j in range(ws)]
    )
    want = torch.cat(
        [torch.full((rows(i, rank), 2), i * 10 + rank, dtype=torch.int32) for i in range(ws)]
    )
    check(failures, "all_to_all_single/uneven", out, want)

    # Uneven reduce_scatter (list form): rank r's output has r + 1 elements.
    sizes = [r + 1 for r in range(ws)]
    inputs = [all_inputs(f"rs-uneven/{k}", ws, sizes[k], torch.float32) for k in range(ws)]
    out = torch.empty(sizes[rank])
    dist.reduce_scatter(out, [inputs[k][rank].clone() for k in range(ws)])
    check(failures, "reduce_scatter/uneven", out, expected_reduce(inputs[rank], "sum"))

    # Coalesced forms.
    a, b = torch.full((3,), float(rank)), torch.full((5,), float(rank * 2))
    dist.all_reduce_coalesced([a, b])
    s = float(sum(range(ws)))
    check(
        failures,
        "all_reduce_coalesced",
        torch.cat([a, b]),
        torch.cat([torch.full((3,), s), torch.full((5,), 2 * s)]),
    )
    # all_gather_coalesced: outs[r][i] receives rank r's i-th input.
    outs = [[torch.empty(2), torch.empty(3, 1)] for _ in range(ws)]
    dist.all_gather_coalesced(
        outs, [torch.full((2,), float(rank)), torch.full((3, 1), -float(rank))]
    )
    for r in range(ws):
        check(
            failures,
            "all_gather_coalesced",
            torch.cat([outs[r][0], outs[r][1].flatten()]),
            torch.tensor([r, r, -r, -r, -r], dtype=torch.float32),
        )
    outs = [torch.empty(2 * ws), torch.empty(3 * ws)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], torch.full((2,), float(rank)))
        dist.all_gather_into_tensor(outs[1], torch.full((3,), float(-rank)))
    cm.wait()
    check(
        failures,
        "all_gather_into_tensor/coalesced",
        outs[0],
        torch.arange(ws).float().repeat_interleave(2),
    )
    check(
        failures,
        "all_gather_into_tensor/coalesced",
        outs[1],
        -torch.arange(ws).float().repeat_interleave(3),
    )
    outs = [torch.empty(2), torch.empty(1)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(outs[0], torch.arange(2 * ws).float())
        dist.reduce_scatter_tensor(outs[1], torch.ones(ws))
    cm.wait()
    check(
        failures,
        "reduce_scatter_tensor/coalesced",
        outs[0],
        torch.arange(2 * ws).float()[2 * rank : 2 * rank + 2] * ws,
    )
    check(failures, "reduce_scatter_tensor/coalesced", outs[1], torch.full((1,), float(ws)))

    dist.barrier()
    return failures


def sweep_large(rank, ws):
    """Several MB, larger than a shared-memory ring, in many segments."""
    failures = []
    n = 3 * 1024 * 1024 + 5  # 12 MB of float32, not divisible by 2, 3 or 4
    g = torch.Generator().manual_seed(7)
    base = torch.randint(-4, 5, (n,), generator=g).float()
    t = base * (rank + 1)
    dist.all_reduce(t)
    check(failures, "all_reduce/12MB", t, base * (ws * (ws + 1) // 2))
    t = base * (rank + 1)
    dist.broadcast(t, ws - 1)
    check(failures, "broadcast/12MB", t, base * ws)
    t = base * (rank + 1)
    dist.reduce(t, ws - 1)
    check(
        failures,
        "reduce/12MB",
        t,
        base * (ws * (ws + 1) // 2) if rank == ws - 1 else base * (rank + 1),
    )
    out = torch.empty(n * ws)
    dist.all_gather_into_tensor(out, base + rank)
    check(failures, "all_gather/12MB", out, torch.cat([base + r for r in range(ws)]))
    whole = torch.cat([base * (r + 1) + rank for r in range(ws)])  # rank r's block: base * (r + 1)
    out = torch.empty(n)
    dist.reduce_scatter_tensor(out, whole)
    check(failures, "reduce_scatter/12MB", out, base * (rank + 1) * ws + ws * (ws - 1) // 2)
    return failures


def sweep_point_to_point(rank, ws):
    failures = []
    if ws == 1:
        return failures
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    # irecv before isend on every rank must not deadlock.
    got = torch.empty(1001)
    r = dist.irecv(got, prv, tag=3)
    s = dist.isend(torch.full((1001,), float(rank)), nxt, tag=3)
    r.wait()
    s.wait()
    check(failures, "isend/irecv ring", got, torch.full((1001,), float(prv)))
    # Tags are matched, not just order: receive tag 2 before tag 1.
    if rank == 0:
        dist.send(torch.tensor([1.0]), 1, tag=1)
        dist.send(torch.tensor([2.0]), 1, tag=2)
    elif rank == 1:
        b, a = torch.empty(1), torch.empty(1)
        dist.recv(b, 0, tag=2)
        dist.recv(a, 0, tag=1)
        check(failures, "tag order", torch.cat([a, b]), torch.tensor([1.0, 2.0]))
    # Receive from any source. Its own tag: a later phase's frames (tag 0)
    # could otherwise legally match a wildcard receive.
    if rank == 0:
        seen = set()
        for _ in range(ws - 1):
            t = torch.empty(2, dtype=torch.int64)
            src = dist.recv(t, tag=7)
            seen.add(src)
            check(failures, "recv any source", t, torch.tensor([src, src]))
        if seen != set(range(1, ws)):
            failures.append(f"recv any source saw {seen}")
    else:
        dist.send(torch.tensor([rank, rank]), 0, tag=7)
    # batch_isend_irecv (coalesced p2p) in both directions around the ring.
    a, b = torch.empty(4), torch.empty(4)
    ops = [
        dist.P2POp(dist.irecv, a, prv),
        dist.P2POp(dist.isend, torch.full((4,), rank + 0.5), nxt),
        dist.P2POp(dist.isend, torch.full((4,), rank - 0.5), prv),
        dist.P2POp(dist.irecv, b, nxt),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    check(
        failures,
        "batch_isend_irecv",
        torch.cat([a, b]),
        torch.cat([torch.full((4,), prv + 0.5), torch.full((4,), nxt - 0.5)]),
    )
    # Point-to-point interleaved with a collective issued in between.
    got = torch.empty(3)
    r = dist.irecv(got, prv)
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.send(torch.full((3,), float(rank)), nxt)
    r.wait()
    check(failures, "p2p around a collective", got, torch.full((3,), float(prv)))
    return failures


def sweep_non_contiguous(rank, ws):
    failures = []
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    t = (base + rank).t()  # transposed view
    assert not t.is_contiguous()
    dist.all_reduce(t)
    check(failures, "all_reduce/non-contiguous", t, (base * ws + sum(range(ws))).t())
    t = (base + rank)[:, ::2]
    dist.broadcast(t, 0)
    check(failures, "broadcast/non-contiguous", t, base[:, ::2])
    out = torch.empty(6, 4 * ws)[:, ::ws] if ws > 1 else torch.empty(4, 6).t()
    src = (base + rank).t()
    big = torch.empty(ws * 6, 4)
    dist.all_gather_into_tensor(big, src)
    check(
        failures,
        "all_gather_into_tensor/non-contiguous input",
        big,
        torch.cat([(base + r).t() for r in range(ws)]),
    )
    del out
    outs = [torch.empty(4, 6).t() for _ in range(ws)]
    dist.all_gather(outs, src)
    check(
        failures,
        "all_gather/non-contiguous outputs",
        torch.stack(outs),
        torch.stack([(base + r).t() for r in range(ws)]),
    )
    return failures


def sweep_subgroups(rank, ws):
    failures = []
    evens = [r for r in range(ws) if r % 2 == 0]
    odds = [r for r in range(ws) if r % 2 == 1]
    g_even = dist.new_group(evens)
    g_odd = dist.new_group(odds) if odds else None
    mine = evens if rank % 2 == 0 else odds
    group = g_even if rank % 2 == 0 else g_odd
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    check(failures, "subgroup all_reduce", t, torch.tensor([float(sum(mine))]))
    t = torch.tensor([float(rank)])
    dist.broadcast(t, group_src=len(mine) - 1, group=group)
    check(failures, "subgroup broadcast", t, torch.tensor([float(mine[-1])]))
    t = torch.tensor([1.0])
    dist.all_reduce(t)  # the world group still works after new_group
    check(failures, "world after new_group", t, torch.tensor([float(ws)]))
    return failures


SWEEPS = [
    sweep_reductions,
    sweep_movement,
    sweep_point_to_point,
    sweep_non_contiguous,
    sweep_subgroups,
]


def run_sweeps(rank, ws, sweeps):
    failures = []
    for sweep in sweeps:
        failures += [f"{sweep.__name__}: {f}" for f in sweep(rank, ws)]
    return failures


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_op_matches_local_reference(world_size, config):
    results = run_ranks(run_sweeps, world_size, SWEEPS, env=CONFIGS[config], timeout=300)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize(
    "config", ["shm-ring", "tcp-ring", "shm-tree", "tcp-striped", "shm-split", "shm-twoshot"]
)
@pytest.mark.parametrize("world_size", [2, 3])
def test_large_messages(world_size, config):
    results = run_ranks(run_sweeps, world_size, [sweep_large], env=CONFIGS[config], timeout=300)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)


def test_mixed_transports_two_hosts_of_two_ranks():
    """What a two-host job does: shm inside each host, TCP across."""
    hosts = [{"CLAWCOMM_HOST_ID": h} for h in ("host-a", "host-a", "host-b", "host-b")]
    transports = run_ranks(_transports, 4, rank_env=hosts)
    assert transports[0][0] == ["self", "shm", "tcp", "tcp"]
    assert transports[3][0] == ["tcp", "tcp", "shm", "self"]
    sweeps = [sweep_reductions, sweep_movement, sweep_point_to_point, sweep_large]
    results = run_ranks(run_sweeps, 4, sweeps, rank_env=hosts, timeout=300)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:40])


def _hosts(*layout):
    """rank_env for ranks on fake hosts: _hosts(2, 2) is two hosts of two."""
    return [{"CLAWCOMM_HOST_ID": f"host-{h}"} for h, k in enumerate(layout) for _ in range(k)]


@pytest.mark.parametrize("layout", [(2, 2), (3, 3), (2, 2, 2)])
def test_hierarchical_all_reduce(layout):
    """Shared memory inside each (fake) host, TCP across, every reduce op
    and dtype, sizes from 0 to several MB (pipelined in pieces); the
    reduce-scatter and all-gather of the sweeps run hierarchical too."""
    ranks = _hosts(*layout)
    env = {"CLAWCOMM_ALGO": "hierarchical"}
    results = run_ranks(_transports, len(ranks), rank_env=ranks, env=env)
    assert {r[1] for r in results} == {"hierarchical"}
    # Reduce-scatter and all-gather go hierarchical too (rs/ and ag/ cases).
    sweeps = [sweep_reductions, sweep_movement, sweep_large]
    results = run_ranks(run_sweeps, len(ranks), sweeps, rank_env=ranks, env=env, timeout=300)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("layout", [(2, 2), (2, 1)])
def test_split_broadcast_and_reduce_across_hosts(layout):
    """The split broadcast and reduce over fake hosts: their all-gather and
    reduce-scatter inside run hierarchical (2 x 2) or on the ring (2 + 1)."""
    ranks = _hosts(*layout)
    env = {"CLAWCOMM_ALGO": "broadcast:scatter_allgather,reduce:reducescatter_gather"}
    sweeps = [sweep_reductions, sweep_movement, sweep_large]
    results = run_ranks(run_sweeps, len(ranks), sweeps, rank_env=ranks, env=env, timeout=300)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:40])


def test_hierarchical_falls_back_to_the_ring_on_uneven_hosts():
    ranks = _hosts(2, 1)
    results = run_ranks(_transports, 3, rank_env=ranks, env={"CLAWCOMM_ALGO": "hierarchical"})
    assert {r[1] for r in results} == {"ring"}
    results = run_ranks(run_sweeps, 3, [sweep_large], rank_env=ranks, timeout=300)
    assert not any(results)


def test_auto_picks_hierarchical_for_large_buffers_across_hosts():
    def algos(rank, ws):
        from clawcomm import backend_of

        return [backend_of().all_reduce_algorithm(b) for b in (8, 64 << 20)]

    # Small ones: the one-shot mesh, one round of messages to every peer.
    assert run_ranks(algos, 4, rank_env=_hosts(2, 2))[0] == ["oneshot", "hierarchical"]
    assert run_ranks(algos, 4)[0] == ["oneshot", "ring"]  # one host


def test_sparse_shared_memory_peers():
    """CLAWCOMM_SHM_PEERS=sparse on one host of 6 ranks: rings only for the
    pairs the reducing collectives use (ring and recursive-doubling
    partners), TCP over loopback for the rest, and every collective still
    right (all-to-all, broadcasts from every root, point-to-point)."""
    env = {"CLAWCOMM_SHM_PEERS": "sparse"}
    transports = run_ranks(_transports, 6, env=env)
    for rank, (kinds, _) in enumerate(transports):
        shm = {p for p, k in enumerate(kinds) if k == "shm"}
        assert {(rank + 1) % 6, (rank - 1) % 6} <= shm, (rank, kinds)
        assert "tcp" in kinds, (rank, kinds)  # some pair left out
    assert transports[0][0] == ["self", "shm", "tcp", "tcp", "tcp", "shm"]
    sweeps = [sweep_reductions, sweep_movement, sweep_point_to_point, sweep_large]
    results = run_ranks(run_sweeps, 6, sweeps, env=env, timeout=300)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:40])


def _transports(rank, ws):
    from clawcomm import backend_of

    backend = backend_of()
    return [backend.transport_of(p) for p in range(ws)], backend.all_reduce_algorithm(8)


def test_auto_transport_is_shm_on_one_host():
    results = run_ranks(_transports, 3)
    assert results[0][0] == ["self", "shm", "shm"]
    assert results[2][0] == ["shm", "shm", "self"]


def test_transport_override():
    results = run_ranks(_transports, 2, env={"CLAWCOMM_TRANSPORT": "tcp"})
    assert results[0][0] == ["self", "tcp"]


def test_auto_algorithm_uses_the_mesh_for_small_messages():
    # From 3 ranks one step of messages to every peer beats recursive
    # doubling's log2 n steps; at 2 the two are the same exchange.
    results = run_ranks(_transports, 4, env={"CLAWCOMM_ALGO": "auto"})
    assert results[0][1] == "oneshot"
    results = run_ranks(_transports, 2, env={"CLAWCOMM_ALGO": "auto"})
    assert results[0][1] == "tree"
