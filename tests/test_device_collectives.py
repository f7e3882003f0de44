"""The CUDA IPC path's logic on the CPU: device/device_comm.h over the host
runtime (device/host_runtime.h), through ``clawcomm._C.HostDeviceComm``.

The host runtime shares "device memory" between the rank processes through
shared memory and runs the kernels' bodies (device/ipc_algorithms.h, the code
nvcc compiles for the GPU) on host threads over the same epoch flags, so
these tests run the setup and its verdicts, the routing, the protocol, abort,
failure reports and graph capture that the GPU runs. Ranks claim device
indices as torchrun's LOCAL_RANK would (one device each), share one, or mix.

Each configuration is one multi-rank run that sweeps its cases and returns
every mismatch, so a failure names all that went wrong.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from _cases import DTYPES, check, expected_reduce, make_input, op_applies

import clawcomm
from clawcomm import _C
from clawcomm.launch import RankFailure, run_ranks

LAYOUTS = {
    "own": lambda rank: rank,  # one device per rank (torchrun's LOCAL_RANK)
    "shared": lambda rank: 0,  # every rank on one device (MPS)
    "mixed": lambda rank: rank % 2,
}
OPS = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor"]


def _device_comm(rank, layout="own", fault="none"):
    return _C.HostDeviceComm(clawcomm.engine_of(), device=LAYOUTS[layout](rank), fault=fault)


def _view(t, misaligned):
    """A numpy view of ``t`` (a copy of it, one element past a 16-byte
    boundary when ``misaligned``) and the dtype name to pass (numpy has no
    bfloat16), and the tensor the view writes into."""
    if misaligned:
        holder = torch.empty(t.numel() + 1, dtype=t.dtype)
        t2 = holder[1:]
        t2.copy_(t)
    else:
        t2 = t.clone()
    if t2.dtype == torch.bfloat16:
        return t2.view(torch.int16).numpy(), "bfloat16", t2
    return t2.numpy(), None, t2


def _sweep(rank, n, layout, dtypes, sizes, misaligned_ranks):
    """Every collective, dtype, reduce op and size; returns (mismatches, the
    routes taken), the routes to compare across ranks."""
    dev = _device_comm(rank, layout)
    bad = []
    routes = []
    odd = rank in misaligned_ranks

    for dtype in dtypes:
        for count in sizes:
            for op in OPS:
                if not op_applies(dtype, op):
                    continue
                case = f"ar/{dtype}/{op}/{count}"
                inputs = [make_input(case, r, count, dtype, op) for r in range(n)]
                buf, name, t = _view(inputs[rank], odd)
                routes.append((case, dev.all_reduce(buf, op, dtype=name)))
                check(bad, case, t, expected_reduce(inputs, op))

            case = f"rs/{dtype}/{count}"
            op = "sum" if dtype != torch.bool else "bor"
            inputs = [make_input(case, r, count * n, dtype) for r in range(n)]
            src, name, _ = _view(inputs[rank], odd)
            out, _, got = _view(torch.zeros(count, dtype=dtype), odd)
            routes.append((case, dev.reduce_scatter(src, out, op, dtype=name)))
            want = expected_reduce(inputs, op)[rank * count : (rank + 1) * count]
            check(bad, case, got, want)

            case = f"ag/{dtype}/{count}"
            inputs = [make_input(case, r, count, dtype) for r in range(n)]
            src, name, _ = _view(inputs[rank], odd)
            out, _, got = _view(torch.zeros(count * n, dtype=dtype), odd)
            routes.append((case, dev.all_gather(src, out, dtype=name)))
            check(bad, case, got, torch.cat(inputs))

            case = f"bc/{dtype}/{count}"
            root = count % n
            inputs = [make_input(case, r, count, dtype) for r in range(n)]
            buf, name, got = _view(inputs[rank], odd)
            routes.append((case, dev.broadcast(buf, root, dtype=name)))
            check(bad, case, got, inputs[root])

            case = f"a2a/{dtype}/{count}"
            inputs = [make_input(case, r, count * n, dtype) for r in range(n)]
            src, name, _ = _view(inputs[rank], odd)
            out, _, got = _view(torch.zeros(count * n, dtype=dtype), odd)
            routes.append((case, dev.all_to_all(src, out, dtype=name)))
            want = torch.cat([inputs[p][rank * count : (rank + 1) * count] for p in range(n)])
            check(bad, case, got, want)
    status = dev.status
    dev.close()
    return bad, routes, status


FEW_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]

# (world size, device layout, dtypes, sizes, misaligned ranks, env)
CONFIGS = {
    "2-own": (2, "own", DTYPES, [0, 1, 7, 1001, 40_000], (), {}),
    "2-shared-misaligned": (2, "shared", DTYPES, [1, 7, 1001], (1,), {}),
    "3-mixed": (3, "mixed", DTYPES, [0, 7, 1001], (), {}),
    "4-own-misaligned": (4, "own", FEW_DTYPES, [0, 7, 1001, 40_000], (0, 3), {}),
    # Two-shot from 512 bytes, and areas of 16 KiB: all-reduces go in
    # pieces, the larger other calls are staged (the same on every rank).
    "3-twoshot-pieces": (
        3,
        "mixed",
        FEW_DTYPES,
        [5, 1001, 20_000],
        (2,),
        {"CLAWCOMM_CUDA_ONESHOT_BYTES": "512", "CLAWCOMM_CUDA_IPC_BYTES": "16384"},
    ),
    "8-mixed": (8, "mixed", [torch.float32, torch.int32], [7, 1001], (), {}),
    # More than 8 ranks on a host: staged through the engine, not an error.
    "9-own-staged": (9, "own", [torch.float32, torch.int32], [7, 1001], (), {}),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_collective_matches_local_values(config):
    n, layout, dtypes, sizes, misaligned, env = CONFIGS[config]
    results = run_ranks(
        _sweep, n, layout, dtypes, sizes, misaligned, env=env, timeout=600, pg_timeout=120
    )
    for rank, (bad, _, _) in enumerate(results):
        assert not bad, (rank, bad[:10])
    # Every rank took the same route for every call, whatever its layout.
    routes = [r for _, r, _ in results]
    assert all(r == routes[0] for r in routes), "ranks routed a call differently"
    taken = {route for _, route in routes[0]}
    statuses = {s for _, _, s in results}
    if n > 8:
        assert taken == {"staged"}, taken
        assert all("9 ranks share this host" in s for s in statuses), statuses
    else:
        assert "ipc" in taken and statuses == {"ok"}, (taken, statuses)
    if config == "3-twoshot-pieces":
        assert taken == {"ipc", "staged"}, taken


def _routes(rank, n, sizes):
    dev = _device_comm(rank, "mixed")
    got = [(op, b, dev.route(op, b)) for op in ("all_reduce", "all_gather") for b in sizes]
    dev.close()
    return got


def test_one_shot_threshold_depends_on_the_world_size():
    """vLLM's crossovers: always one-shot on 2 ranks, 512 KiB on 3-4, 256 KiB on 5-8."""
    sizes = [1 << 10, 300 << 10, 600 << 10, 64 << 20]
    two = run_ranks(_routes, 2, sizes)[0]
    four = run_ranks(_routes, 4, sizes)[0]
    assert [r for op, _, r in two if op == "all_reduce"] == ["one-shot"] * 4
    assert [r for op, _, r in four if op == "all_reduce"] == [
        "one-shot",
        "one-shot",
        "two-shot",
        "two-shot",
    ]
    # A 64 MiB all-gather of 4 ranks does not fit the 64 MiB areas: staged.
    assert [r for op, _, r in four if op == "all_gather"][-1] == "staged"


# --- A setup that fails on one rank ---------------------------------------


def _mapped_segments():
    with open("/proc/self/maps") as f:
        return [line for line in f if "clawcomm-dev-" in line]


def _failed_setup(rank, n, fault):
    dev = _device_comm(rank, "own", fault=fault if rank == 1 else "none")
    x = np.arange(1000, dtype=np.float32) + rank
    start = time.monotonic()
    route = dev.all_reduce(x)  # the first call sets the IPC group up
    took = time.monotonic() - start
    status = dev.status
    leaked = _mapped_segments()  # an unusable group frees everything at once
    dev.close()
    # A retry over the same engine: fresh keys, no fault, IPC works.
    again = _device_comm(rank, "own")
    y = np.ones(1000, dtype=np.float32)
    retry = again.all_reduce(y)
    again.close()
    return route, took, status, leaked, float(x[5]), retry, float(y[0])


@pytest.mark.parametrize("fault", ["alloc", "open", "probe"])
def test_a_setup_that_fails_on_one_rank_stages_every_rank(fault):
    """Out of memory, IPC unsupported, or stores that never reach the peer,
    on rank 1 only: every rank stages, at once (not at the 60 s timeout),
    the status names rank 1's problem on every rank, nothing stays mapped,
    and a retry sets up cleanly."""
    results = run_ranks(_failed_setup, 3, fault, pg_timeout=60, timeout=120)
    reasons = {"alloc": "out of memory", "open": "IPC is not supported", "probe": "do not reach"}
    for rank, (route, took, status, leaked, value, retry, ones) in enumerate(results):
        assert route == "staged", (rank, route)
        assert took < 10, (rank, took)
        assert "rank 1" in status and reasons[fault] in status, (rank, status)
        assert leaked == [], (rank, leaked)
        assert value == 5 * 3 + 3, (rank, value)  # sum of 5 + r over r = 0, 1, 2
        assert retry == "ipc" and ones == 3, (rank, retry, ones)


# --- Settings every rank must share ---------------------------------------


@pytest.mark.parametrize(
    "name,values",
    [
        ("CLAWCOMM_CUDA_IPC", ("auto", "0")),
        ("CLAWCOMM_CUDA_IPC_BYTES", ("65536", "131072")),
        ("CLAWCOMM_CUDA_ONESHOT_BYTES", ("auto", "4096")),
        ("CLAWCOMM_CUDA_P2P_BYTES", ("0", "65536")),
    ],
)
def test_mismatched_cuda_settings_are_named_at_setup(name, values):
    """Ranks that route or size device calls differently would wait for each
    other forever: the group refuses to form, naming the setting."""
    results = run_ranks(
        lambda rank, n: None,
        2,
        rank_env=[{name: values[0]}, {name: values[1]}],
        allow_failures=True,
        pg_timeout=20,
        timeout=60,
    )
    for result in results:
        assert isinstance(result, RankFailure), result
        text = str(result)
        assert f"{name}=" in text and "must match" in text, text


# --- Bad arguments ----------------------------------------------------------


def _bad_arguments(rank, n):
    dev = _device_comm(rank)
    x = np.arange(8, dtype=np.int32)
    errors = []
    for call in (
        lambda: dev.all_reduce(x, "avg"),
        lambda: dev.all_reduce(np.ones(8, np.float32), "band"),
        lambda: dev.broadcast(x, root=n),
    ):
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    untouched = x.tolist() == list(range(8))
    dev.all_reduce(x)  # refused calls took no sequence number: the next call lines up
    dev.close()
    return errors, untouched, x.tolist()


def test_bad_arguments_fail_before_anything_moves():
    """AVG on integers (which used to overwrite the tensor with the sum and
    then raise), a bitwise op on floats, a root out of range: each is a
    ValueError naming the op and the value, the buffer is untouched, and the
    ranks stay in step."""
    for errors, untouched, after in run_ranks(_bad_arguments, 2):
        assert "all_reduce" in errors[0] and "avg" in errors[0] and "int32" in errors[0], errors
        assert "band" in errors[1] and "float32" in errors[1], errors
        assert "broadcast" in errors[2] and "root 2" in errors[2], errors
        assert untouched
        assert after == [2 * i for i in range(8)]


# --- Abort and failures -----------------------------------------------------


def _abort_while_spinning(rank, n, who):
    """Rank 0 waits in a call rank 1 never makes; `who` aborts after 0.5 s."""
    dev = _device_comm(rank)
    x = np.ones(4096, np.float32)
    dev.all_reduce(x)  # set up, in step
    start = time.monotonic()
    errors = []
    if rank == 0:
        if who == "self":  # an abort on the waiting rank itself, from another thread
            threading.Timer(0.5, lambda: clawcomm.engine_of().abort("the watchdog")).start()
        try:
            dev.all_reduce(x)
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    else:
        if who == "peer":  # the rank that never calls aborts; the waiting rank stops
            time.sleep(0.5)
            clawcomm.engine_of().abort("the watchdog")
        else:
            time.sleep(1.5)
    took = time.monotonic() - start
    try:  # every later call is refused
        dev.all_reduce(x)
        errors.append(None)
    except RuntimeError as e:
        errors.append(str(e))
    t0 = time.monotonic()
    dev.close()
    return took, errors, time.monotonic() - t0


@pytest.mark.parametrize("who", ["self", "peer"])
def test_abort_reaches_a_spinning_kernel(who):
    """With a 60 s timeout: the spinning blocks stop within a second of the
    abort (their own rank's flag, or the aborting peer's failed word), every
    later call is refused on every rank, and closing is prompt."""
    env = {"CLAWCOMM_INLINE_BYTES": "0"}
    results = run_ranks(_abort_while_spinning, 2, who, pg_timeout=60, timeout=120, env=env)
    took0, errors0, close0 = results[0]
    assert took0 < 3, results
    assert errors0[0] and ("abort" in errors0[0] or "gave up" in errors0[0]), errors0
    for _, errors, close in results:
        assert errors[-1] is not None, errors
        assert close < 2, close


def _peer_never_comes(rank, n):
    dev = _device_comm(rank)
    x = np.ones(1024, np.float32)
    dev.all_reduce(x)
    out = None
    if rank == 0:
        try:
            dev.all_reduce(x)  # rank 1 never joins: gives up at the 2 s timeout
            out = "no error"
        except RuntimeError as e:
            out = str(e)
    else:
        time.sleep(4)
        try:
            dev.all_reduce(x)  # rank 0 gave up: refused, not a wait
            out = "no error"
        except RuntimeError as e:
            out = str(e)
    dev.close()
    return out


def test_a_peer_that_never_comes_is_an_error_on_every_rank():
    """No trap: the kernel reports, returns, and the error names the rank it
    waited for; the communicator aborts, so the late rank is refused."""
    out = run_ranks(_peer_never_comes, 2, pg_timeout=2, timeout=60)
    assert "gave up waiting for rank 1" in out[0] and "timeout" in out[0], out[0]
    assert out[1] != "no error" and ("rank 0" in out[1]), out[1]


# --- The communicator's contract ------------------------------------------


def _contract(rank, n):
    import json

    eng = clawcomm.engine_of()
    dev = _device_comm(rank)
    before = eng.comm_stats()["all_reduce"]
    x = np.ones(1000, np.float32)
    dev.all_reduce(x)
    eng.all_reduce(x)  # an engine call between two device calls
    dev.all_reduce(x)
    after = eng.comm_stats()["all_reduce"]
    ops = json.loads(eng.flight_record())["ops"][-3:]
    dev.close()
    return before, after, ops


def test_device_calls_are_numbered_recorded_and_counted():
    for before, after, ops in run_ranks(_contract, 2):
        assert after["calls"] - before["calls"] == 3
        assert after["payload_bytes_sent"] - before["payload_bytes_sent"] >= 3 * 4000
        seqs = [op["seq"] for op in ops]
        assert seqs == list(range(seqs[0], seqs[0] + 3)), ops
        assert ops[0]["algo"] == ops[2]["algo"] == "CUDA IPC one-shot", ops
        assert not ops[1]["algo"].startswith("CUDA"), ops
        assert all(op["state"] == "done" for op in ops), ops


# --- Graphs -----------------------------------------------------------------


def _graph(rank, n):
    dev = _device_comm(rank, "mixed")
    x = np.zeros(3000, np.float32)
    dev.all_reduce(np.ones(16, np.float32))  # set up outside the capture
    dev.begin_capture()
    dev.all_reduce(x)  # recorded, not run
    graph = dev.end_capture()
    got = []
    for step in range(3):
        y = np.full(777, float(rank + 1), np.float32)
        dev.all_reduce(y)  # eager calls between replays
        x[:] = rank + 1 + step
        graph.replay()
        got.append((float(x[0]), float(y[0])))
    # Replays and eager calls at the same time, on separate flags.
    y = np.full(5000, float(rank), np.float32)
    x[:] = 10 * (rank + 1)
    replayer = threading.Thread(target=graph.replay)
    replayer.start()
    for _ in range(5):
        dev.all_reduce(y)
    replayer.join()
    concurrent = (float(x[0]), float(y[0]))
    # The group closed: the graph still holds what its launches point at.
    dev.close()
    x[:] = 1
    graph.replay()
    return got, concurrent, float(x[-1])


def test_a_captured_graph_replays_after_eager_calls_and_outlives_the_group():
    n = 2
    for got, concurrent, after_close in run_ranks(_graph, n, timeout=120):
        assert got == [(float(sum(r + 1 + s for r in range(n))), 3.0) for s in range(3)], got
        assert concurrent == (30.0, float(sum(range(n)) * n**4)), concurrent
        assert after_close == n, after_close


def test_segments_never_outlive_the_job():
    before = set(os.listdir("/dev/shm"))
    run_ranks(_sweep, 2, "own", [torch.float32], [7], (), timeout=120)
    leftover = {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("clawcomm-dev")}
    assert not leftover, leftover
