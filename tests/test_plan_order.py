"""What a schedule's order does to its passes (clawcomm/plan/pass_order.py):
the shapes it measures, every action run once in each order, the ratios
the prediction scales each pass by, and layers that wait left unmeasured."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from clawcomm.plan import pass_order as plan_order
from clawcomm.plan import search as plan
from clawcomm.plan.profile import Profile, profile
from clawcomm.train import models
from clawcomm.train.config import TrainConfig

GPT = dict(model="gpt", dim=32, heads=2, layers=2, seq_len=16, global_batch=16, quiet=True)


def test_each_pipeline_shape_is_measured_once_near_two_micro_batches_a_stage():
    cands = list(plan.candidates(4, 4, 16))
    wanted = plan_order.shapes(cands)
    assert set(wanted) == {(c.schedule, c.pp, c.virtual_stages) for c in cands if c.pp > 1}
    for (schedule, pp, v), (m, mbs) in wanted.items():
        ms = {
            c.microbatches
            for c in cands
            if (c.schedule, c.pp, c.virtual_stages) == (schedule, pp, v)
        }
        assert m == min(ms, key=lambda k: abs(k - 2 * pp)) and m * mbs <= 16


def test_every_action_runs_once_in_either_order_and_nothing_is_left_alive(monkeypatch):
    cfg = TrainConfig(**GPT)
    built = models.build(dataclasses.replace(cfg, dp=1, pp=1))
    layers, ds = list(built[0]), built[3]
    params = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
    counted = {}
    real = plan_order._run

    def counting(stages, inputs, acts):
        for rank_acts in acts.values():
            for a in rank_acts:
                key = (str(a.kind), a.stage, a.microbatch)
                counted[key] = counted.get(key, 0) + 1
        return real(stages, inputs, acts)

    from clawcomm.plan.profile import _split_copies

    monkeypatch.setattr(plan_order, "_run", counting)
    batch = lambda n: ds.batch(torch.arange(n))[0]  # noqa: E731
    out = {}
    for shape in (("zb1", 2, 1), ("interleaved", 2, 2), ("gpipe", 2, 1)):
        counted.clear()
        out.update(plan_order.ratios(layers, params, batch, {shape: (4, 2)},
                                     _split_copies(layers), repeats=2))  # fmt: skip
        # a warm-up, then 2 repeats of both orders: 5 runs of every action
        assert set(counted.values()) == {5}, shape
        passes = 3 if shape[0] == "zb1" else 2
        assert len(counted) == passes * 4 * shape[1] * shape[2], shape
    assert set(out[("zb1", 2, 1)]) == {"F", "I", "W"}
    assert set(out[("interleaved", 2, 2)]) == set(out[("gpipe", 2, 1)]) == {"F", "B"}
    # ratios of two timings: positive and finite (their size is the machine's,
    # and a bound on it failed under other tests' load; bench/plan_sweep.py judges them)
    assert all(math.isfinite(r) and r > 0 for kinds in out.values() for r in kinds.values())
    assert all(p.grad is None for layer in layers for p in layer.parameters())


def _prof() -> Profile:
    ms = [1e-3, 1e-3]
    return Profile([1e6, 1e6], {4: ms}, {4: ms}, {4: [0.0, 0.0]}, {4: [4e3, 4e3]}, 1e-12,
                   cpu_share={4: [1.0, 1.0]})  # fmt: skip


def test_the_prediction_scales_each_pass_by_its_schedules_order():
    c = plan.Candidate(1, 2, "gpipe", 1, 4, 4, 0)
    prof = _prof()
    plain = plan.predict(c, prof, cores=2)
    prof.order = {("gpipe", 2, 1): {"F": 1.5, "B": 1.0}, ("1f1b", 2, 1): {"F": 9.0, "B": 9.0}}
    slower = plan.predict(c, prof, cores=2)
    # each rank: 4 forwards of 1 ms become 1.5 ms; the backward is unchanged
    assert slower.compute_ms == pytest.approx(plain.compute_ms + 4 * 0.5)
    dp_only = plan.Candidate(2, 1, "1f1b", 1, 4, 4, 0)  # no pipeline: no order to scale by
    assert plan.predict(dp_only, prof, cores=2).compute_ms == pytest.approx(
        plan.predict(dp_only, _prof(), cores=2).compute_ms
    )


def test_the_floor_where_ranks_outnumber_cores_counts_the_order_too():
    from clawcomm.pipeline.schedules import build
    from clawcomm.plan import shared_cores as plan_cores

    c = plan.Candidate(1, 2, "gpipe", 1, 4, 4, 0)
    prof = _prof()
    span, share = plan_cores.stages(c, prof)
    schedule = build("gpipe", 2, 4)
    plain = plan_cores.rank_seconds(c, prof, span, share, 0.0, schedule)
    prof.order = {("gpipe", 2, 1): {"F": 2.0, "B": 1.0}}
    scaled = plan_cores.rank_seconds(c, prof, span, share, 0.0, schedule)
    assert all(scaled[r] == pytest.approx(plain[r] + 4e-3) for r in plain)


def test_layers_that_wait_are_not_measured_and_the_report_says_what_was():
    wait = TrainConfig(model="wait", layers=4, global_batch=16, quiet=True)
    built = models.build(dataclasses.replace(wait, dp=1, pp=1))
    cands = [c for c in plan.candidates(2, 4, 16) if c.pp > 1]
    prof = profile(wait, [c.micro_batch_size for c in cands], built=built)
    assert plan_order.measure(wait, cands, prof, built) == ({}, 0.0)
    assert plan_order.summary({}) is None
    line = plan_order.summary({("gpipe", 2, 1): {"F": 1.14, "B": 1.08},
                               ("1f1b", 2, 1): {"F": 1.02, "B": 0.99}})  # fmt: skip
    assert line.startswith("passes in their schedule's order took 0.99-1.14x")
    assert "gpipe at pp 2, F 1.14x, B 1.08x" in line


def test_orders_over_the_budget_are_left_unscaled_and_said_to_be():
    prof = _prof()  # 4 ms a micro-batch through the model's passes, at 4 samples
    wanted = {("gpipe", 2, 1): (4, 4), ("1f1b", 2, 1): (2, 4), ("zb1", 2, 1): (8, 4)}
    # (1 warm-up + 2 x 3 repeats) x m x 4 ms: 112, 56 and 224 ms
    kept, over = plan_order.within_budget(wanted, prof, budget=0.17)
    assert kept == {("1f1b", 2, 1): (2, 4), ("gpipe", 2, 1): (4, 4)} and over == [("zb1", 2, 1)]
    kept, over = plan_order.within_budget(wanted, prof, budget=0.05)
    assert kept == {} and len(over) == 3
    line = plan_order.summary({("gpipe", 2, 1): {"F": 1.1, "B": 1.0}, ("zb1", 2, 1): {}})
    assert "gpipe at pp 2" in line and "1 of 2 pipeline shapes unmeasured" in line
    assert "0 scaled by their schedule's at another pp, 1 left unscaled" in line
    line = plan_order.summary({("zb1", 2, 1): {}})
    assert line.startswith("passes in their schedule's order: not measured; 1 of 1")
    # an unmeasured shape predicts as if no order were measured
    c = plan.Candidate(1, 2, "zb1", 1, 4, 4, 0)
    plain = plan.predict(c, prof, cores=2).step_ms
    prof.order = {("zb1", 2, 1): {}}
    assert plan.predict(c, prof, cores=2).step_ms == pytest.approx(plain)


def test_one_shape_of_each_schedule_first_and_the_others_borrow_its_ratios():
    prof = _prof()
    # (1 warm-up + 2 x 3 repeats) x m x 4 ms: gpipe pp 4 (m 4) 112 ms, pp 2 (m 2) 56;
    # 1F1B pp 4 (m 8) 224 ms: the only 1F1B, so it goes before gpipe's second
    wanted = {("gpipe", 4, 1): (4, 4), ("gpipe", 2, 1): (2, 4), ("1f1b", 4, 1): (8, 4)}
    kept, over = plan_order.within_budget(wanted, prof, budget=0.29)
    assert list(kept) == [("gpipe", 2, 1), ("1f1b", 4, 1)] and over == [("gpipe", 4, 1)]
    prof.order = {("gpipe", 2, 1): {"F": 1.2, "B": 1.1}, ("gpipe", 4, 1): {},
                  ("1f1b", 4, 1): {"F": 1.0, "B": 1.0}, ("zb1", 2, 1): {}}  # fmt: skip
    assert plan_order.of(plan.Candidate(1, 4, "gpipe", 1, 8, 1, 0), prof) == {"F": 1.2, "B": 1.1}
    assert plan_order.of(plan.Candidate(1, 2, "zb1", 1, 4, 4, 0), prof) == {}  # none to borrow
    assert plan_order.of(plan.Candidate(2, 1, "1f1b", 1, 4, 4, 0), prof) == {}  # pp 1
    line = plan_order.summary(prof.order)
    assert "2 of 4 pipeline shapes unmeasured" in line
    assert "1 scaled by their schedule's at another pp, 1 left unscaled" in line


def test_the_orders_get_what_the_plans_time_has_left(monkeypatch):
    cfg = TrainConfig(**GPT)
    built = models.build(dataclasses.replace(cfg, dp=1, pp=1))
    cands = [c for c in plan.candidates(2, 4, 16) if c.pp > 1]
    prof = profile(cfg, [c.micro_batch_size for c in cands], built=built)
    every = set(plan_order.shapes(cands))
    # no time left: every shape unscaled, and the clock stops a shape the estimate let in
    order, _ = plan_order.measure(cfg, cands, prof, built, budget=0.0)
    assert set(order) == every and not any(order.values())
    layers, ds = list(built[0]), built[3]
    batch = lambda n: ds.batch(torch.arange(n))[0]  # noqa: E731
    late = plan_order.ratios(layers, prof.params, batch, plan_order.shapes(cands),
                             deadline=0.0)  # fmt: skip
    assert late == {}
    order, _ = plan_order.measure(cfg, cands, prof, built, budget=60.0)  # at most ORDER_BUDGET_S
    assert set(order) == every and all(order.values())
    # the plan gives them what its measuring has left of PLAN_SECONDS
    given = []
    real = plan_order.measure

    def spy(cfg, cands, prof, built, budget=plan_order.ORDER_BUDGET_S):
        given.append(budget)
        return real(cfg, cands, prof, built, budget)

    monkeypatch.setattr(plan_order, "measure", spy)
    monkeypatch.setattr(plan_order, "PLAN_SECONDS", 0.0)
    preds, over, prof = plan.plan(cfg, 2, cores=2)
    assert given == [pytest.approx(-prof.seconds, abs=1.0)] and given[0] < 0  # none left
    assert prof.order and not any(prof.order.values())
    text = plan.report(preds, over, prof, ["--nproc", "2"], 3)
    assert "unmeasured, past the time the plan had left for them" in text
