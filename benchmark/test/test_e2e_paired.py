"""The e2e's paired comparisons: the balanced variant order and the intervals the targets print."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from benchmark.e2e import paired


def test_the_williams_rows_for_four_and_three_by_hand():
    assert paired.balanced_orders(4) == [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]
    assert paired.balanced_orders(3) == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0], [0, 2, 1], [1, 0, 2]]
    assert paired.balanced_orders(1) == [[0]] and paired.balanced_orders(0) == []
    assert [paired.cycle_length(n) for n in (0, 1, 2, 3, 4, 5)] == [1, 1, 2, 6, 4, 10]


@given(st.integers(min_value=1, max_value=12))
@settings(max_examples=12, deadline=None)
def test_a_cycle_balances_positions_and_predecessors(n):
    rows = paired.balanced_orders(n)
    assert all(sorted(r) == list(range(n)) for r in rows)  # every variant once per step
    for pos in range(n):
        counts = Counter(r[pos] for r in rows)
        assert set(counts.values()) == {len(rows) // n}  # each position equally often
    after = Counter((r[i], r[i + 1]) for r in rows for i in range(n - 1))
    if n > 1:
        pairs = set(itertools.permutations(range(n), 2))
        assert set(after) == pairs and len(set(after.values())) == 1  # each predecessor equally often


def test_the_median_interval_by_hand():
    # n = 10: P(B <= 1) = 11/1024 <= 0.025 < P(B <= 2) = 56/1024, so [r_(2), r_(9)] at 1 - 22/1024
    values = [1.10, 0.90, 1.00, 1.05, 0.95, 1.02, 0.98, 1.01, 0.99, 1.20]
    iv = paired.median_interval(values)
    assert iv.point == pytest.approx((1.00 + 1.01) / 2)
    assert (iv.lo, iv.hi) == (0.95, 1.10) and iv.coverage == pytest.approx(1 - 22 / 1024) and iv.n == 10
    assert iv.holds(1.03) and not iv.holds(1.2)
    # n = 5: no order statistic reaches 95 %; [min, max] with its own coverage 1 - 2 / 32
    small = paired.median_interval([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (small.point, small.lo, small.hi) == (3.0, 1.0, 5.0) and small.coverage == pytest.approx(1 - 2 / 32)
    assert paired.median_interval([2.0]).describe() == "2.000 [2.000, 2.000]"
    # n = 20: P(B <= 5) = 21700 / 2**20 <= 0.025 < P(B <= 6): [r_(6), r_(15)]
    twenty = paired.median_interval([float(i) for i in range(1, 21)])
    assert (twenty.lo, twenty.hi, twenty.point) == (6.0, 15.0, 10.5)
    assert twenty.coverage == pytest.approx(1 - 2 * 21700 / 2**20)


@given(st.lists(st.floats(min_value=0.1, max_value=10.0), min_size=1, max_size=60))
@settings(max_examples=60, deadline=None)
def test_the_median_interval_holds_the_median_and_reaches_the_level_when_it_can(values):
    iv = paired.median_interval(values)
    assert min(values) <= iv.lo <= iv.point <= iv.hi <= max(values)
    n = len(values)
    if 1 - 2 * 0.5**n >= 0.95:  # [min, max] covers 95 %: the interval reaches it
        assert iv.coverage >= 0.95


def test_paired_ratios_pair_or_give_none():
    iv = paired.paired_step_ratio([103.0, 202.0, 101.0, 204.0, 150.0], [100.0, 200.0, 100.0, 200.0, 100.0])
    assert iv.point == pytest.approx(1.02) and iv.lo == pytest.approx(1.01) and iv.hi == pytest.approx(1.5)
    assert paired.paired_step_ratio([1.0], [1.0, 2.0]) is None and paired.paired_step_ratio(None, [1.0]) is None


def test_the_kl_difference_interval():
    a, b = [0.030, 0.020, 0.025, 0.035], [0.010, 0.010, 0.012, 0.015]
    iv = paired.mean_difference_interval(a, b)
    assert iv.point == pytest.approx(0.01575)
    assert 0.0 < iv.lo <= iv.point <= iv.hi <= 0.020 + 1e-12  # every step's difference is positive
    assert paired.mean_difference_interval(a, b) == iv  # seeded
    one = paired.mean_difference_interval([0.5], [0.25])
    assert (one.point, one.lo, one.hi) == (0.25, 0.25, 0.25)
    assert paired.mean_difference_interval([1.0], []) is None
    assert iv.describe() == f"+0.0158 [{iv.lo:+.4f}, {iv.hi:+.4f}]"


def test_one_stratum_is_the_plain_bootstrap():
    a, b = [0.030, 0.020, 0.025, 0.035, 0.01], [0.010, 0.010, 0.012, 0.015, 0.02]
    assert paired.mean_difference_interval(a, b, strata=[5]) == paired.mean_difference_interval(a, b)


def test_strata_drop_the_spread_between_prompts_by_hand():
    """Two prompts whose steps differ by a constant each (0.01 and 0.03): every stratified
    replicate averages two 0.01s and two 0.03s, so the interval is the point; drawing across
    the prompts gives replicates from 0.01 to 0.03."""
    a, b = [0.02, 0.03, 0.05, 0.07], [0.01, 0.02, 0.02, 0.04]
    plain = paired.mean_difference_interval(a, b)
    strat = paired.mean_difference_interval(a, b, strata=[2, 2])
    assert strat.point == pytest.approx(0.02) and plain.point == pytest.approx(0.02)
    assert strat.lo == pytest.approx(0.02) and strat.hi == pytest.approx(0.02)
    assert plain.lo < 0.02 - 1e-3 and plain.hi > 0.02 + 1e-3


def test_bad_strata_name_the_argument():
    with pytest.raises(ValueError, match=r"strata: expected positive sizes summing to 3 units, got \[2, 2\]"):
        paired.mean_difference_interval([1.0, 2.0, 3.0], [0.0, 0.0, 0.0], strata=[2, 2])
    with pytest.raises(ValueError, match=r"strata: .*got \[3, 0\]"):
        paired.mean_difference_interval([1.0, 2.0, 3.0], [0.0, 0.0, 0.0], strata=[3, 0])


@given(st.lists(st.lists(st.floats(min_value=-1.0, max_value=1.0), min_size=1, max_size=6), min_size=1, max_size=5))
@settings(max_examples=40, deadline=None)
def test_a_stratified_interval_stays_within_what_the_strata_allow(groups):
    """Every replicate weighs each prompt by its size, so it lies between the size-weighted
    means of the prompts' smallest and largest differences; the point is the plain mean."""
    d = [x for g in groups for x in g]
    zeros = [0.0] * len(d)
    iv = paired.mean_difference_interval(d, zeros, strata=[len(g) for g in groups], samples=200)
    low = sum(min(g) * len(g) for g in groups) / len(d)
    high = sum(max(g) * len(g) for g in groups) / len(d)
    assert iv.point == pytest.approx(sum(d) / len(d))
    assert low - 1e-9 <= iv.lo <= iv.point <= iv.hi <= high + 1e-9


def test_the_strata_of_a_row():
    assert paired.strata_of({"prompt_offsets": [0, 9, 18, 27], "step_kl": [0.0] * 8}) == [2, 2, 2, 2]
    assert paired.strata_of({"prompt_offsets": [0], "step_kl": [0.0] * 8}) is None  # one prompt
    assert paired.strata_of({"step_kl": [0.0] * 8}) is None  # a row from before --prompts
    assert paired.strata_of({"prompt_offsets": [0, 9, 18], "step_kl": [0.0] * 8}) is None  # uneven
    assert paired.strata_of({"prompt_offsets": [0, 9], "step_kl": []}) is None


def test_bad_levels_and_empty_values_name_the_argument():
    with pytest.raises(ValueError, match=r"level: expected 0 < level < 1, got 1.0"):
        paired.median_interval([1.0], level=1.0)
    with pytest.raises(ValueError, match="values: expected at least one value, got none"):
        paired.median_interval([])
