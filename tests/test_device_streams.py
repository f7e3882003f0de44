"""The CUDA IPC path's calls across streams, and what a call tells its
caller, on the CPU: device/device_comm.h over the host runtime, whose
streams run their calls in order and, while held (``HostDeviceComm.hold``,
a busy GPU's stream), queue them, so two streams are ordered only by the
waits the code makes, as on a GPU.

- A synchronous call (on the caller's stream) and an asynchronous one (on
  the communicator's) share the ranks' epoch counters and IPC areas: each
  must wait for the one before, whichever stream it ran on.
- Ranks that call different collectives of the same size raise an error
  naming both calls on every rank, as the CPU path does.
- ``wait(timeout)`` gives up after the timeout.
- The IPC buffer's bytes are counted by the engine (``memory_stats``),
  which the trainer's ``max_memory_mb`` adds in.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import clawcomm
from clawcomm import _C
from clawcomm.launch import run_ranks
from clawcomm.train.metrics import RankSample, check_memory, comm_device_bytes

N = 1000  # float32 elements: 4000 bytes, one-shot at 2 ranks
HOLD_MS = 400


def _dev(rank):
    return _C.HostDeviceComm(clawcomm.engine_of(), device=rank)


def _async_then_sync(rank, ws):
    dev = _dev(rank)
    a = np.full(N, rank + 1.0, np.float32)
    b = np.full(N, 10.0 * (rank + 1), np.float32)
    dev.all_reduce(np.zeros(4, np.float32))  # sets the group up
    if rank == 0:
        dev.hold("comm", HOLD_MS)  # rank 0's stream is busy: its async call runs late
    work = dev.all_reduce(a, async_op=True)
    dev.all_reduce(b)  # on the caller's stream: must not overtake `a`
    work.wait()
    dev.close()
    return float(a[0]), float(b[0])


def test_a_synchronous_call_waits_for_the_asynchronous_one_before_it():
    """Rank 0's communicator stream is held: its asynchronous all-reduce
    runs late. Its synchronous all-reduce after it, on the caller's stream,
    used to run at once and pair with rank 1's asynchronous one (same size:
    wrong sums, silently)."""
    for a, b in run_ranks(_async_then_sync, 2, timeout=90):
        assert (a, b) == (3.0, 30.0)


def _sync_then_async(rank, ws):
    dev = _dev(rank)
    a = np.full(N, rank + 1.0, np.float32)
    b = np.full(N, 10.0 * (rank + 1), np.float32)
    dev.all_reduce(np.zeros(4, np.float32))
    dev.stream = 1
    if rank == 0:
        dev.hold("caller", HOLD_MS)  # the caller's stream 1 is busy
    first = dev.all_reduce(b, async_op=False)  # on stream 1, not waited for (as torch's)
    dev.stream = 2  # the caller moves to another stream
    second = dev.all_reduce(a, async_op=True)  # on the communicator's, after stream 2
    second.wait()
    first.wait()
    dev.close()
    return float(a[0]), float(b[0])


def test_an_asynchronous_call_waits_for_the_synchronous_one_before_it_on_another_stream():
    """The other way round: a synchronous call queued on a busy stream, then
    an asynchronous one issued from another stream (whose wait for the
    caller's stream covers nothing)."""
    for a, b in run_ranks(_sync_then_async, 2, timeout=90):
        assert (a, b) == (3.0, 30.0)


def _zero3_pattern(rank, ws):
    # ZeRO-3 on CUDA: the parameter units' all-gathers are asynchronous (on
    # the communicator's stream) and a compressed reducer's reduce-scatters
    # synchronous (on the caller's), on one group.
    dev = _dev(rank)
    n = ws
    dev.all_reduce(np.zeros(4, np.float32))
    if rank == 0:
        dev.hold("comm", HOLD_MS)
    gathers = []
    for unit in range(3):
        shard = np.full(N, 100.0 * unit + rank, np.float32)
        full = np.zeros(N * n, np.float32)
        gathers.append((dev.all_gather(shard, full, async_op=True), full, unit))
        grads = np.full(N * n, float(rank + 1 + unit), np.float32)
        mine = np.zeros(N, np.float32)
        dev.reduce_scatter(grads, mine)
        assert mine[0] == sum(r + 1 + unit for r in range(n)), (unit, mine[0])
    bad = []
    for work, full, unit in gathers:
        work.wait()
        want = np.repeat(100.0 * unit + np.arange(n, dtype=np.float32), N)
        if not np.array_equal(full, want):
            bad.append((unit, full[::N].tolist()))
    dev.close()
    return bad


def test_zero3s_async_gathers_and_sync_reductions_on_one_group_stay_in_order():
    for bad in run_ranks(_zero3_pattern, 2, timeout=90):
        assert bad == []


CALLS = {
    "all_reduce": lambda dev, r, n: dev.all_reduce(np.ones(256, np.float32)),
    "all_reduce max": lambda dev, r, n: dev.all_reduce(np.ones(256, np.float32), "max"),
    "broadcast": lambda dev, r, n: dev.broadcast(np.ones(256, np.float32), 0),
    "broadcast root 1": lambda dev, r, n: dev.broadcast(np.ones(256, np.float32), 1),
    "all_gather": lambda dev, r, n: dev.all_gather(
        np.ones(256, np.float32), np.zeros(256 * n, np.float32)
    ),
    "all_to_all": lambda dev, r, n: dev.all_to_all(
        np.ones(256 * n, np.float32), np.zeros(256 * n, np.float32)
    ),
    "reduce_scatter": lambda dev, r, n: dev.reduce_scatter(
        np.ones(256 * n, np.float32), np.zeros(256, np.float32)
    ),
}


def _mismatched(rank, ws, calls):
    dev = _dev(rank)
    dev.all_reduce(np.zeros(4, np.float32))
    mine = calls[0] if rank == 0 else calls[1]
    try:
        CALLS[mine](dev, rank, ws)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    finally:
        dev.close()
    return "returned", ""


@pytest.mark.parametrize(
    "calls",
    [
        ("all_reduce", "broadcast"),
        ("all_reduce", "all_reduce max"),
        ("broadcast", "broadcast root 1"),
        ("all_gather", "all_to_all"),
        ("reduce_scatter", "all_gather"),
    ],
)
def test_ranks_calling_different_collectives_of_one_size_fail_naming_both(calls):
    """Rank 0 and rank 1 call different collectives (or the same one with
    another reduce op or root) over the same bytes: every rank raises an
    error that names its own op first and both calls, as the CPU path's
    does, and the group stays aborted."""
    results = run_ranks(_mismatched, 2, calls, timeout=90, pg_timeout=20)
    for rank, (kind, text) in enumerate(results):
        assert kind == "RuntimeError", (rank, kind, text)
        op = calls[rank].split()[0]
        assert text.startswith(f"clawcomm::{op}: "), text
        assert " called " in text and calls[0].split()[0] in text and calls[1].split()[0] in text


def _timed_wait(rank, ws):
    dev = _dev(rank)
    a = np.full(N, rank + 1.0, np.float32)
    dev.all_reduce(np.zeros(4, np.float32))
    if rank == 0:
        dev.hold("comm", 1500)
    work = dev.all_reduce(a, async_op=True)
    start = time.monotonic()
    try:
        work.wait(timeout=0.2)
        first = ("returned", time.monotonic() - start, work.is_completed())
    except TimeoutError as e:
        first = (str(e), time.monotonic() - start, work.is_completed())
    route = work.wait()  # then the call completes
    dev.close()
    return first, route, float(a[0])


def test_wait_with_a_timeout_gives_up_when_it_passes():
    """Rank 0's call runs 1.5 s late: its wait(timeout=0.2) raises a
    TimeoutError after about 0.2 s, saying the op still runs, and a later
    wait() still gets the result."""
    (first, route, a), (_, route1, a1) = run_ranks(_timed_wait, 2, timeout=90)
    text, waited, completed = first
    assert text.startswith("clawcomm: Work::wait timed out after 200 ms"), first
    assert 0.15 < waited < 1.0 and not completed, first
    assert (route, a, route1, a1) == ("ipc", 3.0, "ipc", 3.0)


def _memory(rank, ws):
    engine = clawcomm.engine_of()
    before = engine.memory_stats()["device_ipc_bytes"]
    dev = _C.HostDeviceComm(engine, device=rank)
    dev.all_reduce(np.zeros(4, np.float32))  # sets the group up
    during = engine.memory_stats()["device_ipc_bytes"], dev.device_bytes
    counted = comm_device_bytes([engine])
    dev.close()
    return before, during, counted, engine.memory_stats()["device_ipc_bytes"]


def test_the_ipc_buffer_is_counted_by_the_engine_while_it_lives():
    eager, graph, rings = 1 << 16, 1 << 14, 1 << 15
    env = {
        "CLAWCOMM_CUDA_IPC_BYTES": str(eager),
        "CLAWCOMM_CUDA_GRAPH_BYTES": str(graph),
        "CLAWCOMM_CUDA_P2P_BYTES": str(rings),
    }
    for before, (stat, own), counted, after in run_ranks(_memory, 2, env=env):
        areas = 2 * (eager + graph) + 2 * rings  # each channel's two areas; a ring per rank
        assert before == 0 and after == 0
        assert stat == own == counted and 0 < stat - areas <= 64 << 10, (stat, areas)


def test_max_memory_mb_counts_the_ipc_buffers():
    """The trainer's limit adds each rank's communicator buffers to its
    tensors: 1 MB of tensors and 208 MiB of buffers is over 100 MB."""
    rows = [RankSample(param_peak_bytes=1e6), RankSample(param_peak_bytes=1e6, comm_bytes=218e6)]
    check_memory(rows[:1], 100.0, 1)
    with pytest.raises(MemoryError, match=r"rank 1 held 219\.00 MB .*CUDA IPC buffers 218\.00 MB"):
        check_memory(rows, 100.0, 1)
