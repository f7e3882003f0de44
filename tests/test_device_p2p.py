"""Sends and receives of the CUDA IPC path on the CPU: device/protocol.h's
point-to-point rings (CLAWCOMM_CUDA_P2P_BYTES) over the host runtime, through
``clawcomm._C.HostDeviceComm``, as tests/test_device_collectives.py runs the
collectives. The host runtime runs each stream's work at once, so a receive
returns when its message has arrived and a send returns once its bytes are in
the ring (it waits only while the ring is full).
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import clawcomm
from clawcomm import _C
from clawcomm.launch import run_ranks

RINGS = {"CLAWCOMM_CUDA_P2P_BYTES": str(64 << 10)}  # 64 KiB per rank, split among its peers


def _dev(rank, layout):
    device = {"own": rank, "shared": 0}[layout]
    return _C.HostDeviceComm(clawcomm.engine_of(), device=device)


def _message(src, dst, i, count, dtype):
    rng = np.random.default_rng(1000 * src + 10 * dst + i)
    return (rng.random(count) * 100).astype(dtype)


# Sizes around the 16-byte packs, one larger than a ring (staged), and
# enough bytes in all that every ring wraps several times.
SIZES = [(1, np.uint8), (3, np.float32), (4, np.float32), (1001, np.int64), (4096, np.float32)]
SIZES += [(9000, np.float64), (1, np.float64), (2500, np.int32)]


def _exchange(rank, n, layout, rounds):
    """Every rank sends each message to every peer, then receives each
    peer's, round after round: the routes taken and the mismatches."""
    dev = _dev(rank, layout)
    bad, routes = [], []
    for i in range(rounds):
        count, dtype = SIZES[i % len(SIZES)]
        for step in range(1, n):
            to, frm = (rank + step) % n, (rank - step) % n
            routes.append(dev.send(_message(rank, to, i, count, dtype), to, tag=i))
            got = np.zeros(count, dtype)
            routes.append(dev.recv(got, frm, tag=i))
            if not np.array_equal(got, _message(frm, rank, i, count, dtype)):
                bad.append((i, frm, count, np.dtype(dtype).name))
    stats = clawcomm.engine_of().comm_stats()
    dev.close()
    return bad, routes, stats["send"], stats["recv"]


@pytest.mark.parametrize("n,layout", [(2, "own"), (3, "shared"), (4, "own")])
def test_messages_through_the_rings_arrive_whole_and_in_order(n, layout):
    rounds = 3 * len(SIZES)
    results = run_ranks(_exchange, n, layout, rounds, env=RINGS, timeout=300, pg_timeout=60)
    for rank, (bad, routes, sent, received) in enumerate(results):
        assert not bad, (rank, bad[:5])
        # A 9000-float64 message (72 KB) fits no ring: staged, by tag.
        assert set(routes) == {"ipc", "staged"}, set(routes)
        assert sent["calls"] >= rounds * (n - 1) and received["calls"] >= rounds * (n - 1)
    # Both ends of every message took the same route.
    assert all(r[1] == results[0][1] for r in results)


def test_without_rings_sends_and_receives_are_staged():
    results = run_ranks(_exchange, 2, "own", 4, timeout=120)
    for bad, routes, _, _ in results:
        assert not bad and set(routes) == {"staged"}, (bad, routes)


def _fill_the_ring(rank, n):
    """Rank 0 sends six 20 KB messages into a 64 KiB ring while rank 1 is
    still asleep: its fourth send waits until rank 1 takes the first."""
    dev = _dev(rank, "own")
    dev.all_reduce(np.ones(4, np.float32))  # the group is up on both ranks
    out = []
    if rank == 0:
        t0 = time.perf_counter()
        for i in range(6):
            dev.send(np.full(5000, i, np.float32), 1, tag=i)
            out.append(time.perf_counter() - t0)
    else:
        time.sleep(1.0)
        for i in range(6):
            got = np.zeros(5000, np.float32)
            dev.recv(got, 0, tag=i)
            out.append(bool((got == i).all()))
    record = json.loads(clawcomm.engine_of().flight_record())["ops"]
    dev.close()
    return out, record


def test_a_send_waits_for_room_in_a_full_ring():
    (times, record0), (ok, record1) = run_ranks(_fill_the_ring, 2, env=RINGS, timeout=120)
    assert ok == [True] * 6, ok
    assert times[2] < 0.5 and times[3] > 0.8, times  # three fit; the fourth waited for rank 1
    sends = [op for op in record0 if op["op"] == "send"]
    assert len(sends) == 6 and all(op["state"] == "done" for op in sends), sends
    assert all(op["peer"] == 1 and op["algo"] == "CUDA IPC" for op in sends), sends
    assert [op["op"] for op in record1[-6:]] == ["recv"] * 6, record1[-6:]


def _mismatch(rank, n):
    dev = _dev(rank, "own")
    out = None
    try:
        if rank == 0:
            dev.send(np.ones(16, np.float32), 1, tag=7)
            time.sleep(2)
            dev.all_reduce(np.ones(16, np.float32))  # refused: rank 1 failed the group
        else:
            dev.recv(np.zeros(16, np.float32), 0, tag=8)
        out = "no error"
    except RuntimeError as e:
        out = str(e)
    dev.close()
    return out


def test_a_receive_that_meets_another_tag_is_an_error_on_both_ranks():
    out = run_ranks(_mismatch, 2, env=RINGS, timeout=120, pg_timeout=10)
    assert "expected tag 8 (64 bytes) and found tag 7 (64 bytes)" in out[1], out[1]
    assert "in the order they are issued" in out[1], out[1]
    assert out[0] != "no error", out[0]


def _never_sent(rank, n):
    dev = _dev(rank, "own")
    out = "no error"
    dev.all_reduce(np.ones(4, np.float32))  # the group is up on both ranks
    if rank == 1:
        try:
            dev.recv(np.zeros(4, np.float32), 0, tag=1)  # rank 0 never sends
        except RuntimeError as e:
            out = str(e)
    else:
        time.sleep(4)
        try:
            dev.all_reduce(np.ones(4, np.float32))
        except RuntimeError as e:
            out = str(e)
    dev.close()
    return out


def test_a_receive_whose_message_never_comes_gives_up_at_the_timeout():
    out = run_ranks(_never_sent, 2, env=RINGS, timeout=60, pg_timeout=2)
    assert "gave up waiting for rank 0" in out[1] and "waiting for its message" in out[1], out[1]
    assert out[0] != "no error" and "rank 1" in out[0], out[0]


def _bad_peer(rank, n):
    dev = _dev(rank, "own")
    errors = []
    for call in (
        lambda: dev.send(np.ones(4, np.float32), rank),
        lambda: dev.send(np.ones(4, np.float32), n),
        lambda: dev.recv(np.zeros(4, np.float32), -1),
    ):
        try:
            call()
            errors.append(None)
        except (ValueError, RuntimeError) as e:
            errors.append(str(e))
    # The group still works: nothing moved.
    x = np.ones(4, np.float32)
    dev.all_reduce(x)
    dev.close()
    return errors, x.tolist()


def test_a_bad_peer_is_refused_before_anything_moves():
    for errors, x in run_ranks(_bad_peer, 2, env=RINGS, timeout=60):
        assert all(e is not None for e in errors), errors
        assert "itself" in errors[0] and "out of range" in errors[1], errors
        assert x == [2.0] * 4


def _posted_early(rank, n):
    """Every rank posts its receive before the send its peer waits for (a
    pipeline's prefetched receive): rank r receives from r-1 and sends to
    r+1. Launched when posted, each receive would wait for a message whose
    send is issued after it (the host runtime runs a stream's work at once,
    as a GPU queue that holds later work behind a waiting kernel does)."""
    dev = _dev(rank, "own")
    to, frm = (rank + 1) % n, (rank - 1) % n
    got = np.zeros(1001, np.float32)
    handle = dev.irecv(got, frm, tag=3)
    dev.send(_message(rank, to, 0, 1001, np.float32), to, tag=3)
    route = handle.wait()
    ok = np.array_equal(got, _message(frm, rank, 0, 1001, np.float32))
    dev.close()
    return ok, route


@pytest.mark.parametrize("n", [2, 3])
def test_a_receive_posted_before_the_send_its_peer_waits_for_does_not_block_it(n):
    for ok, route in run_ranks(_posted_early, n, env=RINGS, timeout=60, pg_timeout=5):
        assert ok and route == "ipc", (ok, route)


def _pipeline(rank, n):
    """Two stages, as 1f1b runs them: stage 1 posts its receives for both
    activations before it computes, waits for the second first, and sends
    the first gradient before the second activation exists on stage 0."""
    dev = _dev(rank, "own")
    act = [np.full(700, 10.0 + i, np.float32) for i in range(2)]
    grad = [np.full(300, 20.0 + i, np.float32) for i in range(2)]
    if rank == 0:
        g0, g1 = np.zeros(300, np.float32), np.zeros(300, np.float32)
        h0 = dev.irecv(g0, 1, tag=20)  # posted before the forward, as 1f1b does
        dev.send(act[0], 1, tag=10)
        h0.wait()  # rank 1's gradient of micro-batch 0
        dev.send(act[1], 1, tag=11)  # only now: it "needs" the gradient
        h1 = dev.irecv(g1, 1, tag=21)
        h1.wait()
        return [bool((g0 == grad[0]).all()), bool((g1 == grad[1]).all())]
    a0, a1 = np.zeros(700, np.float32), np.zeros(700, np.float32)
    h0, h1 = dev.irecv(a0, 0, tag=10), dev.irecv(a1, 0, tag=11)
    out = []
    dev.send(grad[0], 0, tag=20)  # sent while both receives are posted
    out.append(h1.wait() == "ipc")  # the second first: the first is launched before it
    out.append(h0.wait() == "ipc")
    dev.send(grad[1], 0, tag=21)
    out += [bool((a0 == act[0]).all()), bool((a1 == act[1]).all())]
    dev.close()
    return out


def test_receives_posted_early_are_launched_in_order_when_first_waited_for():
    first, second = run_ranks(_pipeline, 2, env=RINGS, timeout=60, pg_timeout=5)
    assert first == [True, True] and second == [True] * 4, (first, second)


def _never_waited(rank, n):
    """A receive posted and dropped unwaited: a later one from the same peer
    still gets its own message (the dropped one is launched before it), and
    closing the group with a receive still unwaited neither hangs nor
    leaves the handle a success."""
    dev = _dev(rank, "own")
    if rank == 0:
        for i in range(3):
            dev.send(np.full(64, float(i), np.float32), 1, tag=i)
        dev.all_reduce(np.ones(4, np.float32))  # rank 1 has what it needs
        dev.close()
        return None
    dropped = np.zeros(64, np.float32)
    dev.irecv(dropped, 0, tag=0)  # the handle goes at once
    got = np.zeros(64, np.float32)
    dev.irecv(got, 0, tag=1).wait()
    unwaited = dev.irecv(np.zeros(64, np.float32), 0, tag=2)
    dev.all_reduce(np.ones(4, np.float32))
    dev.close()
    try:
        unwaited.wait()
        late = "no error"
    except RuntimeError as e:
        late = str(e)
    record = json.loads(clawcomm.engine_of().flight_record())["ops"]
    recvs = [op["state"] for op in record if op["op"] == "recv"]
    return bool((got == 1.0).all()), late, recvs


def test_a_receive_never_waited_for_keeps_the_order_and_ends_with_the_group():
    _, (ok, late, recvs) = run_ranks(_never_waited, 2, env=RINGS, timeout=60, pg_timeout=5)
    assert ok
    assert "destroyed before this receive was waited for" in late, late
    assert len(recvs) == 3 and recvs[:2] == ["done", "done"] and recvs[2] != "done", recvs


def _shuffled(rank, n, rounds):
    """Round after round: every rank posts all its receives first, sends its
    messages (1 to 3 per peer, 1 to 1024 floats, the rings wrapping many
    times), then waits for the receives in a random order."""
    dev = _dev(rank, "shared")
    rng = np.random.default_rng(rank)

    def plan(i, src, dst):
        r = np.random.default_rng(10_000 * i + 100 * src + dst)
        return [int(c) for c in r.integers(1, 1025, size=int(r.integers(1, 4)))]

    bad = 0
    for i in range(rounds):
        posted = []
        for frm in range(n):
            if frm != rank:
                for k, count in enumerate(plan(i, frm, rank)):
                    got = np.zeros(count, np.float32)
                    posted.append((dev.irecv(got, frm, tag=k), got, frm, k, count))
        for to in range(n):
            if to != rank:
                for k, count in enumerate(plan(i, rank, to)):
                    dev.send(_message(rank, to, 100 * i + k, count, np.float32), to, tag=k)
        for j in rng.permutation(len(posted)):
            handle, got, frm, k, count = posted[j]
            handle.wait()
            bad += not np.array_equal(got, _message(frm, rank, 100 * i + k, count, np.float32))
    dev.close()
    return bad


@pytest.mark.parametrize("n", [2, 3])
def test_receives_posted_in_bulk_and_waited_in_any_order_get_their_messages(n):
    assert run_ranks(_shuffled, n, 30, env=RINGS, timeout=120, pg_timeout=10) == [0] * n
