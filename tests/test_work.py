"""Work and future semantics through torch.distributed: a completed future
means a completed Work, waits keep to the timeout they are given, and the
last reference to a communicator never waits on the GIL it holds."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

import clawcomm
from clawcomm.launch import run_ranks


def _future_then_work(rank, ws):
    seen = []
    for _ in range(20):
        t = torch.ones(1000)
        work = dist.all_reduce(t, async_op=True)
        fut = work.get_future()
        # Runs inside the future's completion, on whichever thread completes it.
        done = fut.then(lambda f, w=work: seen.append(w.is_completed()))
        done.wait()
        work.wait()
    return seen


def test_a_completed_future_means_a_completed_work():
    """Every op handed to the progress thread (CLAWCOMM_INLINE_BYTES=0), so
    the future completes there while the caller attaches its callback."""
    for seen in run_ranks(_future_then_work, 2, env={"CLAWCOMM_INLINE_BYTES": "0"}):
        assert seen == [True] * 20, seen


def _wait_inside_then(rank, ws):
    seen = []
    for _ in range(20):
        t = torch.ones(1000)
        work = dist.all_reduce(t, async_op=True)
        # On the progress thread, inside the op's own completion: the Work is
        # done there, so waiting for it returns at once.
        fut = work.get_future().then(
            lambda f, w=work: seen.append((w.wait(), w.is_completed(), w.exception() is None))
        )
        fut.wait()
        work.wait()
        seen.append(t[0].item())
    return seen


def test_a_future_callback_may_wait_for_its_own_work():
    """The engine marks an operation done before its completion callback
    runs (comm/request.h), so a then-callback of its future that waits for
    the Work returns (it used to wait for the callback it ran in: a hang on
    the progress thread, CLAWCOMM_INLINE_BYTES=0)."""
    results = run_ranks(_wait_inside_then, 2, env={"CLAWCOMM_INLINE_BYTES": "0"}, timeout=60)
    for seen in results:
        assert seen == [(True, True, True), 2.0] * 20, seen


def _coalesced_wait(rank, ws):
    bufs = [torch.empty(4) for _ in range(3)]
    if rank == 1:  # one send every 0.7 s: each receive alone waits less than 1 s
        for i, b in enumerate(bufs):
            time.sleep(0.7)
            dist.send(b, 0, tag=i)
        return None
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.irecv, b, 1, tag=i) for i, b in enumerate(bufs)]
    )
    start = time.monotonic()
    try:
        for w in works:
            w.wait(timeout=datetime.timedelta(seconds=1))
        return ("returned", len(works), time.monotonic() - start)
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, len(works), time.monotonic() - start, str(e)[:200])


def test_a_coalesced_wait_keeps_to_its_timeout():
    """Three coalesced receives that complete 0.7 s apart, waited for with a
    1 s timeout: a timeout error after about 1 s, not one timeout per
    receive (2.1 s and a return)."""
    got = run_ranks(_coalesced_wait, 2, timeout=60)[0]
    assert got[0] != "returned" and got[1] == 1, got
    assert got[2] < 1.6, got


def _last_reference_from_python(rank, ws):
    dist.all_reduce(torch.ones(4))
    engine = clawcomm.engine_of()
    if rank == 0:
        buf = torch.empty(1 << 16)
        work = dist.irecv(buf, src=1)  # never sent: pending until the shutdown
        del buf, work  # only the engine's request holds the tensor (and its Python object)
    time.sleep(0.5)
    dist.destroy_process_group()
    t0 = time.monotonic()
    del engine  # the last reference: the communicator shuts down here
    return time.monotonic() - t0


def test_the_last_reference_dropped_from_python_never_waits_on_the_gil():
    """Shutting the communicator down joins its progress thread, which frees
    the pending receive's tensor, whose Python object torch frees under the
    GIL: Python dropping the last reference must not hold the GIL meanwhile
    (it did, and the rank hung at exit)."""
    for took in run_ranks(_last_reference_from_python, 2, timeout=60):
        assert took < 5, took


# --- blocking calls run where they are waited for ---------------------------

BIG = 1 << 20  # 4 MiB of float32: above CLAWCOMM_INLINE_BYTES


def _async_returns_at_once(rank, ws):
    a = torch.full((BIG,), float(rank + 1))
    b = torch.full((BIG,), float(rank + 10))
    if rank == 1:
        time.sleep(1.0)  # rank 0's calls find no partner for a second
    start = time.monotonic()
    work = dist.all_reduce(a, async_op=True)
    returned = time.monotonic() - start
    pending = not work.is_completed()
    dist.all_reduce(b)  # blocking, queued behind `a`: runs after it
    work.wait()
    return returned, pending, a[::4096].tolist(), b[::4096].tolist()


def test_an_async_collective_returns_at_once_and_a_blocking_one_keeps_its_place():
    """A blocking collective (async_op=False) runs on the caller's thread at
    any size; an asynchronous one must still return at once, its bytes
    moved by the progress thread while the caller goes on (what overlap in
    DDP and the trainer rests on), and a blocking call queued behind it
    must wait its turn."""
    results = run_ranks(_async_returns_at_once, 2)
    returned, pending, a, b = results[0]
    assert returned < 0.5, f"all_reduce(async_op=True) took {returned:.2f} s to return"
    assert pending, "the async all_reduce completed before its peer joined"
    for _, _, a, b in results:
        assert a == [3.0] * len(a) and b == [21.0] * len(b)


def _into_leaves(rank, ws):
    # Leaves that require grad, written in place under no_grad as the
    # trainer's first broadcast does; non-contiguous, so each result is
    # copied back into the caller's tensor on the thread that finishes it.
    p = torch.full((6, 4), float(rank + 1)).t().requires_grad_()
    q = torch.full((6, 4), float(rank + 1)).t().requires_grad_()
    with torch.no_grad():
        dist.broadcast(p, 0)
        dist.all_reduce(q, async_op=True).wait()
    return p.detach().unique().tolist(), q.detach().unique().tolist(), p.is_leaf


def test_results_reach_leaves_that_require_grad_from_the_progress_thread():
    """A collective finished on the progress thread (CLAWCOMM_INLINE_BYTES=0,
    or any asynchronous call while two groups are alive) copies its result
    into the caller's tensor there, where autograd's grad mode is the
    thread's own, not the caller's no_grad: on a leaf that requires grad
    the copy must not go through autograd (the CUDA trainer's first
    broadcast failed so on an H100)."""
    for p, q, leaf in run_ranks(_into_leaves, 2, env={"CLAWCOMM_INLINE_BYTES": "0"}):
        assert p == [1.0] and q == [3.0] and leaf


# --- a blocking call's Work is made finished --------------------------------


def _blocking_work(rank, ws):
    # async_op=False through the process group, as torch's Python API calls
    # it: the Work comes back finished (torch/work.h's FinishedWork), its
    # result and future the caller's tensors. A non-contiguous tensor's
    # result is copied back before the call returns.
    pg = dist.distributed_c10d._get_default_group()
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    seen = []
    for t in (torch.full((4,), float(rank + 1)), torch.full((4, 3), float(rank + 1)).t()):
        work = pg.allreduce([t], opts)
        done = (work.is_completed(), work.is_success(), work.exception() is None)
        values = t.unique().tolist()  # before wait(): the call itself waited
        work.wait()
        result = [r.unique().tolist() for r in work.result()]
        future = [r.unique().tolist() for r in work.get_future().value()]
        seen.append((done, values, result, future))
    return seen


def test_a_blocking_call_returns_a_finished_work_with_its_results():
    """A blocking CPU call has ended when it returns (inline, or waited for
    when queued: CLAWCOMM_INLINE_BYTES=0): its Work is complete, and its
    result and future give the caller's tensors with the sum."""
    for env in ({}, {"CLAWCOMM_INLINE_BYTES": "0"}):
        for seen in run_ranks(_blocking_work, 2, env=env, timeout=60):
            assert seen == [((True, True, True), [3.0], [[3.0]], [[3.0]])] * 2, (env, seen)


def _blocking_mismatch(rank, ws):
    pg = dist.distributed_c10d._get_default_group()
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    work = pg.allreduce([torch.ones(4 + rank)], opts)  # rank 1 passes 5 elements
    try:
        work.wait()
        raised = ""
    except Exception as e:  # noqa: BLE001 - the test reports what was raised
        raised = str(e)
    return work.is_completed(), work.is_success(), work.exception() is not None, raised


def test_a_blocking_call_that_fails_reports_it_through_its_work():
    """The error of a blocking call is its Work's: wait() raises it, naming
    the op, and is_success() says no, as when the Work waited itself."""
    for completed, success, has_error, raised in run_ranks(_blocking_mismatch, 2, timeout=60):
        assert completed and not success and has_error, (completed, success, has_error)
        assert "all_reduce" in raised, raised
