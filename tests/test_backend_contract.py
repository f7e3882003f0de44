"""The smaller parts of torch's Backend contract that no other file covers
(docs/backend.md's table names the file of each): what the backend says it
supports, its sequence numbers, and set_timeout."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from clawcomm.launch import run_ranks


def _backend():
    return dist.group.WORLD._get_backend(torch.device("cpu"))


def _flags(rank, n):
    b = _backend()
    return (
        b.supports_splitting,
        b.supports_coalescing,
        b.supports_shrinking,
        b.supports_time_estimate,
        b.supports_tensor_alloc(torch.device("cpu")),
        b.name(),
    )


def test_what_the_backend_says_it_supports():
    for flags in run_ranks(_flags, 2):
        assert flags == (True, True, True, True, False, "clawcomm")


def _sequence(rank, n):
    b = _backend()
    seen = [b._get_sequence_number_for_group()]
    dist.all_reduce(torch.ones(3))
    seen.append(b._get_sequence_number_for_group())
    dist.broadcast(torch.ones(3), src=0)
    dist.barrier()
    seen.append(b._get_sequence_number_for_group())
    dist.send(torch.ones(1), dst=1 - rank) if rank == 0 else dist.recv(torch.ones(1), src=0)
    seen.append(b._get_sequence_number_for_group())  # sends and receives take none
    return seen


def test_collectives_are_numbered_in_issue_order_on_every_rank():
    a, b = run_ranks(_sequence, 2)
    assert a == b
    assert a[1] - a[0] == 1 and a[2] - a[1] == 2 and a[3] == a[2], a


def _timeout(rank, n):
    dist.all_reduce(torch.ones(1))
    _backend().set_timeout(datetime.timedelta(seconds=1))
    if rank == 1:
        time.sleep(4)  # never joins the all-reduce below
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        return "no error", 0.0
    except RuntimeError as e:
        return str(e), time.monotonic() - start


def test_set_timeout_bounds_the_operations_that_follow():
    results = run_ranks(_timeout, 2, pg_timeout=60, timeout=60, allow_failures=True)
    message, took = results[0]
    assert "timed out" in message, message
    assert 0.9 < took < 3.5, took
