"""Shrinking a group (Communicator::shrink, csrc/comm/shrink.cc): torch's
``dist.shrink_group`` and the engine's ``Engine.shrink`` drop ranks that are
alive, dead (SIGKILL) or stuck in a collective, and the survivors go on in a
group of their own, checked against values computed locally."""

from __future__ import annotations

import glob
import os
import signal
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import SHRINK_ABORT

import clawcomm
from clawcomm.launch import RankFailure, run_ranks

TRANSPORTS = [{"CLAWCOMM_TRANSPORT": "shm"}, {"CLAWCOMM_TRANSPORT": "tcp"}]


def _segments() -> set[str]:
    return set(glob.glob("/dev/shm/clawcomm*"))


def _check_group(group, members: list[int], rank: int) -> list[str]:
    """Collectives on the shrunk group against local values: every member
    contributes its old rank."""
    problems = []
    n = len(members)
    if (group.size(), group.rank()) != (n, members.index(rank)):
        got = (group.size(), group.rank())
        problems.append(f"size/rank {got}, want {(n, members.index(rank))}")
    if dist.get_process_group_ranks(group) != members:
        problems.append(f"global ranks {dist.get_process_group_ranks(group)}, want {members}")
    for count in (1, 1000, 300_001):
        t = torch.full((count,), float(rank + 1))
        dist.all_reduce(t, group=group)
        if not torch.equal(t, torch.full((count,), float(sum(m + 1 for m in members)))):
            problems.append(f"all_reduce of {count}: {t[:3].tolist()}")
        out = torch.empty(count * n)
        dist.all_gather_single(out, torch.full((count,), float(rank)), group=group)
        want = torch.cat([torch.full((count,), float(m)) for m in members])
        if not torch.equal(out, want):
            problems.append(f"all_gather of {count}")
    t = torch.tensor([float(rank)])
    dist.broadcast(t, group_src=n - 1, group=group)
    if t.item() != members[-1]:
        problems.append(f"broadcast: {t.item()}")
    return problems


# --- torch's shrink_group -----------------------------------------------------


def _shrink_live(rank, n, drop):
    dist.all_reduce(torch.ones(10))
    if rank in drop:
        return "excluded"
    group = dist.shrink_group(drop)
    members = [r for r in range(n) if r not in drop]
    problems = _check_group(group, members, rank)
    if dist.group.WORLD is not group:
        problems.append("the shrunk default group is not the new default")
    if group._get_backend(torch.device("cpu")).name() != "clawcomm":
        problems.append(f"backend {group._get_backend(torch.device('cpu')).name()}")
    return problems


@pytest.mark.parametrize("env", TRANSPORTS, ids=["shm", "tcp"])
@pytest.mark.parametrize(("n", "drop"), [(2, [1]), (4, [1]), (4, [0, 3]), (5, [2])])
def test_shrink_group_drops_live_ranks(n, drop, env):
    results = run_ranks(_shrink_live, n, drop, env=env, timeout=90)
    for r in range(n):
        assert results[r] == ("excluded" if r in drop else []), (r, results[r])


def _shrink_dead(rank, n):
    dist.all_reduce(torch.ones(1000))
    dist.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    start = time.monotonic()
    group = dist.shrink_group([2])
    took = time.monotonic() - start
    problems = _check_group(group, [r for r in range(n) if r != 2], rank)
    dist.destroy_process_group()
    return problems, took


@pytest.mark.parametrize("env", TRANSPORTS, ids=["shm", "tcp"])
def test_shrink_group_drops_a_dead_rank_and_leaves_no_shared_memory(env):
    before = _segments()
    results = run_ranks(_shrink_dead, 4, env=env, pg_timeout=20, timeout=90, allow_failures=True)
    assert isinstance(results[2], RankFailure)
    for r in (0, 1, 3):
        problems, took = results[r]
        assert problems == [], (r, problems)
        assert took < 10, f"rank {r}: shrink took {took:.1f} s"
    assert _segments() <= before


def _shrink_stuck(rank, n):
    """Rank 3 never joins the survivors' all-reduce: they are stuck in it,
    and SHRINK_ABORT ends it with an error before the new group forms."""
    dist.all_reduce(torch.ones(10))
    if rank == 3:
        time.sleep(4)
        return "excluded"
    pending = dist.all_reduce(torch.ones(1 << 20), async_op=True)
    time.sleep(0.3)
    start = time.monotonic()
    group = dist.shrink_group([3], shrink_flags=SHRINK_ABORT)
    took = time.monotonic() - start
    try:
        pending.wait()
        error = "no error"
    except Exception as e:  # noqa: BLE001
        error = str(e)
    return _check_group(group, [0, 1, 2], rank), error, took


@pytest.mark.parametrize("env", TRANSPORTS, ids=["shm", "tcp"])
def test_shrink_abort_ends_a_collective_stuck_on_the_excluded_rank(env):
    results = run_ranks(_shrink_stuck, 4, env=env, pg_timeout=30, timeout=90, allow_failures=True)
    for r in (0, 1, 2):
        problems, error, took = results[r]
        assert problems == [], (r, problems)
        assert "abort" in error and "shrink" in error, (r, error)
        assert took < 10, f"rank {r}: shrink took {took:.1f} s"


def _shrink_subgroup(rank, n):
    sub = dist.new_group([0, 1, 2, 3])
    other = dist.new_group([3, 4])
    if rank in (0, 1, 2, 3):
        dist.all_reduce(torch.ones(4), group=sub)
    problems = []
    if rank in (0, 2, 3):
        shrunk = dist.shrink_group([1], group=sub)
        problems += _check_group(shrunk, [0, 2, 3], rank)
    # The default group and another subgroup go on untouched.
    t = torch.ones(3)
    dist.all_reduce(t)
    if t[0] != n:
        problems.append(f"world after shrink: {t[0]}")
    if rank in (3, 4):
        t = torch.ones(3)
        dist.all_reduce(t, group=other)
        if t[0] != 2:
            problems.append(f"other subgroup: {t[0]}")
    return problems


def test_shrink_a_subgroup_leaves_the_others_alone():
    assert run_ranks(_shrink_subgroup, 5, timeout=90) == [[]] * 5


def _shrink_twice(rank, n):
    if rank == 3:
        return []
    g = dist.shrink_group([3])
    if rank == 1:
        return []
    g = dist.shrink_group([1], group=g)  # group ranks: old ranks 0, 1, 2 -> drop old 1
    return _check_group(g, [0, 2], rank)


def test_a_shrunk_group_shrinks_again():
    assert run_ranks(_shrink_twice, 4, timeout=90) == [[]] * 4


def test_the_backend_says_it_shrinks():
    def fn(rank, n):
        return dist.group.WORLD._get_backend(torch.device("cpu")).supports_shrinking

    assert run_ranks(fn, 2) == [True, True]


# --- the engine's shrink ------------------------------------------------------


def _engine_shrink(rank, n):
    eng = clawcomm.engine_of()
    if rank == 1:
        return []
    child = eng.shrink([1])
    members = [0, 2, 3]
    problems = []
    if (child.rank, child.size) != (members.index(rank), 3):
        problems.append(f"({child.rank}, {child.size})")
    buf = np.full(100_003, rank + 1, np.float32)
    child.all_reduce(buf)
    if not np.all(buf == sum(m + 1 for m in members)):
        problems.append(f"all_reduce {buf[:3]}")
    got = np.empty(4, np.int32)
    child.sendrecv(np.full(4, rank, np.int32), (child.rank + 1) % 3, got, (child.rank - 1) % 3)
    if got[0] != members[(child.rank - 1) % 3]:
        problems.append(f"sendrecv {got[0]}")
    return problems


def test_engine_shrink():
    assert run_ranks(_engine_shrink, 4, timeout=60) == [[]] * 4


def _bad_shrinks(rank, n):
    eng = clawcomm.engine_of()
    errors = []
    for excluded in ([], [rank], [5], [-1], [1 - rank, 1 - rank]):
        try:
            eng.shrink(excluded)
            errors.append("no error")
        except Exception as e:  # noqa: BLE001
            errors.append(str(e))
    # Nothing was sent: the group still works.
    buf = np.ones(3, np.float32)
    eng.all_reduce(buf)
    return errors, float(buf[0])


def test_bad_shrinks_are_refused_before_anything_is_sent():
    for errors, total in run_ranks(_bad_shrinks, 2):
        assert total == 2.0
        assert "no rank to exclude" in errors[0]
        assert "among those excluded" in errors[1]
        assert "rank 5 is not in this group of 2" in errors[2]
        assert "rank -1 is not in this group" in errors[3]
        assert "excluded twice" in errors[4]
        assert all(e.startswith("clawcomm: shrink:") for e in errors), errors


def test_an_excluded_rank_that_calls_shrink_group_is_refused_by_torch():
    def fn(rank, n):
        try:
            dist.shrink_group([rank])
            return "no error"
        except RuntimeError as e:
            return str(e)

    for message in run_ranks(fn, 2):
        assert "exclusion list" in message
