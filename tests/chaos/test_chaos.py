"""The chaos suite, bounded for CI (a few trials per family; bench/chaos.py
runs the long version): every family must score perfectly. Each test prints
its family's scorecard line (pytest -s shows them)."""

from __future__ import annotations

import pytest

from clawcomm.testing import chaos


@pytest.mark.parametrize(
    "family,amount",
    [
        ("kill", 12),
        ("mismatch", 12),
        ("settings", 1),
        ("timeout", 2),
        ("soak", 20000),
        ("storm", 400),
    ],
)
def test_chaos_family_scores_perfectly(family, amount):
    score = chaos.FAMILIES[family](amount, seed=11)
    print(score.line())
    assert score.hangs == 0 and score.leaks == 0 and score.wrong == 0, score
    assert score.perfect, score


def test_the_soak_tells_a_leak_from_the_allocators_swings():
    # Samples seen on a flat process (CI, 2 ranks): single samples 2.5% up.
    flat = [181232, 181232, 181744, 181232, 185844, 185844, 185844, 181744, 182772]
    flat += [182260, 181744, 182256, 182256, 180848, 183284, 185360, 184336, 181900]
    assert chaos.rss_growth(flat) < 1.0
    # 200 bytes per op for 10,000 ops on a 180 MB process (+1.1%), with the same swings.
    leak = [180000 + i * 2000 // 19 + (3000 if i % 4 == 1 else 0) for i in range(20)]
    assert chaos.rss_growth(leak) > chaos.SOAK_RSS_GROWTH_LIMIT
    # 50 bytes per op over 18,000 ops (+0.5%), below the swings' size.
    slow = [180000 + i * 900 // 19 + (3000 if i % 4 == 1 else 0) for i in range(20)]
    assert chaos.rss_growth(slow) > chaos.SOAK_RSS_GROWTH_LIMIT
    # A one-time step of 0.36% (CI, once: a late thread arena or cache) is not a leak.
    step = [181232 if i < 9 else 181880 for i in range(20)]
    assert chaos.rss_growth(step) < chaos.SOAK_RSS_GROWTH_LIMIT
