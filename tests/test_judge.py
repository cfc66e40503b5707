"""The one 16-bit judge (`parity.tolerances.three_way`) and the harness's use of it (`parity.harness.judge`).

Bounds worked out by hand on arrays whose errors are chosen: exact = 0, candidate off by 0.3 at
one place, yardstick 0.1, k = 3, atol 0.01.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity.harness.judge import judge
from parity.tolerances import Tolerance, compare_three_way, three_way

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
