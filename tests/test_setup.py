"""Setting up a group is bounded and survives what it meets on the way: a
rank killed during init_process_group, stray clients at a rank's listening
socket, a store that served an earlier group, an address that is not this
host's. Every survivor gets an error naming the missing rank within the
group's timeout (+1 s), and /dev/shm keeps no segment of a failed setup."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from clawcomm.launch import RankFailure, run_ranks
from clawcomm.testing.chaos.endurance import listening_ports, tcp_hello
from clawcomm.testing.chaos.harness import segments, slow_to_read_addresses
from clawcomm.testing.stores import StoreServer, open_store

TRANSPORTS = [{"CLAWCOMM_TRANSPORT": "shm"}, {"CLAWCOMM_TRANSPORT": "tcp"}]
TIMEOUT = 3.0  # the group's timeout in these tests (s)


def _init(rank, ws, store_path):
    import clawcomm  # noqa: F401

    dist.init_process_group(
        "clawcomm",
        store=open_store(store_path, ws),
        rank=rank,
        world_size=ws,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )


# --- a rank killed during setup ---------------------------------------------


def _killed_during_setup(rank, ws, store_path, kill_after):
    victim = ws - 1
    if rank == victim:
        if kill_after is None:  # never calls init_process_group
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(kill_after, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        _init(rank, ws, store_path)
        for _ in range(100):  # setup finished before the kill: the next ops must fail
            dist.all_reduce(torch.ones(1000))
            time.sleep(0.01)
        return "no error", time.monotonic() - start
    except Exception as e:  # noqa: BLE001
        return str(e), time.monotonic() - start


@pytest.mark.parametrize("env", TRANSPORTS, ids=["shm", "tcp"])
@pytest.mark.parametrize(
    "kill_after", [None, 0.0, 0.004, 0.02], ids=["never", "0ms", "4ms", "20ms"]
)
def test_a_rank_killed_during_setup_fails_every_survivor_in_time(env, kill_after):
    before = segments()
    with StoreServer() as server:  # a FileStore hangs its readers if a writer dies mid-record
        results = run_ranks(
            _killed_during_setup, 3, server.address, kill_after,
            env=env, init=False, timeout=60, allow_failures=True,
        )  # fmt: skip
    assert isinstance(results[2], RankFailure)
    for rank in (0, 1):
        assert not isinstance(results[rank], RankFailure), results[rank]
        error, elapsed = results[rank]
        assert "rank 2" in error, error
        assert elapsed < TIMEOUT + 1.0, (elapsed, error)
    assert segments() <= before, "a failed setup left shared memory behind"


# --- stray clients at the listening socket ----------------------------------


def _strays(ports_seen, clients, stop):
    """Connects hostile clients to every new listening port of this process:
    one idle, one sending garbage, one a hello with a wrong token, one a
    hello cut short."""
    hello = tcp_hello(1, 0xBAD)
    while not stop.is_set():
        for port in listening_ports() - ports_seen:
            ports_seen.add(port)
            for payload in (b"", os.urandom(64), hello, hello[:7]):
                try:
                    c = socket.create_connection(("127.0.0.1", port), timeout=1)
                    c.sendall(payload)
                    clients.append(c)  # held open
                except OSError:
                    pass
        time.sleep(0.002)


def _setup_with_strays(rank, ws, store_path):
    import clawcomm  # noqa: F401

    stop, clients, seen = threading.Event(), [], listening_ports()
    store = dist.FileStore(store_path, ws)
    if rank == 0:  # rank 0 accepts rank 1's connection
        threading.Thread(target=_strays, args=(seen, clients, stop), daemon=True).start()
    else:
        store = slow_to_read_addresses(store, 0.5)
    start = time.monotonic()
    dist.init_process_group(
        "clawcomm", store=store, rank=rank, world_size=ws,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )  # fmt: skip
    elapsed = time.monotonic() - start
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    stop.set()
    return elapsed, x[0].item(), len(clients)


def test_stray_clients_at_the_listener_do_not_hold_up_setup(tmp_path, capfd):
    env = {"CLAWCOMM_TRANSPORT": "tcp", "CLAWCOMM_SOCKET_ADDR": "127.0.0.1"}
    results = run_ranks(_setup_with_strays, 2, str(tmp_path / "store"), env=env, init=False)
    for elapsed, value, _ in results:
        assert value == 3.0
        assert elapsed < TIMEOUT, elapsed
    assert results[0][2] >= 4, "the strays never connected"
    err = capfd.readouterr().err
    assert "refused a connection" in err and "wrong job token" in err, err


# --- a store that served an earlier group -----------------------------------


def _two_groups_one_store(rank, ws, store_path):
    from clawcomm import _C_torch

    store = dist.FileStore(store_path, ws)
    sums = []
    for generation in range(2):
        if rank == 0 and generation == 1:
            time.sleep(0.5)  # the others read the store first: it still holds group 0's keys
        backend = _C_torch.ClawcommBackend(store, rank, ws, datetime.timedelta(seconds=TIMEOUT))
        x = torch.full((10,), float(rank + 1 + generation))
        backend.allreduce([x]).wait()
        sums.append(x[0].item())
        del backend
    return sums


@pytest.mark.parametrize("env", TRANSPORTS, ids=["shm", "tcp"])
def test_a_reused_store_does_not_hand_out_an_earlier_groups_keys(env, tmp_path):
    for sums in run_ranks(
        _two_groups_one_store, 2, str(tmp_path / "store"), env=env, init=False, timeout=60
    ):
        assert sums == [3.0, 5.0]


def _groups_of_two_sizes(rank, ws, store_path):
    """A group of 3 on a store, then a group of ranks 0 and 1 on the same one."""
    from clawcomm import _C_torch

    timeout = datetime.timedelta(seconds=TIMEOUT)
    # One FileStore for both groups: a second instance on the path races the
    # first's deletion of the file when the others drop theirs.
    store = dist.FileStore(store_path, 3)
    backend = _C_torch.ClawcommBackend(store, rank, 3, timeout)
    x = torch.ones(4)
    backend.allreduce([x]).wait()
    del backend
    if rank == 2:
        return x[0].item()
    backend = _C_torch.ClawcommBackend(store, rank, 2, timeout)
    y = torch.ones(4)
    backend.allreduce([y]).wait()
    return x[0].item(), y[0].item()


def test_a_store_reused_by_a_group_of_another_size(tmp_path):
    """Generations were counted over every arrival, whatever the group's
    size: the second group's two ranks landed in two namespaces and waited
    for each other until the timeout."""
    got = run_ranks(_groups_of_two_sizes, 3, str(tmp_path / "store"), init=False, timeout=60)
    assert got == [(3.0, 2.0), (3.0, 2.0), 3.0], got


def _a_group_after_a_partial_setup(rank, ws, store_path):
    """Rank 0 alone sets up a group of two, which times out; then both
    ranks set up a group of two on the same store."""
    from clawcomm import _C_torch

    store = dist.FileStore(store_path, ws)
    timeout = datetime.timedelta(seconds=TIMEOUT)
    if rank == 0:
        with pytest.raises(Exception, match="rank 1 never"):
            _C_torch.ClawcommBackend(store, 0, ws, datetime.timedelta(seconds=0.5))
        store.set("partial setup over", "1")
    else:
        store.wait(["partial setup over"], timeout)
    start = time.monotonic()
    backend = _C_torch.ClawcommBackend(store, rank, ws, timeout)
    x = torch.full((4,), float(rank + 1))
    backend.allreduce([x]).wait()
    return x[0].item(), time.monotonic() - start


def test_a_store_reused_after_a_setup_that_timed_out(tmp_path):
    """The setup that timed out left the arrival count one short: the next
    group's ranks landed in two generations and waited for each other until
    the timeout, each naming the other as the one that never came."""
    got = run_ranks(
        _a_group_after_a_partial_setup, 2, str(tmp_path / "store"), init=False, timeout=60
    )
    for value, elapsed in got:
        assert value == 3.0
        assert elapsed < TIMEOUT, elapsed


# --- an address that is not this host's -------------------------------------


def _bad_address(rank, ws, store_path):
    start = time.monotonic()
    try:
        _init(rank, ws, store_path)
    except Exception as e:  # noqa: BLE001
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_an_address_that_is_not_this_hosts_is_a_clear_error(tmp_path):
    results = run_ranks(
        _bad_address, 2, str(tmp_path / "store"),
        env={"CLAWCOMM_TRANSPORT": "tcp"}, rank_env=[{}, {"CLAWCOMM_SOCKET_ADDR": "192.0.2.1"}],
        init=False, timeout=60,
    )  # fmt: skip
    error, elapsed = results[1]
    assert "cannot listen on 192.0.2.1" in error and "CLAWCOMM_SOCKET_ADDR" in error, error
    error, elapsed = results[0]
    assert "rank 1 failed" in error and "cannot listen on 192.0.2.1" in error, error
    assert elapsed < TIMEOUT + 1.0, elapsed
