"""Time estimates (Communicator::startEstimate, torch's ``_time_estimator``):
inside the block nothing moves and no tensor changes, each call completes
at once, and the estimate is the cost model's time for the algorithms the
calls would have run, checked against clawcomm.cost_model's formulas (the
Python twin of csrc/algorithms/costs.cc) and against a calibrated model
file."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _time_estimator

import clawcomm
from clawcomm.cost_model import CostModel, Topology, predict
from clawcomm.launch import run_ranks


def _estimate(fn, group=None) -> float:
    with _time_estimator(group=group, device=torch.device("cpu")) as cm:
        fn()
    return cm.estimated_time


def _estimates_match_the_model(rank, n, model_path):
    model = CostModel.load(model_path) if model_path else CostModel()
    topo = Topology(1, n)
    backend = clawcomm.backend_of(dist.group.WORLD)
    problems = []
    seq = backend._get_sequence_number_for_group()
    for nbytes in (64 << 10, 1 << 20, 16 << 20):
        count = nbytes // 4
        t = torch.full((count,), float(rank))
        before = t.clone()
        got = _estimate(lambda t=t: dist.all_reduce(t))
        want = predict("all_reduce", backend.all_reduce_algorithm(nbytes), nbytes, topo, model)
        if not math.isclose(got, want * 1e6, rel_tol=1e-4):
            problems.append(f"all_reduce {nbytes}: {got} us, model {want * 1e6} us")
        if not torch.equal(t, before):
            problems.append(f"all_reduce {nbytes} changed its tensor")
        out = torch.full((count,), -1.0)
        shard = t[: count // n]
        got = _estimate(lambda out=out, shard=shard: dist.all_gather_single(out, shard))
        want = predict("all_gather", "auto", nbytes, topo, model)
        if not math.isclose(got, want * 1e6, rel_tol=1e-4):
            problems.append(f"all_gather {nbytes}: {got} us, model {want * 1e6} us")
        if not torch.all(out == -1):
            problems.append(f"all_gather {nbytes} wrote its output")
        # Estimates add up.
        one = _estimate(lambda t=t: dist.all_reduce(t))
        three = _estimate(lambda t=t: [dist.all_reduce(t) for _ in range(3)])
        if not math.isclose(three, 3 * one, rel_tol=1e-5):
            problems.append(f"three all_reduces {three} us, one {one} us")
    if backend._get_sequence_number_for_group() != seq:
        problems.append("estimates took sequence numbers")
    # Collectives run as usual after the block.
    t = torch.ones(5)
    dist.all_reduce(t)
    if t[0] != n:
        problems.append(f"all_reduce after the block: {t[0]}")
    return problems


@pytest.mark.parametrize("n", [2, 4])
def test_estimates_are_the_cost_models_and_move_nothing(n):
    assert run_ranks(_estimates_match_the_model, n, None) == [[]] * n


def test_estimates_follow_a_calibrated_model_file(tmp_path):
    path = tmp_path / "model.json"
    slow = {
        "shm_alpha": 20e-6,
        "shm_beta": 1 / 1e9,
        "net_alpha": 80e-6,
        "net_beta": 1 / 0.5e9,
        "gamma": 1 / 1e9,
    }
    path.write_text(json.dumps(slow))
    results = run_ranks(
        _estimates_match_the_model, 2, str(path), env={"CLAWCOMM_COST_MODEL": str(path)}
    )
    assert results == [[], []]


def _every_call(rank, n):
    """Every kind of call prices and completes, whatever the other ranks
    do: rank 0 alone estimates a send to rank 1, which never receives it."""
    t = torch.ones(1 << 16)
    outs = [torch.empty(1 << 16) for _ in range(n)]
    calls = {
        "broadcast": lambda: dist.broadcast(t, src=0),
        "reduce": lambda: dist.reduce(t, dst=0),
        "all_gather": lambda: dist.all_gather(outs, t),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(t[: (1 << 16) // n], t),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(t), t),
        "barrier": lambda: dist.barrier(),
        "async": lambda: dist.all_reduce(t, async_op=True).wait(),
    }
    if rank == 0:
        calls["send"] = lambda: dist.send(t, dst=1)
    got = {k: _estimate(f) for k, f in calls.items()}
    dist.barrier()
    return got


def test_every_call_is_priced_and_nothing_waits_on_a_peer():
    for got in run_ranks(_every_call, 2, timeout=60):
        assert all(v > 0 for v in got.values()), got
    send = run_ranks(_every_call, 2, timeout=60)[0]["send"]
    # One 256 KiB message over shared memory: alpha + bytes * beta.
    m = CostModel()
    assert send == pytest.approx((m.shm_alpha + (1 << 18) * m.shm_beta) * 1e6, rel=1e-4)


def _engine_estimate(rank, n):
    eng = clawcomm.engine_of()
    a = np.full(1 << 18, rank, np.float32)
    eng.start_estimate()
    eng.all_reduce(a)
    seconds = eng.end_estimate()
    return seconds, float(a[0])


def test_the_engine_estimates_without_torch():
    for rank, (seconds, first) in enumerate(run_ranks(_engine_estimate, 2)):
        assert seconds > 0 and first == rank


def test_the_backend_says_it_estimates():
    def fn(rank, n):
        return dist.group.WORLD._get_backend(torch.device("cpu")).supports_time_estimate

    assert run_ranks(fn, 2) == [True, True]
