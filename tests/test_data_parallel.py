"""clawcomm.parallel.DataParallel against single-process training on the
global batch and against torch DDP in the same ranks: with and without
overlap, with accumulation, unused parameters, compression, rebuilt
buckets, other groups; and its errors."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from clawcomm.compression import Compressor, register_compressor
from clawcomm.launch import RankFailure, run_ranks
from clawcomm.parallel import DataParallel

BATCH = 6  # per rank and micro-step: odd shards on purpose


class Net(nn.Module):
    """Layers registered in one order and applied in another (so the ready
    order differs from reverse registration), with an optional branch."""

    def __init__(self, extra=False):
        super().__init__()
        self.tail = nn.Linear(24, 3)
        self.head = nn.Linear(10, 24)
        self.mid = nn.Linear(24, 24)
        self.extra = nn.Linear(24, 24) if extra else None

    def forward(self, x, use_extra=False):
        h = torch.tanh(self.head(x))
        h = torch.tanh(self.mid(h))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.tail(h)


def _data(step, world, micro=0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(BATCH * world, 10, generator=g), torch.randn(BATCH * world, 3, generator=g)


def _uses_extra(case, step, rank):
    if case == "unused_everywhere":
        return False
    if case == "unused_on_some":
        return rank == 0 and step % 2 == 0
    return False


def _train(rank, world, opts):
    """Trains three copies: DataParallel, torch DDP (same group), and one
    model on the global batch in this process; returns their parameters."""
    case = opts.get("case", "plain")
    unused = case.startswith("unused")
    torch.manual_seed(0)
    base = Net(extra=unused)
    steps, micro = opts.get("steps", 4), opts.get("accumulation", 1)
    group = dist.new_group(backend="gloo") if opts.get("gloo") else None
    dp = DataParallel(
        copy.deepcopy(base) if rank == 0 else Net(extra=unused),  # rank 0's weights must win
        process_group=group, bucket_cap_mb=0.003, first_bucket_mb=0.001,
        overlap=opts.get("overlap", True), find_unused_parameters=unused,
        compression=opts.get("compression"), accumulation_steps=opts.get("accum_steps", 1),
        compression_warmup_steps=opts.get("warmup", 0),
    )  # fmt: skip
    ddp = DDP(copy.deepcopy(base), process_group=group, find_unused_parameters=unused)
    ref = copy.deepcopy(base)
    models = {"dp": dp, "ddp": ddp, "ref": ref}
    optims = [torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.01) for m in models.values()]
    lo, hi = rank * BATCH, (rank + 1) * BATCH
    for step in range(steps):
        for k in range(micro):
            x, y = _data(step, world, k)
            extra = _uses_extra(case, step, rank)
            last = k == micro - 1
            for name in ("dp", "ddp"):
                m = models[name]
                ctx = m.no_sync() if (not last and opts.get("no_sync")) else _null()
                with ctx:
                    loss = nn.functional.mse_loss(m(x[lo:hi], use_extra=extra), y[lo:hi]) / micro
                    loss.backward()
            # The reference: the mean over ranks of each rank's loss.
            for r in range(world):
                xr, yr = x[r * BATCH : (r + 1) * BATCH], y[r * BATCH : (r + 1) * BATCH]
                out = ref(xr, use_extra=_uses_extra(case, step, r))
                (nn.functional.mse_loss(out, yr) / (micro * world)).backward()
        for opt in optims:
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)  # both ways of zeroing
    result = {k: [p.detach().clone() for p in m.parameters()] for k, m in models.items()}
    result["buckets"] = [b.params for b in dp.buckets]
    result["choice"] = dp.overlap_choice
    return result


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _assert_close(results, atol=1e-6, against=("ref", "ddp")):
    for r, res in enumerate(results):
        for other in against:
            for i, (a, b) in enumerate(zip(res["dp"], res[other], strict=True)):
                msg = f"rank {r} param {i} vs {other}"
                torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=msg)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_matches_single_process_and_ddp(world_size, overlap):
    _assert_close(run_ranks(_train, world_size, {"overlap": overlap}))


@pytest.mark.parametrize("world_size", [2, 3])
def test_auto_overlap_switches_mid_run_and_still_matches(world_size):
    """overlap="auto" (the default): after the first step, eight trial
    steps alternate the two ways; every rank then keeps the same one, and
    the weights follow single-process training throughout."""
    results = run_ranks(_train, world_size, {"overlap": "auto", "steps": 12})
    _assert_close(results)
    choices = [r["choice"] for r in results]
    assert choices[0] is not None and choices[0]["trial_steps"] == 4
    assert all(c == choices[0] for c in choices), choices


def _choose(rank, world, during_ms, after_ms):
    from clawcomm.parallel.overlap_choice import OverlapChooser

    chooser = OverlapChooser(None, rank, trial_steps=2)
    decided = None
    while decided is None:
        overlap = chooser.begin()
        time.sleep((during_ms if overlap else after_ms)[rank] / 1e3)
        decided = chooser.end()
    return decided, chooser.choice


@pytest.mark.parametrize(
    "during, after, want",
    [
        ((5, 5), (60, 60), True),  # the backward waits: overlap hides the reduction
        ((60, 60), (5, 5), False),  # CPU-bound: overlap slows backward down
        ((5, 80), (40, 40), False),  # one slow rank decides for all: max(5, 80) > 40
    ],
)
def test_the_faster_way_wins_by_the_slowest_rank(during, after, want):
    got = run_ranks(_choose, 2, during, after)
    assert [g[0] for g in got] == [want, want]
    assert got[0][1] == got[1][1]
    assert got[0][1]["during_backward_ms"] >= max(during)


def test_matches_on_a_gloo_group():
    _assert_close(run_ranks(_train, 2, {"gloo": True}))


@pytest.mark.parametrize("no_sync", [True, False])
def test_gradient_accumulation(no_sync):
    """Three micro-batches per step, each loss divided by 3: the same as one
    step on the whole effective batch; by no_sync() or accumulation_steps."""
    opts = {"accumulation": 3, "no_sync": no_sync, "accum_steps": 1 if no_sync else 3}
    _assert_close(run_ranks(_train, 2, opts))  # DDP reduces every micro-step: the same sum


@pytest.mark.parametrize("case", ["unused_everywhere", "unused_on_some"])
@pytest.mark.parametrize("overlap", [True, False])
def test_unused_parameters(case, overlap):
    """A branch no rank uses keeps grad None (so weight decay leaves it
    alone, as in one process); one used by rank 0 only gets rank 0's
    gradient averaged with zeros."""
    _assert_close(run_ranks(_train, 2, {"case": case, "overlap": overlap}))


def test_buckets_are_rebuilt_in_ready_order():
    results = run_ranks(_train, 2, {"steps": 2})
    # Registration: tail (0, 1), head (2, 3), mid (4, 5); backward readies
    # tail first, then mid, then head.
    assert results[0]["buckets"] == results[1]["buckets"]
    order = [i for b in results[0]["buckets"] for i in b]
    assert order.index(1) < order.index(5) < order.index(3)


def _residuals_across_rebuild(rank, world):
    torch.manual_seed(0)
    dp = DataParallel(Net(), compression="topk:0.3", bucket_cap_mb=0.003, first_bucket_mb=0.001)

    def per_param():
        out = {}
        for b in dp.buckets:
            r = dp.compression_state.residuals[b.index]
            for t, i in enumerate(b.params):
                out[i] = b.segment(r, t).clone()
        return out

    seen = {}
    rebuild = dp._rebuild

    def traced():
        seen["before"], layout = per_param(), [b.params for b in dp.buckets]
        rebuild()
        seen["after"], seen["moved"] = per_param(), layout != [b.params for b in dp.buckets]

    dp._rebuild = traced
    dp(torch.randn(BATCH, 10)).square().mean().backward()
    return seen


def test_error_feedback_residuals_follow_parameters_into_rebuilt_buckets():
    for seen in run_ranks(_residuals_across_rebuild, 2):
        assert seen["moved"]  # the layout did change
        assert sum(int((r != 0).sum()) for r in seen["before"].values()) > 100
        for i, before in seen["before"].items():
            assert torch.equal(seen["after"][i], before), i


def test_lossless_compression_matches_and_fp16_is_close():
    _assert_close(run_ranks(_train, 2, {"compression": "topk:1.0"}), against=("ref",))
    _assert_close(run_ranks(_train, 2, {"compression": "fp16"}), atol=2e-3, against=("ref",))


def test_compression_warm_up_steps_are_dense():
    """Warm-up over all 4 steps: top-k 10% never runs, the result is exact;
    with 1 warm-up step it runs and the result moves away."""
    _assert_close(run_ranks(_train, 2, {"compression": "topk:0.1", "warmup": 4}))
    results = run_ranks(_train, 2, {"compression": "topk:0.1", "warmup": 1})
    with pytest.raises(AssertionError):
        _assert_close(results, against=("ref",))


def _sparse_converges(rank, world):
    torch.manual_seed(0)
    target = torch.randn(40, 1)
    model = DataParallel(nn.Linear(40, 1, bias=False), compression="topk:0.1")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = None
    for step in range(60):
        x = torch.randn(16, 40, generator=torch.Generator().manual_seed(step * 7 + rank))
        loss = nn.functional.mse_loss(model(x), x @ target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        first = first if first is not None else loss.item()
    return first, loss.item(), model.compression_state.step


def test_sparse_compression_converges_with_error_feedback():
    for first, last, steps in run_ranks(_sparse_converges, 2):
        assert last < 0.05 * first and steps == 60


def _unused_without_flag(rank, world):
    dp = DataParallel(Net(extra=True))
    x = torch.randn(4, 10)
    dp(x).sum().backward()  # `extra` gets no gradient


def test_unused_parameter_without_the_flag_is_a_clear_error():
    with pytest.raises(RankFailure, match=r"parameters 'extra.weight', 'extra.bias' received no "):
        run_ranks(_unused_without_flag, 2)


class _Recording(Compressor):
    """Records, for each bucket it reduces, the thread and whether backward
    had already passed the layer nearest the input (_WaitInBackward)."""

    spec = "recording"
    started = threading.Event()
    passed = False
    calls: list = []

    def all_reduce(self, tensor, state, key, group):
        _Recording.calls.append((threading.current_thread().name, _Recording.passed))
        _Recording.started.set()
        dist.all_reduce(tensor, group=group)


class _WaitInBackward(torch.autograd.Function):
    """Identity whose backward (with overlap) waits until a bucket's
    reduction has begun: that can only happen if buckets are reduced while
    backward is still running."""

    @staticmethod
    def forward(ctx, x, wait):
        ctx.wait = wait
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.wait and not _Recording.started.wait(timeout=20):
            raise RuntimeError("no bucket was reduced while backward was running")
        _Recording.passed = True
        return grad, None


def _overlap_happens(rank, world, overlap):
    register_compressor("recording", lambda *a, spec: _Recording())
    model = DataParallel(
        nn.ModuleList([nn.Linear(10, 10), nn.Linear(10, 10)]), compression="recording",
        overlap=overlap, bucket_cap_mb=0.0001, first_bucket_mb=0.0001,
    )  # fmt: skip
    first, last = model.module
    last(_WaitInBackward.apply(first(torch.randn(4, 10)), overlap)).sum().backward()
    return _Recording.calls


@pytest.mark.parametrize("overlap", [True, False])
def test_buckets_are_reduced_on_another_thread_while_backward_runs(overlap):
    """With overlap, the last layer's bucket is reduced on the reduction
    thread before backward reaches the first layer; without, every bucket is
    reduced on the training thread once backward is done."""
    for calls in run_ranks(_overlap_happens, 2, overlap):
        assert len(calls) == 4, calls  # a bucket per weight and bias
        if overlap:
            assert calls[0] == ("clawcomm-buckets", False), calls
            assert all(thread == "clawcomm-buckets" for thread, _ in calls)
        else:
            assert calls == [("MainThread", True)] * 4, calls


def _bad(rank, world, what):
    if what == "differ":
        DataParallel(nn.Linear(4, 4 + rank))
    elif what == "cap":
        DataParallel(nn.Linear(4, 4), bucket_cap_mb=0)
    elif what == "first":
        DataParallel(nn.Linear(4, 4), first_bucket_mb=-1)
    elif what == "accum":
        DataParallel(nn.Linear(4, 4), accumulation_steps=0)
    elif what == "dtype":
        DataParallel(nn.Linear(4, 4).double(), compression="fp16")
    elif what == "spec":
        DataParallel(nn.Linear(4, 4), compression="topk:2.5")
    elif what == "warmup":
        DataParallel(nn.Linear(4, 4), compression="fp16", compression_warmup_steps=-2)
    elif what == "frozen":
        DataParallel(nn.Linear(4, 4).requires_grad_(False))
    elif what == "overlap":
        DataParallel(nn.Linear(4, 4), overlap="sometimes")


@pytest.mark.parametrize(
    "what,message",
    [
        ("differ", r"parameters differ across ranks: rank 0 has 2 parameters \(20 elements\)"),
        ("cap", r"bucket_cap_mb must be a positive number, got 0"),
        ("first", r"first_bucket_mb must be a positive number, got -1"),
        ("accum", r"accumulation_steps must be an int >= 1, got 0"),
        ("overlap", r"overlap must be True, False or 'auto', got 'sometimes'"),
        (
            "dtype",
            r"compression 'fp16' needs float32 gradients, parameter 'weight' is torch.float64",
        ),  # fmt: skip
        ("spec", r"topk:2.5"),
        ("frozen", r"no parameters that require gradients"),
        ("warmup", r"compression_warmup_steps must be an int >= 0, got -2"),
    ],
)
def test_bad_configurations_are_refused(what, message):
    with pytest.raises(RankFailure, match=message) as info:
        run_ranks(_bad, 2, what)
    assert len(info.value.errors) == 2  # every rank says so, none hangs


def _killed_between_steps(rank, world):
    import os
    import signal

    model = DataParallel(nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)))
    model(torch.randn(2, 512)).sum().backward()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        model(torch.randn(2, 512)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_dead_peer_fails_backward_on_every_survivor():
    results = run_ranks(_killed_between_steps, 3, pg_timeout=20, timeout=90, allow_failures=True)
    assert isinstance(results[2], RankFailure)
    for text in results[:2]:
        assert "rank 2" in text, text


# ---------------------------------------------------------------------------
# The reduction thread on its own.


def test_reduction_thread_runs_jobs_in_order_and_reports_the_first_error():
    from clawcomm.parallel.worker import ReductionThread

    worker, ran = ReductionThread(), []

    def fail(tag):
        ran.append(tag)
        raise ValueError(tag)

    worker.submit(lambda: ran.append(1))
    worker.submit(lambda: fail("first"))
    worker.submit(lambda: fail("second"))
    worker.submit(lambda: ran.append(4))
    with pytest.raises(ValueError, match="first"):
        worker.wait()
    assert ran == [1, "first", "second", 4]  # jobs after a failure still ran
    worker.wait()  # the error was reported once
    worker.close()


def test_reduction_thread_frees_each_job_and_is_gone_after_close():
    """The thread must neither keep a job's tensors alive until its next job
    nor outlive close(): freeing a tensor on a daemon thread while the
    interpreter finalises aborts the process inside torch's deallocator."""
    import weakref

    from clawcomm.parallel.worker import ReductionThread

    class Job:
        def __init__(self):
            self.tensor = torch.ones(1000)

        def __call__(self):
            self.tensor.mul_(2)

    worker = ReductionThread()
    job = Job()
    freed = weakref.ref(job)
    worker.submit(job)
    del job
    worker.wait()
    assert freed() is None
    worker.close()
    assert not worker._thread.is_alive()


def test_reduction_thread_close_does_not_wait_forever_for_a_stuck_job():
    from clawcomm.parallel.worker import ReductionThread

    worker, release = ReductionThread(), threading.Event()
    worker.submit(release.wait)  # as a collective whose peer never comes
    t0 = time.perf_counter()
    worker.close(timeout=0.2)
    assert time.perf_counter() - t0 < 5
    assert worker._thread.is_alive()
    release.set()
    worker._thread.join(5)
    assert not worker._thread.is_alive()


def _adoption(rank, world, overlap):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 4))
    dp = DataParallel(model, bucket_cap_mb=0.5, first_bucket_mb=0.5, overlap=overlap)
    weight = model[0].weight  # 512 KiB: a bucket of its own
    incoming = []
    weight.register_hook(lambda g: incoming.append(g.data_ptr()))
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    seen = []
    for step in range(3):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(step * 2 + rank))
        dp(x).square().mean().backward()
        bucket = next(b for b in dp.buckets if b.params == [0])
        seen.append(
            (incoming[-1] == weight.grad.data_ptr() == bucket.flat.data_ptr(), len(bucket.params))
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
    return seen


@pytest.mark.parametrize("overlap", [True, False])
def test_a_replaced_gradient_is_adopted_by_its_bucket_not_copied(overlap):
    """zero_grad(set_to_none=True): autograd's fresh gradient becomes the
    one-parameter bucket's buffer (same memory as the tensor autograd made),
    and is the averaged gradient the optimizer reads."""
    for seen in run_ranks(_adoption, 2, overlap):
        assert seen == [(True, 1)] * 3, seen
