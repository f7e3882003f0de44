"""What a CUDA IPC call tells its caller, on a GPU (marker ``gpu``; skips
without one): torch.profiler spans, ``wait(timeout)``, the order of a
synchronous and an asynchronous call, ranks that call different
collectives, and the IPC buffers' bytes. The same protocol is tested on the
CPU over the host runtime (tests/test_device_streams.py); these check the
adapter's side (csrc/torch/device_path.h) and the CUDA runtime's.

Rank r runs on ``cuda:{r % device_count}``: on a one-GPU machine every rank
shares the GPU (under MPS, as bench/gpu_check.sh runs them).
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from clawcomm.launch import run_ranks

HAVE_GPU = torch.backends.cuda.is_built() and torch.cuda.device_count() > 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_GPU, reason="no CUDA GPU (CUDA tests run on the GPU machine)"),
]

N = 1 << 16  # float32 elements: 256 KiB, through CUDA IPC


def _device(rank):
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _late(seconds):
    """A side stream busy for about `seconds`: a call issued from it starts late."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(seconds * 1.5e9))  # cycles, at about 1.5 GHz
    return side


def _spans(rank, ws):
    from torch.profiler import ProfilerActivity, profile

    dev = _device(rank)
    x = torch.ones(N, device=dev)
    dist.all_reduce(x)  # sets the IPC group up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(x)
        dist.all_reduce(x, async_op=True).wait()
        dist.broadcast(x, 0)
    torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    backend = dist.group.WORLD._get_backend(dev)
    return (
        names.count("clawcomm:allreduce"),
        names.count("clawcomm:broadcast"),
        str(backend.cuda_ipc_status()),
    )


def test_ipc_calls_make_the_cpu_paths_profiler_spans():
    for allreduce, broadcast, status in run_ranks(_spans, 2):
        assert "ok" in status, status
        assert allreduce >= 2 and broadcast >= 1, (allreduce, broadcast)


def _async_then_sync(rank, ws):
    dev = _device(rank)
    a = torch.full((N,), rank + 1.0, device=dev)
    b = torch.full((N,), 10.0 * (rank + 1), device=dev)
    dist.all_reduce(torch.zeros(4, device=dev))
    side = _late(0.05) if rank == 0 else torch.cuda.Stream()
    with torch.cuda.stream(side):
        work = dist.all_reduce(a, async_op=True)  # rank 0's waits for the busy side stream
    dist.all_reduce(b)  # the default stream: must not overtake rank 0's `a`
    work.wait()
    torch.cuda.synchronize()
    return a[0].item(), b[0].item()


def test_a_synchronous_call_waits_for_an_unwaited_asynchronous_one():
    for a, b in run_ranks(_async_then_sync, 2):
        assert (a, b) == (3.0, 30.0)


def _timed_wait(rank, ws):
    dev = _device(rank)
    a = torch.full((N,), rank + 1.0, device=dev)
    dist.all_reduce(torch.zeros(4, device=dev))
    side = _late(2.0) if rank == 0 else torch.cuda.Stream()
    with torch.cuda.stream(side):
        work = dist.all_reduce(a, async_op=True)
    start = time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(milliseconds=200))
        first = ("returned", time.monotonic() - start)
    except Exception as e:  # noqa: BLE001
        first = (str(e)[:120], time.monotonic() - start)
    work.wait()
    torch.cuda.synchronize()
    return first, a[0].item()


def test_wait_with_a_timeout_gives_up_on_the_device_path():
    (first, a), (_, a1) = run_ranks(_timed_wait, 2)
    assert "timed out after 200 ms" in first[0] and first[1] < 1.5, first
    assert a == a1 == 3.0


def _mismatch(rank, ws):
    dev = _device(rank)
    x = torch.ones(N, device=dev)
    dist.all_reduce(torch.zeros(4, device=dev))
    try:
        if rank == 0:
            dist.all_reduce(x)
        else:
            dist.broadcast(x, 0)
        torch.cuda.synchronize()
        return "returned"
    except Exception as e:  # noqa: BLE001
        return str(e)[:400]


def test_different_collectives_of_one_size_fail_on_every_rank_naming_both():
    got = run_ranks(_mismatch, 2, pg_timeout=20)
    for rank, text in enumerate(got):
        assert "all_reduce" in text and "broadcast" in text and " called " in text, (rank, text)


def _memory(rank, ws):
    import clawcomm

    dev = _device(rank)
    engine = clawcomm.engine_of(None, "cuda")
    before = engine.memory_stats()["device_ipc_bytes"]
    dist.all_reduce(torch.ones(N, device=dev))
    return before, engine.memory_stats()["device_ipc_bytes"]


def test_the_ipc_buffer_is_counted():
    for before, after in run_ranks(_memory, 2):
        assert before == 0 and after > 2 * (64 << 20), (before, after)
