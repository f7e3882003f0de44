"""How far to trust a plan (``clawcomm plan --check``,
clawcomm/plan/check.py): the check trains the layouts it names, on
this host or on namespace hosts, in rounds whose medians, spreads and
agreement with each other it reports; the pairs the rounds tell apart; the
trainer's layout grid."""

from __future__ import annotations

import pytest

from clawcomm.plan import check as plan_check
from clawcomm.plan import search as plan


def _fake(name_dp: int, step_ms: float):
    c = plan.Candidate(name_dp, 4 // name_dp, "1f1b", 1, 4, 1, 0)
    return plan.Prediction(c, step_ms, 0.0, 0.0, 0.0, 1.0)


def test_check_rounds_give_medians_spreads_and_the_measurements_own_agreement():
    preds = [_fake(4, 10.0), _fake(2, 12.0), _fake(1, 14.0)]
    runs = [[11.0, 10.0, 12.0], [13.0, 13.0, 13.0], [12.0, 16.0, 15.0]]
    text = plan_check.table(list(zip(preds, runs, strict=True)))
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [r[-3] for r in rows] == ["11.0", "13.0", "15.0"]  # medians of the rounds
    assert [r[-2] for r in rows] == ["±9%", "±0%", "±13%"]  # (max - min) / 2 / median
    assert "measured fastest: #1" in text and "Spearman 1.00" in text
    # round 1 swaps the last two layouts, which rounds 2 and 3 agree on: 0.5, 0.5, 1.0
    assert plan_check.retest(runs) == pytest.approx(0.5)
    assert "the measurement against itself: Spearman 0.50" in text
    # only the first two layouts' ranges do not overlap (12 < 13), and the plan has them in order
    assert (
        "the pairs the rounds tell apart (one's range below the other's): 1 of 3; "
        "the plan orders 1 of them the same way" in text
    )
    single = plan_check.table([(p, r[0]) for p, r in zip(preds, runs, strict=True)])
    assert "spread" not in single and "against itself" not in single and "tell apart" not in single


def test_the_pairs_the_rounds_tell_apart_and_how_many_the_plan_orders_right():
    runs = [[20.0, 21.0], [10.0, 11.0], [10.5, 30.0], [40.0, 41.0]]
    # 1 < 0 < 3 by whole ranges; 2 overlaps 0 (20-21 inside 10.5-30) and 1 (10.5 inside 10-11)
    assert sorted(plan_check.separated(runs)) == [(0, 3), (1, 0), (1, 3), (2, 3)]
    wrong_once = [1.0, 2.0, 0.0, 3.0]  # has 0 before 1, which the rounds put after it
    assert plan_check.pairs_right(wrong_once, runs) == (3, 4)
    assert plan_check.pairs_right([2.0, 1.0, 0.0, 3.0], runs) == (4, 4)
    assert plan_check.separated([[1.0], [2.0], [3.0]]) == []  # one round tells nothing apart


def test_the_grid_is_the_plans_first_then_every_shape_at_fixed_micro_batches():
    cands = list(plan.candidates(4, 6, 32))
    # any order the plan could give: here a scrambled one, its first at 8 micro-batches
    preds = [plan.Prediction(c, float((i * 7) % len(cands)), 0.0, 0.0, 0.0, 1.0)
             for i, c in enumerate(cands)]  # fmt: skip
    preds.sort(key=lambda p: p.step_ms)
    preds.insert(0, next(p for p in preds if p.cand.microbatches == 8))
    chosen = plan_check.grid(preds, 4)
    assert chosen[0] is preds[0]
    rest = [p.cand for p in chosen[1:]]
    assert all(c.microbatches == 4 and c.zero == 0 for c in rest)
    shapes = {c.shape() for c in rest}
    assert len(shapes) == len(rest)  # each layout once
    # dp 4; dp 2 x pp 2 in all four schedules; pp 4 without interleaved (8 stages > 6 layers)
    assert len(rest) == 1 + 4 + 3
    assert (4, 1, "1f1b", 1, 1, 1) in shapes and (2, 2, "interleaved", 2, 1, 1) in shapes
    steps = [p.step_ms for p in chosen[1:]]
    assert steps == sorted(steps)  # in the plan's order


def test_check_on_namespace_hosts(capsys):
    from clawcomm.cli import main
    from clawcomm.launch.netns import unavailable

    why = unavailable()
    if why:
        pytest.skip(why)
    args = ["plan", "--nproc", "4", "--hosts", "2", "--link", "1gbit", "--model", "mlp",
            "--hidden", "32", "--global-batch", "16", "--check", "1",
            "--check-steps", "3"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "checked on 2 namespace hosts of this machine" in out
    assert "measured fastest: #1; the plan's first measured 1.00x" in out


def test_spearman():
    assert plan_check.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert plan_check.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert plan_check.spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)


def test_check_trains_the_first_layouts_and_compares(capsys):
    from clawcomm.cli import main

    args = ["plan", "--nproc", "2", "--model", "mlp", "--hidden", "32", "--global-batch", "16",
            "--top", "3", "--check", "2", "--check-steps", "4"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "run it: clawcomm train --nproc 2 --model mlp --hidden 32" in out
    assert "predicted ms" in out and "measured fastest: #" in out


def test_check_shapes_trains_layouts_that_differ(capsys):
    from clawcomm.cli import main

    args = ["plan", "--nproc", "2", "--model", "mlp", "--hidden", "32", "--global-batch", "16",
            "--check", "2", "--check-shapes", "--check-steps", "4"]  # fmt: skip
    assert main(args) == 0
    table = capsys.readouterr().out.split("predicted ms")[1]
    rows = [line for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2
    shapes = {line.split(",")[0].split(maxsplit=1)[1] for line in rows}
    assert len(shapes) == 2, rows  # two shapes (dp 2 x pp 1, dp 1 x pp 2 ...), not two ZeRO stages
