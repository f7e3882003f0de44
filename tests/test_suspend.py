"""What a group holds in memory, and giving it back between phases of a job
(Communicator::memoryStats, suspend and resume; torch's Backend
``memory_stats``, ``suspend`` and ``resume``)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import clawcomm
from clawcomm.launch import run_ranks

KEYS = {
    "shm_ring_bytes",
    "shm_ring_resident_bytes",
    "scratch_bytes",
    "device_ipc_bytes",
    "suspended",
}


def _backend():
    return dist.group.WORLD._get_backend(torch.device("cpu"))


def _all_looked(key: str, n: int) -> None:
    """Waits, through the store, until every rank has read its stats: a rank
    that resumes may write into a suspended peer's ring at once (its pages
    then come back), which is allowed, but not what the stats are checked
    for."""
    store = dist.distributed_c10d._get_default_store()
    store.add(key, 1)
    while store.add(key, 0) < n:
        time.sleep(0.001)


def _suspend_and_resume(rank, n):
    backend = _backend()
    # n x 16 MiB: fills the rings, and the reduce-scatter's working copy.
    big = torch.ones(n * (4 << 20))
    dist.all_reduce(big)
    dist.reduce_scatter_tensor(torch.empty(big.numel() // n), big)
    busy = backend.memory_stats()
    backend.suspend()
    idle = backend.memory_stats()
    _all_looked("idle", n)
    try:
        dist.all_reduce(torch.ones(4))
        refused = "no error"
    except Exception as e:  # noqa: BLE001
        refused = str(e)
    backend.resume()
    t = torch.full((1 << 20,), float(rank))
    dist.all_reduce(t)
    ok = bool(torch.all(t == sum(range(n))))
    return busy, idle, refused, ok, backend.memory_stats()


@pytest.mark.parametrize("n", [2, 3])
def test_suspend_frees_the_rings_and_working_memory_and_resume_goes_on(n):
    for busy, idle, refused, ok, after in run_ranks(_suspend_and_resume, n, timeout=90):
        assert set(busy) == KEYS, busy
        assert busy["shm_ring_bytes"] > 0 and busy["shm_ring_resident_bytes"] > 0, busy
        assert busy["suspended"] == 0 and idle["suspended"] == 1
        assert idle["shm_ring_bytes"] == busy["shm_ring_bytes"]  # still mapped
        assert idle["shm_ring_resident_bytes"] == 0, (busy, idle)
        assert idle["scratch_bytes"] == 0, idle
        assert "suspended" in refused and "resume" in refused, refused
        assert ok
        assert after["suspended"] == 0 and after["shm_ring_resident_bytes"] > 0, after


def test_over_tcp_the_kernel_holds_the_buffers():
    def fn(rank, n):
        dist.all_reduce(torch.ones(1 << 20))
        return _backend().memory_stats()

    for stats in run_ranks(fn, 2, env={"CLAWCOMM_TRANSPORT": "tcp"}):
        assert stats["shm_ring_bytes"] == 0 and stats["shm_ring_resident_bytes"] == 0


def _engine(rank, n):
    eng = clawcomm.engine_of()
    a = np.ones(1 << 20, np.float32)
    eng.all_reduce(a)
    eng.suspend()
    stats = eng.memory_stats()
    _all_looked("engine", n)
    errors = []
    for call in (lambda: eng.all_reduce(a), lambda: eng.suspend()):
        try:
            call()
            errors.append("no error")
        except Exception as e:  # noqa: BLE001
            errors.append(str(e))
    eng.resume()
    try:
        eng.resume()
        errors.append("no error")
    except Exception as e:  # noqa: BLE001
        errors.append(str(e))
    eng.all_reduce(a)
    return stats, errors, float(a[0])


def test_engine_suspend_resume_and_their_errors():
    for stats, errors, first in run_ranks(_engine, 2):
        assert stats["suspended"] and stats["shm_ring_resident_bytes"] == 0
        assert "clawcomm::all_reduce: the group is suspended" in errors[0], errors
        assert "suspended already" in errors[1], errors
        assert "not suspended" in errors[2], errors
        assert first == 4.0
