"""Groups split from others (Communicator::split, csrc/comm/split.cc): the
engine's split by color and key, and torch's split_group through the backend,
checked against values computed locally and against the same collectives on
a group made by ``dist.new_group`` (a rendezvous over the store)."""

from __future__ import annotations

import copy
import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _cases import check, make_input

import clawcomm
from clawcomm.launch import RankFailure, run_ranks


def _engine_split(rank, n):
    """Colors rank % 3 (the last rank of 5 joins none), keys reversed: each
    new engine runs its collectives while the others run theirs."""
    eng = clawcomm.engine_of()
    color = -1 if (n == 5 and rank == n - 1) else rank % 3
    child = eng.split(color, key=-rank)
    if color < 0:
        assert child is None
        eng.all_reduce(np.ones(3, np.float64))  # the parent's last collective, as the others
        return []
    members = sorted(
        (p for p in range(n) if p % 3 == color and not (n == 5 and p == n - 1)), reverse=True
    )
    problems = []
    if (child.rank, child.size) != (members.index(rank), len(members)):
        problems.append(f"rank {rank}: ({child.rank}, {child.size}), want index in {members}")
    k = len(members)
    for count in (0, 1, 7, 1000, 100_003):
        ins = {p: ((np.arange(count) * 3 + p * 5) % 17).astype(np.float32) for p in members}
        buf = ins[rank].copy()
        child.all_reduce(buf)
        if not np.array_equal(buf, sum(ins[p] for p in members)):
            problems.append(f"all_reduce {count}")
        out = np.empty(count * k, np.float32)
        child.all_gather(ins[rank], out)
        if not np.array_equal(out, np.concatenate([ins[p] for p in members])):
            problems.append(f"all_gather {count}")
        buf = ins[rank].copy()
        child.broadcast(buf, root=k - 1)
        if not np.array_equal(buf, ins[members[-1]]):
            problems.append(f"broadcast {count}")
    if k > 1:
        got = np.empty(4, np.uint8)
        child.sendrecv(np.full(4, rank, np.uint8), (child.rank + 1) % k, got, (child.rank - 1) % k)
        if got[0] != members[(child.rank - 1) % k]:
            problems.append(f"sendrecv: {got[0]}")
    # A split of a split, and the parent after both.
    grand = child.split(0, key=child.rank)
    buf = np.ones(3, np.float64)
    grand.all_reduce(buf)
    if buf[0] != k:
        problems.append(f"split of a split: {buf[0]}")
    buf = np.ones(3, np.float64)
    eng.all_reduce(buf)
    if buf[0] != n:
        problems.append(f"parent after split: {buf[0]}")
    return problems


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_engine_split_by_color_and_key(world_size):
    assert run_ranks(_engine_split, world_size) == [[]] * world_size


def _crossing(rank, n):
    """Two splits used at once, issued in crossing orders: rank 0 and 3 go
    row then column, rank 1 and 2 column then row. On one progress thread
    per parent this would be a cycle; each group progresses on its own."""
    eng = clawcomm.engine_of()
    row = eng.split(rank // 2)
    col = eng.split(rank % 2)
    a = torch.full((50_000,), float(rank))
    b = torch.full((50_000,), float(10 * rank))
    backend_row = clawcomm.split_group([[0, 1], [2, 3]])
    backend_col = clawcomm.split_group([[0, 2], [1, 3]])
    first, second = (backend_row, backend_col) if rank in (0, 3) else (backend_col, backend_row)
    w1 = dist.all_reduce(a if first is backend_row else b, group=first, async_op=True)
    w2 = dist.all_reduce(b if first is backend_row else a, group=second, async_op=True)
    w1.wait()
    w2.wait()
    x = np.ones(2, np.float32)
    row.all_reduce(x)
    col.all_reduce(x)
    return a[0].item(), b[0].item(), float(x[0])


def test_groups_split_from_one_parent_progress_independently():
    got = run_ranks(_crossing, 4)
    for rank, (a, b, x) in enumerate(got):
        row = [r for r in range(4) if r // 2 == rank // 2]
        col = [r for r in range(4) if r % 2 == rank % 2]
        assert a == sum(row), (rank, a)
        assert b == 10 * sum(col), (rank, b)
        assert x == 4.0


def _every_collective(group, mine, rank, case):
    """Every torch collective on `group` (ranks `mine` of the world), its
    results in a list, in one order."""
    k = len(mine)
    me = mine.index(rank)
    out = []
    x = make_input(case, rank, 13, torch.float32)
    t = x.clone()
    dist.all_reduce(t, group=group)
    out.append(t)
    t = x.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    out.append(t)
    t = x.clone()
    dist.broadcast(t, group_src=k - 1, group=group)
    out.append(t)
    t = x.clone()
    dist.reduce(t, group_dst=0, group=group)
    out.append(t if me == 0 else x)
    outs = [torch.empty(13) for _ in range(k)]
    dist.all_gather(outs, x, group=group)
    out += outs
    flat = torch.empty(13 * k)
    dist.all_gather_into_tensor(flat, x, group=group)
    out.append(flat)
    big = make_input(case + "rs", rank, 7 * k, torch.float32)
    t = torch.empty(7)
    dist.reduce_scatter_tensor(t, big, group=group)
    out.append(t)
    t = torch.empty(7)
    dist.reduce_scatter(t, list(big.chunk(k)), group=group)
    out.append(t)
    t = torch.empty(7 * k)
    dist.all_to_all_single(t, big, group=group)
    out.append(t)
    outs = [torch.empty(7) for _ in range(k)]
    dist.all_to_all(outs, list(big.chunk(k)), group=group)
    out += outs
    gathered = [torch.empty(13) for _ in range(k)] if me == 0 else None
    dist.gather(x, gathered, group_dst=0, group=group)
    out += gathered or []
    t = torch.empty(7)
    dist.scatter(t, list(big.chunk(k)) if me == k - 1 else None, group_src=k - 1, group=group)
    out.append(t)
    dist.barrier(group=group)
    if k > 1:
        t = torch.empty(13)
        ops = [
            dist.P2POp(dist.isend, x, group=group, group_peer=(me + 1) % k),
            dist.P2POp(dist.irecv, t, group=group, group_peer=(me - 1) % k),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out.append(t)
    return out


def _against_new_group(rank, n):
    """The same collectives on a split group and on new_group's, with the
    same inputs: equal results, and all_reduce equal to the local sum."""
    layouts = {4: [[0, 2], [1, 3]], 5: [[4, 0, 2], [1], [3]], 3: [[0, 1, 2]]}[n]
    failures = []
    split = clawcomm.split_group(layouts)
    mine = next(sorted(g) for g in layouts if rank in g)
    made = [dist.new_group(sorted(g)) for g in layouts]
    reference = made[next(i for i, g in enumerate(layouts) if rank in g)]
    assert dist.get_world_size(split) == len(mine)
    assert dist.get_rank(split) == mine.index(rank)
    assert dist.get_process_group_ranks(split) == mine
    got = _every_collective(split, mine, rank, "split")
    want = _every_collective(reference, mine, rank, "split")
    if len(got) != len(want):
        return [f"{len(got)} results against {len(want)}"]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        check(failures, f"result {i}", g, w)
    total = sum(make_input("split", p, 13, torch.float32) for p in mine)
    check(failures, "all_reduce against the local sum", got[0], total)
    return failures


@pytest.mark.parametrize("world_size", [3, 4, 5])
def test_torch_split_group_matches_new_group_for_every_collective(world_size):
    assert run_ranks(_against_new_group, world_size) == [[]] * world_size


def _nonmember(rank, n):
    child = clawcomm.split_group([[0, 1]])
    if child is None:
        return None
    t = torch.ones(3)
    dist.all_reduce(t, group=child)
    return t[0].item()


def test_a_rank_in_no_list_gets_none():
    assert run_ranks(_nonmember, 3) == [2.0, 2.0, None]


def _mismatch(rank, n):
    # Ranks 0 and 1 name [0, 1]; rank 2 names [1, 2]: by the lists' colors
    # rank 2 would be alone. torch's ProcessGroup.split_group, unchecked.
    mine = [1, 2] if rank == 2 else [0, 1]
    dist.group.WORLD.split_group(mine, timeout=datetime.timedelta(seconds=20))


def test_ranks_that_disagree_fail_on_every_rank():
    got = run_ranks(_mismatch, 3, allow_failures=True, timeout=60)
    why = "was to join ranks [1, 2] but its color (1) and key (1) put it with [2]"
    for rank, r in enumerate(got):
        assert isinstance(r, RankFailure)
        assert why in str(r), str(r)
        # Rank 2 raises its own ValueError; the others learn why from it.
        if rank < 2:
            assert "split: rank 2 could not set up its endpoints" in str(r), str(r)
        else:
            assert "ValueError" in str(r), str(r)


def _bad_color(rank, n):
    with pytest.raises(ValueError, match="split: color -5 is negative"):
        clawcomm.engine_of().split(-5)
    with pytest.raises(ValueError, match="an empty group"):
        clawcomm.split_group([[0], []])
    with pytest.raises(ValueError, match="in one list only"):
        clawcomm.split_group([[0, 1], [1]])
    # Nothing was sent: the world still lines up.
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_bad_arguments_fail_before_any_byte():
    assert run_ranks(_bad_color, 2) == [2.0, 2.0]


def _options(rank, n):
    opts = clawcomm.backend_of().options
    copied = copy.deepcopy(opts)
    return copied.backend, copied._timeout.total_seconds()


def test_the_backend_options_can_be_copied():
    # torch's split_group deep-copies them when it is given none.
    assert run_ranks(_options, 1, pg_timeout=42) == [("clawcomm", 42.0)]


HAVE_GPU = torch.backends.cuda.is_built() and torch.cuda.device_count() > 0


def _torch_split_group_on_cuda(rank, n, path):
    # torch's own split_group, which wants the default group bound to a
    # device (init_process_group(device_id=...)) and an accelerator.
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "clawcomm", init_method=f"file://{path}", rank=rank, world_size=n, device_id=dev
    )
    try:
        group = dist.split_group(split_ranks=[[0, 2], [1]])
        mine = [0, 2] if rank != 1 else [1]
        on_gpu = torch.full((100_000,), float(rank), device=dev)
        dist.all_reduce(on_gpu, group=group)
        on_cpu = torch.full((5,), float(rank))
        dist.all_reduce(on_cpu, group=group)
        assert dist.get_process_group_ranks(group) == mine
        return on_gpu[0].item(), on_cpu[0].item(), float(sum(mine))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA GPU (CUDA tests run on the GPU machine)")
def test_torch_split_group_on_cuda(tmp_path):
    got = run_ranks(_torch_split_group_on_cuda, 3, str(tmp_path / "store"), init=False)
    for on_gpu, on_cpu, want in got:
        assert on_gpu == on_cpu == want
