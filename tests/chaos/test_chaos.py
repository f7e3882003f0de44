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
        ("hang", 10),
        ("link", 2),
        ("settings", 1),
        ("timeout", 2),
        ("soak", 20000),
        ("storm", 400),
    ],
)
def test_chaos_family_scores_perfectly(family, amount):
    score = chaos.FAMILIES[family](amount, seed=11)
    if "skipped" in score.extra:  # the link family needs namespace hosts
        pytest.skip(score.extra["skipped"])
    print(score.line())
    assert score.hangs == 0 and score.leaks == 0 and score.wrong == 0, score
    assert score.perfect, score


def test_the_soak_tells_a_leak_from_the_allocators_swings():
    # Resident sets seen on flat processes: single samples 2.5% up (CI, 2
    # ranks), and floors 0.34% apart in CI's full suite (a 288 MB process).
    flat = [181232, 181232, 181744, 181232, 185844, 185844, 185844, 181744, 182772]
    flat += [182260, 181744, 182256, 182256, 180848, 183284, 185360, 184336, 181900]
    assert chaos.rss_growth(flat) < chaos.SOAK_RSS_GROWTH_LIMIT
    swing = [288464 - 485 * (i % 7 == 3) + 485 * (i > 6) + 485 * (i > 13) for i in range(21)]
    assert 0.3 < chaos.rss_growth(swing) < chaos.SOAK_RSS_GROWTH_LIMIT
    # A one-time step of the heap (a late thread arena, a cache filling once)
    # is not a leak; 50 bytes an op over 18,000 ops is, beside 4 KB swings.
    per_op = lambda heap: chaos.floor_rise(heap) / 18000  # noqa: E731
    step = [91_500_000 if i < 9 else 91_800_000 for i in range(20)]
    assert per_op(step) < chaos.SOAK_HEAP_GROWTH_LIMIT
    leak = [91_500_000 + i * 900_000 // 19 + 4096 * (i % 4 == 1) for i in range(20)]
    assert per_op(leak) > chaos.SOAK_HEAP_GROWTH_LIMIT
    # And 200 bytes an op in what malloc does not see (Python's arenas): +2%.
    rss = [180000 + i * 3600 // 19 + (3000 if i % 4 == 1 else 0) for i in range(20)]
    assert chaos.rss_growth(rss) > chaos.SOAK_RSS_GROWTH_LIMIT
