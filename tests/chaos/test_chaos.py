"""The chaos suite, bounded for CI (a few trials per family; bench/chaos.py
runs the long version): every family must score perfectly. Each test prints
its family's scorecard line (pytest -s shows them)."""

from __future__ import annotations

import pytest

from clawcomm import chaos


@pytest.mark.parametrize(
    "family,amount",
    [
        ("kill", 12),
        ("mismatch", 12),
        ("settings", 1),
        ("timeout", 2),
        ("soak", 4000),
        ("storm", 400),
    ],
)
def test_chaos_family_scores_perfectly(family, amount):
    score = chaos.FAMILIES[family](amount, seed=11)
    print(score.line())
    assert score.hangs == 0 and score.leaks == 0 and score.wrong == 0, score
    assert score.perfect, score
