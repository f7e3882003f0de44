"""Single copy between ranks of one host (CLAWCOMM_SINGLE_COPY): frames of at
least CLAWCOMM_SINGLE_COPY_BYTES travel as references that the receiver reads
straight out of the sender's memory (messenger/messenger.h,
transport/shm/connection.h). Here the threshold is 64 bytes and the mode
`all`, so nearly every frame of every operation goes by reference, through
every kind of sink (copy, reduce, 16-bit decode), and the results must equal
the ring's bit for bit."""

from __future__ import annotations

import ctypes
import datetime
import os
import platform
import signal
import struct
import threading
import time

import numpy as np
import pytest
import torch.distributed as dist

import clawcomm
from clawcomm.launch import RankFailure, run_ranks

BY_REFERENCE = {"CLAWCOMM_SINGLE_COPY": "all", "CLAWCOMM_SINGLE_COPY_BYTES": "64"}
RING = {"CLAWCOMM_SINGLE_COPY": "off"}
COUNTS = [1, 4099, 300007]
DTYPES = [np.float32, np.int32, np.float16, np.float64]


def _every_op(rank, n):
    eng = clawcomm.engine_of()
    out = {}
    for dtype in DTYPES:
        for count in COUNTS:
            rng = np.random.default_rng(1000 * rank + count)
            x = (rng.standard_normal(count) * 100).astype(dtype)
            key = (np.dtype(dtype).name, count)
            a = x.copy()
            eng.all_reduce(a)
            m = x.copy()
            eng.all_reduce(m, op="max")
            rs = np.empty(count // n, dtype)
            eng.reduce_scatter(x[: count // n * n].copy(), rs)
            ag = np.empty(count * n, dtype)
            eng.all_gather(x, ag)
            b = x.copy()
            eng.broadcast(b, root=n - 1)
            r = x.copy()
            eng.reduce(r, root=1 % n)
            a2a = np.empty(count // n * n, dtype)
            eng.all_to_all(x[: count // n * n].copy(), a2a)
            ring = np.empty_like(x)
            eng.sendrecv(x, (rank + 1) % n, ring, (rank - 1) % n)
            out[key] = [a, m, rs, ag, b, r if rank == 1 % n else None, a2a, ring]
    wide = np.random.default_rng(rank).standard_normal(100003).astype(np.float32)
    eng.all_reduce_16bit_wire(wide, wire="bfloat16")  # decode sinks
    out["16bit"] = wide
    stats = eng.comm_stats()
    out["by_reference"] = sum(v["frames_received_single_copy"] for v in stats.values())
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_operation_by_reference_equals_the_ring(world_size):
    ring = run_ranks(_every_op, world_size, env=RING)
    ref = run_ranks(_every_op, world_size, env=BY_REFERENCE)
    for rank in range(world_size):
        assert ring[rank].pop("by_reference") == 0
        assert ref[rank].pop("by_reference") > 40, "frames did not go by reference"
        for key, want in ring[rank].items():
            got = ref[rank][key]
            if isinstance(want, list):
                for i, (w, g) in enumerate(zip(want, got, strict=True)):
                    if w is not None:
                        np.testing.assert_array_equal(g, w, err_msg=f"{key} op {i}")
            else:
                np.testing.assert_array_equal(got, want, err_msg=str(key))


def _head_to_head(rank, n):
    """Blocking sends first on both ranks, then the receives; and a send
    whose receive comes after a collective on the receiver. Each send's
    reference waits unclaimed (parked) until it is read into a stash."""
    eng = clawcomm.engine_of()
    peer = 1 - rank
    big = np.full(1 << 20, rank + 1, np.float32)  # 4 MiB: by reference
    got = np.empty_like(big)
    eng.send(big, peer, tag=1)  # returns before the peer posts its receive
    eng.recv(got, peer, tag=1)
    ones = np.ones(1 << 20, np.float32)  # its frames go by reference too, read before the send's
    if rank == 0:
        eng.send(big, 1, tag=2)  # rank 1 receives it only after the all-reduce
        eng.all_reduce(ones)
    else:
        eng.all_reduce(ones)
        eng.recv(got, 0, tag=2)
    stats = eng.comm_stats()
    return float(got[0]), float(ones[-1]), stats["recv"]["frames_received_single_copy"]


def test_a_send_by_reference_never_waits_for_its_receive():
    results = run_ranks(_head_to_head, 2, env={"CLAWCOMM_SINGLE_COPY": "all"}, pg_timeout=20)
    assert results[0][:2] == (2.0, 2.0)
    assert results[1][:2] == (1.0, 2.0)
    assert results[0][2] >= 1 and results[1][2] >= 1


def _receives_late_or_in_time(rank, n, delay):
    eng = clawcomm.engine_of()
    count = 1 << 20
    if rank == 0:
        for tag in range(3):
            eng.send(np.arange(count, dtype=np.float32) + tag, 1, tag=tag)
        return None
    time.sleep(delay)  # 0: in time (read straight in); 50 ms: parked, then stashed
    out = []
    for tag in (2, 0, 1):  # not in the order sent: matched by tag
        got = np.empty(count, np.float32)
        src = eng.recv(got, -1, tag=tag)
        out.append((src, float(got[5]), float(got[-1])))
    return out


@pytest.mark.parametrize("delay", [0.0, 0.05], ids=["in-time", "late"])
def test_unexpected_references_are_matched_by_tag_from_any_source(delay):
    env = {"CLAWCOMM_SINGLE_COPY": "cma"}
    results = run_ranks(_receives_late_or_in_time, 2, delay, env=env, pg_timeout=20)
    last = (1 << 20) - 1
    assert results[1] == [(0, 5.0 + tag, last + tag) for tag in (2, 0, 1)]


def _which_ops_go_by_reference(rank, n):
    eng = clawcomm.engine_of()
    x = np.ones(1 << 16, np.float32)
    eng.all_reduce(x)
    eng.reduce_scatter(x, np.empty(x.size // n, np.float32))
    eng.reduce(x.copy(), root=0)
    eng.broadcast(x, root=0)
    before = eng.comm_stats()["broadcast"]["frames_received_single_copy"]
    eng.broadcast(np.ones(9 << 18, np.float32), root=0)  # 9 MiB: through the ring
    large = eng.comm_stats()["broadcast"]["frames_received_single_copy"] - before
    eng.all_gather(x, np.empty(x.size * n, np.float32))
    eng.all_to_all(x, np.empty_like(x))
    eng.sendrecv(x, 1 - rank, np.empty_like(x), 1 - rank)
    got = {op: v["frames_received_single_copy"] for op, v in eng.comm_stats().items()}
    got["broadcast"] -= large
    got["large broadcast"] = large
    return got


def test_auto_sends_by_reference_where_every_rank_sends_and_receives():
    env = {"CLAWCOMM_SINGLE_COPY": "auto", "CLAWCOMM_SINGLE_COPY_BYTES": "64"}
    for rank, got in enumerate(run_ranks(_which_ops_go_by_reference, 2, env=env)):
        for op in ("all_reduce", "reduce_scatter", "reduce", "large broadcast"):
            assert got[op] == 0, (op, got)
        # The tree broadcast's frames up to 8 MiB go by reference too: rank
        # 1 reads the root's 256 KiB.
        assert got["broadcast"] == rank, got
        for op in ("all_gather", "all_to_all", "recv"):
            assert got[op] > 0, (op, got)


# --- from which size: measured by each reader, or the setting ---------------


def _frames_at_the_edge(rank, n):
    # Each rank sends its peer one frame of exactly the size from which it
    # sends by reference, and one a word smaller; the peer counts what came
    # by reference.
    eng = clawcomm.engine_of()
    peer = 1 - rank
    mine = eng.single_copy_from(peer)
    both = np.empty(2, np.int64)
    eng.all_gather(np.array([mine or 0], np.int64), both)
    theirs = int(both[peer])
    got = []
    for size in (theirs, theirs - 8) if theirs else (1 << 20,):
        send_size = mine if size == theirs else (mine - 8 if mine else 1 << 20)
        before = eng.comm_stats()["recv"]["frames_received_single_copy"]
        # The peer sends only after this rank has counted: its frame could
        # otherwise arrive (and be counted) on the progress thread first.
        eng.barrier()
        eng.sendrecv(np.ones(send_size, np.uint8), peer, np.empty(size, np.uint8), peer)
        got.append(eng.comm_stats()["recv"]["frames_received_single_copy"] - before)
    return mine, theirs, got


def test_each_reader_measures_from_which_size_it_reads():
    # Unset, the size is the reader's to measure: 64 KiB where its kernel
    # reads fast, the 1 MiB default elsewhere. Whichever it chose, frames
    # from that size go by reference and smaller ones through the ring.
    for mine, theirs, got in run_ranks(_frames_at_the_edge, 2):
        assert mine in (64 << 10, 1 << 20), mine
        assert got == [1, 0], (mine, theirs, got)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"CLAWCOMM_SINGLE_COPY_BYTES": "4096"}, 4096),
        ({"CLAWCOMM_SINGLE_COPY_BYTES": "1048576"}, 1 << 20),
        ({"CLAWCOMM_SINGLE_COPY": "off"}, None),
    ],
    ids=["4KiB", "1MiB", "off"],
)
def test_the_setting_overrides_the_measurement(env, expected):
    for mine, theirs, got in run_ranks(_frames_at_the_edge, 2, env=env):
        assert mine == expected and theirs == (expected or 0), (mine, theirs)
        assert got == ([1, 0] if expected else [0]), got


# --- a reader that may not read: a seccomp filter, as in a container --------


def _forbid_process_vm_readv():
    """Makes process_vm_readv fail with EPERM in this process (every thread),
    as a container's seccomp profile can."""
    nr = {"x86_64": 310, "aarch64": 270}[platform.machine()]
    ld_nr, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    allow, errno_eperm = 0x7FFF0000, 0x00050000 | 1
    prog = [(ld_nr, 0, 0, 0), (jeq, 0, 1, nr), (ret, 0, 0, errno_eperm), (ret, 0, 0, allow)]
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(prog), ctypes.cast(code, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    seccomp = {"x86_64": 317, "aarch64": 277}[platform.machine()]
    # SECCOMP_SET_MODE_FILTER with SECCOMP_FILTER_FLAG_TSYNC: every thread.
    assert libc.syscall(seccomp, 1, 1, ctypes.byref(fprog)) == 0, ctypes.get_errno()


def _one_forbidden(rank, n, store_path):
    if rank == 1:
        _forbid_process_vm_readv()
    start = time.monotonic()
    try:
        dist.init_process_group(
            "clawcomm",
            store=dist.FileStore(store_path, n),
            rank=rank,
            world_size=n,
            timeout=datetime.timedelta(seconds=5),
        )
    except Exception as e:  # noqa: BLE001
        return "error", str(e), time.monotonic() - start
    eng = clawcomm.engine_of()
    x = np.full(1 << 20, rank + 1, np.float32)
    got = np.empty_like(x)
    eng.sendrecv(x, 1 - rank, got, 1 - rank)
    eng.all_reduce(x)
    stats = eng.comm_stats()
    dist.destroy_process_group()
    received = sum(v["frames_received_single_copy"] for v in stats.values())
    return "ok", (float(got[0]), float(x[0]), received), 0.0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="seccomp numbers")
def test_a_rank_that_cannot_read_its_peer_falls_back_to_the_ring_for_that_direction(tmp_path):
    env = {"CLAWCOMM_SINGLE_COPY": "auto"}
    results = run_ranks(_one_forbidden, 2, str(tmp_path / "s"), env=env, init=False)
    (s0, r0, _), (s1, r1, _) = results
    assert (s0, s1) == ("ok", "ok"), results
    assert r0[:2] == (2.0, 3.0) and r1[:2] == (1.0, 3.0)
    assert r0[2] > 0, "rank 0 may read rank 1: its receives go by reference"
    assert r1[2] == 0, "rank 1 may not read rank 0: rank 0 sends it bytes"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="seccomp numbers")
def test_single_copy_cma_is_an_error_at_setup_on_every_rank_where_the_probe_fails(tmp_path):
    env = {"CLAWCOMM_SINGLE_COPY": "cma"}
    results = run_ranks(_one_forbidden, 2, str(tmp_path / "s"), env=env, init=False)
    assert results[1][0] == "error"
    assert "CLAWCOMM_SINGLE_COPY=cma" in results[1][1] and "process_vm_readv" in results[1][1]
    assert "Operation not permitted" in results[1][1], results[1][1]
    assert results[0][0] == "error" and "rank 1" in results[0][1], results[0]
    assert all(r[2] < 5 + 1.0 for r in results), results


# --- a sender killed while its receiver reads it ------------------------------


def _killed_sender(rank, n):
    eng = clawcomm.engine_of()
    x = np.ones(16 << 20, np.float32)  # 64 MiB: tens of milliseconds a transfer
    if rank == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        while True:
            eng.send(x, 0)
    start = time.monotonic()
    try:
        while time.monotonic() - start < 30:
            eng.recv(x, 1)
        return "no error", 0.0
    except Exception as e:  # noqa: BLE001
        return str(e), time.monotonic() - start


def test_a_sender_killed_during_a_single_copy_read_is_an_error_not_a_crash():
    env = {"CLAWCOMM_SINGLE_COPY": "cma"}
    results = run_ranks(_killed_sender, 2, env=env, pg_timeout=10, allow_failures=True)
    assert isinstance(results[1], RankFailure)
    error, elapsed = results[0]
    assert "rank 1" in error, error
    assert elapsed < 10, (elapsed, error)
