"""The one three-way judge (`parity.tolerances.three_way`), the harness's use of it (`parity.harness.judge`),
and the margin every comparison carries.

Bounds worked out by hand on arrays whose errors are chosen: exact = 0, candidate off by 0.3 at
one place, yardstick 0.1, k = 3, atol 0.01.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity.harness.judge import judge, judge_grads
from parity.harness.judge import margin as judge_margin
from parity.harness.report import Row
from parity.harness.report import margin as report_margin
from parity.tolerances import Tolerance, compare, compare_three_way, three_way

EXACT = np.zeros((3, 5))
OFF = EXACT.copy()
OFF[1, 2] = 0.3
YARD = EXACT.copy()
YARD[2, 4] = 0.1


def test_bound_is_k_yardsticks_plus_atol():
    c = three_way(OFF, EXACT, 3.0, 0.1, 0.01)
    assert c.atol == pytest.approx(0.31) and c.passed  # 0.3 <= 3 * 0.1 + 0.01
    assert not three_way(OFF, EXACT, 2.0, 0.1, 0.01).passed  # 0.3 > 0.21


def test_floor_is_a_least_bound_not_an_addition():
    assert three_way(OFF, EXACT, 3.0, 0.0, 0.01, floor=0.5).atol == pytest.approx(0.5)
    assert three_way(OFF, EXACT, 3.0, 0.1, 0.01, floor=0.05).atol == pytest.approx(0.31)


def test_a_pair_of_candidates_gets_twice_the_yardstick():
    assert three_way(OFF, EXACT, 3.0, 0.1, 0.01, pair=True).atol == pytest.approx(0.61)


def test_nan_placement_fails_whatever_the_bound():
    nan = OFF.copy()
    nan[0, 0] = np.nan
    c = three_way(nan, EXACT, 3.0, 0.1, 0.01)
    assert c.values_ok and not c.passed and c.nan_mismatch == 1


def test_an_overflowed_yardstick_passes_nothing():
    assert not three_way(OFF, EXACT, 3.0, np.inf, 0.01).passed


def test_every_entry_point_gives_the_same_bound():
    direct = three_way(OFF, EXACT, 3.0, 0.1, 0.01)
    assert compare_three_way(OFF, EXACT, YARD, 3.0, 0.01) == direct
    assert judge(OFF, EXACT, Tolerance(0.01, 0.0), 3.0, yardstick=YARD) == direct
    assert judge(OFF, EXACT, Tolerance(0.01, 0.0), 3.0, yard_err=0.1) == three_way(OFF, EXACT, 3.0, 0.1, 0.01, pair=True)


# ---------------------------------------------------------------- margins: from the verdict's own numbers


def test_the_margin_of_a_three_way_judgement_is_error_over_bound():
    c = three_way(OFF, EXACT, 3.0, 0.1, 0.01)
    assert c.margin == pytest.approx(0.3 / 0.31) and c.passed
    c = three_way(OFF, EXACT, 2.0, 0.1, 0.01)
    assert c.margin == pytest.approx(0.3 / 0.21) and not c.passed


def test_an_elementwise_margin_is_the_largest_elementwise_ratio_so_a_fail_is_above_1():
    """0.2 off where the reference is 0 fails atol 0.1 + rtol 1.0·|e|; error ÷ (atol + rtol) would be 0.18."""
    expected = np.array([0.0, 10.0])
    c = compare(np.array([0.2, 10.0]), expected, Tolerance(0.1, 1.0))
    assert not c.passed and c.margin == pytest.approx(2.0) and judge_margin(c) == c.margin
    ok = compare(np.array([0.05, 15.0]), expected, Tolerance(0.1, 1.0))
    assert ok.passed and ok.margin == pytest.approx(max(0.05 / 0.1, 5.0 / 10.1))


def test_a_failure_within_the_bound_has_margin_inf_and_a_pass_at_most_1():
    nan = OFF.copy()
    nan[0, 0] = np.nan
    assert three_way(nan, EXACT, 3.0, 0.1, 0.01).margin == np.inf  # NaN placement
    assert three_way(OFF, EXACT, 3.0, np.inf, 0.01).margin == np.inf  # an overflowed yardstick passes nothing
    assert three_way(EXACT, EXACT, 3.0, 0.0, 0.0).margin == 0.0 and three_way(EXACT, EXACT, 3.0, 0.0, 0.0).passed
    assert Row("c", "forward", "x", "oracle", "float32", "cpu", "fail", "output", 0.1, 0.1, 1.0, 0.0, margin=0.1).margin \
        == np.inf
    assert report_margin(Row("c", "leak", "x", "unperturbed", "float32", "cpu", "fail", "output", 0.3, 0.3, 0.0, 0.0)) \
        == np.inf  # a hand-made row with a zero bound: inf, never 0.3 / 1e-300


def test_a_merged_row_fails_with_the_margin_of_a_failing_array():
    """The row's worst is a failing array even when a passing one has the larger value margin."""
    got = {"a": np.array([0.0, np.nan]), "b": np.array([0.9, 0.0])}
    want = {"a": np.array([0.0, 1.0]), "b": np.array([0.0, 0.0])}
    c, note = judge_grads(got, want, Tolerance(1.0, 0.0), ("a", "b"))
    assert not c.passed and c.margin == np.inf and "worst: a (fails)" in note
