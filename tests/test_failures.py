"""Errors instead of hangs: dead peers, mismatched collectives, timeouts, and
shared-memory segments that never outlive the job."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from clawcomm.launch import RankFailure, run_ranks

TRANSPORTS = [{"CLAWCOMM_TRANSPORT": "shm"}, {"CLAWCOMM_TRANSPORT": "tcp"}]


def _segments():
    return {f for f in os.listdir("/dev/shm") if f.startswith("clawcomm-")}


def _error_text(result) -> str:
    assert isinstance(result, RankFailure), f"expected this rank to fail, it returned {result!r}"
    return next(iter(result.errors.values()))


# --- a rank killed mid-collective ------------------------------------------


def _killed_mid_collective(rank, ws):
    big = torch.ones(4 * 1024 * 1024)
    dist.all_reduce(big)  # everybody is connected and working
    if rank == ws - 1:
        dist.all_reduce(big, async_op=True)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    errors = []
    for _ in range(2):  # the pending op and a later one must both fail
        try:
            for _ in range(1000):
                dist.all_reduce(big)
            errors.append("no error")
        except Exception as e:  # noqa: BLE001
            errors.append(str(e))
    return errors, time.monotonic() - start


@pytest.mark.parametrize(
    "env",
    TRANSPORTS
    + [
        {"CLAWCOMM_TRANSPORT": "shm", "CLAWCOMM_ALGO": "all_reduce:oneshot"},
        {"CLAWCOMM_TRANSPORT": "shm", "CLAWCOMM_ALGO": "all_reduce:twoshot"},
    ],
    ids=["shm", "tcp", "shm-oneshot", "shm-twoshot"],
)
def test_killed_rank_fails_every_survivor_naming_it(env):
    before = _segments()
    results = run_ranks(
        _killed_mid_collective, 3, env=env, pg_timeout=20, timeout=90, allow_failures=True
    )
    assert isinstance(results[2], RankFailure)  # the killed rank
    for rank in (0, 1):
        errors, elapsed = results[rank]
        assert all("rank 2" in e for e in errors), errors
        assert "aborted by an earlier error" in errors[1] or "rank 2" in errors[1]
        assert elapsed < 20, f"rank {rank} took {elapsed:.1f}s to notice"
    assert _segments() <= before


def test_a_peer_that_exits_right_after_its_last_write_is_not_taken_for_dead():
    # The health check looks at the peer's process before its ring: looked
    # at the other way round, a peer that wrote its last frame and exited
    # between the two looks seemed to have died with nothing written.
    from clawcomm import _C

    assert _C._peer_dies_just_after_its_last_write() is False


# --- mismatched collectives --------------------------------------------------


def _mismatch(rank, ws, kind):
    t = torch.ones(4)
    odd = rank == ws - 1
    if kind == "op":
        if odd:
            dist.broadcast(t, 0)
        else:
            dist.all_reduce(t)
    elif kind == "count":
        dist.all_reduce(torch.ones(5) if odd else t)
    elif kind == "dtype":
        dist.all_reduce(t.double() if odd else t)
    elif kind == "redop":
        dist.all_reduce(t, dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM)
    elif kind in ("root", "root-large"):
        # root-large: 2 MiB, by single copy where the broadcast is direct.
        dist.broadcast(torch.ones(1 << 19) if kind == "root-large" else t, 1 if odd else 0)
    return "no error"


@pytest.mark.parametrize("kind", ["op", "count", "dtype", "redop", "root"])
def test_mismatched_collectives_fail_on_every_rank(kind):
    results = run_ranks(_mismatch, 2, kind, pg_timeout=10, timeout=60, allow_failures=True)
    texts = [_error_text(r) for r in results]
    # The rank that sees the mismatch names both sides; the other learns of it.
    assert any(" called " in t for t in texts), texts
    for t in texts:
        assert "DistBackendError" in t and "clawcomm::" in t, t


@pytest.mark.parametrize("kind", ["op", "count", "dtype", "redop", "root"])
def test_mismatch_on_one_of_three_ranks_never_hangs(kind):
    # Rank 2 disagrees. A rank whose frames cross a conflicting frame reports
    # the mismatch at once; a rank left waiting for a frame that the other
    # op never sends fails at the group's timeout, and aborts the rest. A rank
    # whose own part was consistent (rank 1 of a broadcast from 0) may finish.
    results = run_ranks(_mismatch, 3, kind, pg_timeout=3, timeout=60, allow_failures=True)
    assert isinstance(results[2], RankFailure), results[2]
    failed = [r for r in results if isinstance(r, RankFailure)]
    assert len(failed) >= 2
    for r in failed:
        text = _error_text(r)
        assert any(k in text for k in (" called ", "timed out", "aborted", "shut down")), text


@pytest.mark.parametrize("kind", ["root", "root-large"])
def test_direct_broadcast_with_two_roots_never_hangs(kind):
    # Ranks 0 and 1 broadcast from 0, rank 2 from 1: rank 0 waits for rank
    # 2's acknowledgement and rank 2 for rank 1's data, until the timeout.
    env = {"CLAWCOMM_ALGO": "broadcast:direct"}
    results = run_ranks(_mismatch, 3, kind, env=env, pg_timeout=3, timeout=60, allow_failures=True)
    assert isinstance(results[0], RankFailure) and isinstance(results[2], RankFailure), results
    for r in (results[0], results[2]):
        text = _error_text(r)
        assert any(k in text for k in (" called ", "timed out", "aborted", "shut down")), text


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
@pytest.mark.parametrize("kind", ["op", "count", "dtype"])
def test_a_mismatched_mesh_all_reduce_never_hangs(kind, algo):
    # Every rank sends to every peer at once: the ranks that receive rank
    # 2's frames name the mismatch, the rest fail by abort or timeout.
    env = {"CLAWCOMM_ALGO": f"all_reduce:{algo}"}
    results = run_ranks(_mismatch, 3, kind, env=env, pg_timeout=3, timeout=60, allow_failures=True)
    failed = [r for r in results if isinstance(r, RankFailure)]
    assert len(failed) >= 2, results
    assert any(" called " in _error_text(r) for r in failed), results
    for r in failed:
        text = _error_text(r)
        assert any(k in text for k in (" called ", "timed out", "aborted", "shut down")), text


def test_count_mismatch_message_names_both_counts():
    texts = [_error_text(r) for r in run_ranks(_mismatch, 2, "count", allow_failures=True)]
    joined = "\n".join(texts)
    assert "of 4 float32 elements" in joined and "of 5 float32 elements" in joined, joined


# --- timeouts ---------------------------------------------------------------


def _late_rank(rank, ws):
    start = time.monotonic()
    if rank == 1:
        time.sleep(4)
    try:
        dist.all_reduce(torch.ones(3))
        return "no error", time.monotonic() - start
    except Exception as e:  # noqa: BLE001
        return str(e), time.monotonic() - start


def test_timeout_names_op_peer_and_wait():
    results = run_ranks(_late_rank, 2, pg_timeout=2, timeout=60)
    text, elapsed = results[0]
    assert "clawcomm::all_reduce" in text and "timed out" in text and "rank 1" in text, text
    assert "timeout after 2 s" in text, text
    assert 1.5 < elapsed < 4, elapsed
    # The late rank does not hang either: rank 0 aborted the communicator.
    late_text, late_elapsed = results[1]
    assert late_text != "no error" and late_elapsed < 10, results[1]


def _recv_nobody_sends(rank, ws):
    if rank == 0:
        try:
            dist.recv(torch.empty(2), 1)
        except Exception as e:  # noqa: BLE001
            return str(e)
    else:
        time.sleep(3)
    return "no error"


def test_recv_without_send_times_out():
    results = run_ranks(_recv_nobody_sends, 2, pg_timeout=1, timeout=60)
    assert "timed out" in results[0] and "rank 1" in results[0], results[0]


# --- shared memory never outlives the job -----------------------------------


def _all_killed(rank, ws):
    dist.all_reduce(torch.ones(1000))
    os.kill(os.getpid(), signal.SIGKILL)


def test_dev_shm_is_clean_after_every_rank_is_killed():
    before = _segments()
    run_ranks(_all_killed, 4, timeout=60, allow_failures=True)
    assert _segments() <= before


def test_dev_shm_is_clean_after_normal_exit():
    before = _segments()
    run_ranks(lambda r, w: dist.all_reduce(torch.ones(10)) and None, 3)
    assert _segments() <= before


# --- a rank that finishes and exits is not a dead rank ----------------------


def _exit_right_after_last_op(rank, ws):
    out = torch.empty(ws * 2_000_000)
    dist.all_gather_into_tensor(out, torch.full((2_000_000,), float(rank)))
    if rank == ws - 1:
        os._exit(0)  # no destroy_process_group: peers must still finish reading its frames
    return out.view(ws, -1)[:, 0].tolist()


def test_rank_exiting_after_its_last_op_is_not_reported_dead():
    results = run_ranks(_exit_right_after_last_op, 3, allow_failures=True)
    assert isinstance(results[2], RankFailure)  # it never reported: it exited
    assert results[0] == results[1] == [0.0, 1.0, 2.0], results[:2]


SMALL_SHM_SCRIPT = """
import torch, torch.distributed as dist
from clawcomm.launch import RankFailure, run_ranks
def f(rank, n):
    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    return t[0].item()
try:
    print(run_ranks(f, 2, timeout=60, pg_timeout=10))
except RankFailure as e:
    print("FAILED:", list(e.errors.values())[0].strip().splitlines()[-1])
"""


def test_a_dev_shm_too_small_is_an_error_that_says_what_is_needed():
    """Used to be SIGBUS at the first write into a ring (tmpfs hands out
    pages lazily); the segment's pages are now reserved at setup."""
    import os
    import shutil
    import subprocess
    import sys

    if not shutil.which("unshare"):
        pytest.skip("needs unshare to mount a small /dev/shm")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = f"mount -t tmpfs -o size=4M tmpfs /dev/shm && {sys.executable} -c '{SMALL_SHM_SCRIPT}'"
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=root),
    )
    if "mount" in proc.stderr and "FAILED" not in proc.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
    assert "/dev/shm has no room for rank" in proc.stdout, proc.stdout + proc.stderr
    assert "CLAWCOMM_SHM_RING_BYTES=4194304" in proc.stdout, proc.stdout


# --- an idle rank sleeps, also with mixed transports -------------------------


def _context_switches() -> int:
    total = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    total += int(line.split()[1])
    return total


def _idle_wait(rank, ws):
    x = torch.ones(8)
    dist.all_reduce(x)  # connected, warm
    if rank == ws - 1:  # the rank on the other host keeps the others waiting
        time.sleep(1.5)
        dist.all_reduce(x)
        return None
    before, start = _context_switches(), time.monotonic()
    dist.all_reduce(x)  # waits ~1.5 s, on shm (rank 0-1) and TCP (to rank 2)
    return (_context_switches() - before) / (time.monotonic() - start)


def test_an_idle_rank_with_mixed_transports_blocks_instead_of_napping():
    """Ranks 0 and 1 share a host (shm), rank 2 is on another (TCP). A rank
    waiting on both used to nap in 0.5 ms steps: 2,000 wake-ups a second.
    It now sleeps on its doorbell, which a watcher thread rings when a TCP
    socket becomes ready: about 100 wake-ups a second (the health check)."""
    hosts = [{"CLAWCOMM_HOST_ID": h} for h in ("a", "a", "b")]
    rates = run_ranks(_idle_wait, 3, rank_env=hosts, timeout=60)
    for rate in rates[:2]:
        assert rate < 600, f"{rate:.0f} context switches per second while idle"


# --- the last reference dropped on the progress thread ----------------------


@pytest.mark.parametrize("small", [False, True], ids=["progress-thread", "inline"])
def test_the_last_reference_dropped_in_a_completion_callback_is_safe(small):
    """A thread cannot join itself: the communicator's destruction on its
    progress thread used to end the process (std::terminate from
    ~Communicator), and inside the callback of a small op run inline on the
    caller's thread it used to wait forever for that op to finish."""
    import subprocess
    import sys

    code = (
        "import time\n"
        "from clawcomm import _C\n"
        f"print(_C._drop_last_reference_in_callback(small={small}), flush=True)\n"
        "time.sleep(0.5)\n"  # the shutdown, handed to another thread, completes
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == ("caller, inline" if small else "progress thread"), p.stdout


# --- abort() from another thread -------------------------------------------


def _aborted_by_a_watchdog(rank, ws, how):
    import threading

    import clawcomm

    t = torch.ones(1000)
    dist.all_reduce(t)  # connected
    start = time.monotonic()
    if rank == 0:
        engine = clawcomm.engine_of()

        def watchdog():
            time.sleep(0.5)
            if how == "engine":
                engine.abort("the watchdog gave up")
            else:  # torch's own path: ProcessGroup -> Backend::abort()
                dist.distributed_c10d._abort_process_group()

        threading.Thread(target=watchdog, daemon=True).start()
        waiting = torch.empty(4)
        op = lambda: dist.recv(waiting, src=1)  # noqa: E731 - rank 1 never sends
    else:
        op = lambda: dist.all_reduce(t)  # noqa: E731 - rank 0 never joins it
    errors = []
    for _ in range(2):  # the wait in flight and a later op both fail
        try:
            op()
            errors.append(None)
        except (RuntimeError, ValueError) as e:  # torch's abort also drops the group
            errors.append(str(e))
    return time.monotonic() - start, errors


@pytest.mark.parametrize("how", ["engine", "torch"])
@pytest.mark.parametrize("env", TRANSPORTS, ids=["shm", "tcp"])
def test_abort_from_another_thread_fails_every_rank_at_once(env, how):
    """A 60 s group timeout, and a watchdog thread on rank 0 aborts after
    0.5 s: rank 0's blocked receive and rank 1's all-reduce both fail
    within 3 s, naming the abort, and so does every later op."""
    if how == "torch" and not hasattr(dist.distributed_c10d, "_abort_process_group"):
        pytest.skip("this torch has no _abort_process_group")
    results = run_ranks(_aborted_by_a_watchdog, 2, how, env=env, pg_timeout=60, timeout=120)
    for rank, (took, errors) in enumerate(results):
        assert took < 3, (rank, took, errors)
        assert all(errors), (rank, errors)
        # torch's _abort_process_group() also unregisters the group, so on
        # rank 0 the later op finds no group at all.
        named = errors if how == "engine" or rank == 1 else errors[:1]
        assert all("rank 0 aborted" in e for e in named), (rank, errors)
    if how == "engine":
        assert "the watchdog gave up" in results[0][1][0]


# --- the harness itself: a hung rank says where it hangs ---------------------


def _waits_in_a_named_function_forever(rank, ws):
    if rank == 1:
        _the_function_it_hangs_in()
    return rank


def _the_function_it_hangs_in():
    while True:
        time.sleep(0.05)


def test_a_hung_rank_is_reported_with_its_threads_stacks():
    results = run_ranks(
        _waits_in_a_named_function_forever, 2, init=False, timeout=3, allow_failures=True
    )
    assert results[0] == 0
    text = _error_text(results[1])
    assert "rank hung for more than 3 s" in text, text
    assert "_the_function_it_hangs_in" in text, text
