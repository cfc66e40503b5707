"""Judging one array against a reference: the table's three-way bound, NaN placement.

Every dtype (`parity.tolerances`): err(candidate, float64 oracle) <= k * err(yardstick, float64
oracle) + atol, the yardstick being the oracle's own maths in that dtype -- each stage rounded as
the modules store it (`reference.forward(dtype=...)`; gradients: `reference.backward(dtype=...)`),
in float32 and float64 the largest error of that run and of runs on inputs and weights nudged by
up to eps (`parity.tolerances.yardstick_runs`); float64's is float32's, with k scaled to float64's
resolution. So the bound grows with the size of the terms a layer sums, in every dtype.
Implementation-vs-implementation rows use the same bound with the yardstick doubled (each
candidate may be off the oracle by it). A gradient whose true value is zero, and a bias gradient
summed in the dtype, get the floors of `parity.tolerances.gradient_floors` / `reduction_floors`.
Where no yardstick is given (`k` or the yardstick None: the training rows, the sharded check) the
elementwise bound atol + rtol·|expected| applies.
The arithmetic is `parity.tolerances` (`compare`, `three_way`), which also computes each
comparison's margin from the same numbers as its verdict; this module picks which applies and
merges several arrays into one row.
"""

from __future__ import annotations

import numpy as np

from parity import reference
from parity.tolerances import Comparison, Tolerance, compare, errors, ratio, settled_margin, three_way


def judge(actual, expected, tol: Tolerance, k: float | None = None, yardstick=None, yard_err: float | None = None,
          floor: float = 0.0) -> Comparison:
    """The table's judgement; three-way when k is set and a yardstick is known.

    yardstick: the yardstick's array (`expected` is the oracle); yard_err: its error, given when
    `expected` is another candidate (the pair bound: twice the yardstick). floor: the least bound a
    three-way judgement allows (parity.tolerances.gradient_floors, reduction_floors); 0 leaves the
    bound as the table makes it.
    """
    if k is None or (yardstick is None and yard_err is None):
        return compare(actual, expected, tol)
    if yardstick is not None:
        return three_way(actual, expected, k, errors(yardstick, expected)[0], tol.atol, floor)
    return three_way(actual, expected, k, yard_err, tol.atol, floor, pair=True)  # against another candidate


NOTHING_COMPARED = "NaN everywhere in both, so nothing was compared"


def nan_note(actual, expected) -> str:
    """Which way NaN placements differ, e.g. a fused path with finite gradients where the oracle has NaN."""
    a, e = np.isnan(reference.as_float64(actual)), np.isnan(reference.as_float64(expected))
    parts = []
    if (n := int(np.count_nonzero(~a & e))):
        parts.append(f"{n} finite where the reference is NaN")
    if (n := int(np.count_nonzero(a & ~e))):
        parts.append(f"{n} NaN where the reference is finite")
    return ", ".join(parts)


def status(c: Comparison) -> str:
    return "pass" if c.passed else "fail"


def judge_grads(got: dict, expected: dict, tol: Tolerance, names, k=None, yard_err=None,
                floors: dict | None = None) -> tuple[Comparison, str]:
    """Judge several arrays as one row; the row shows the worst (by error over its bound) and
    names every array that fails."""
    floors = floors or {}
    cmps = {n: judge(got[n], expected[n], tol, k, yard_err=None if yard_err is None else yard_err[n],
                     floor=floors.get(n, 0.0)) for n in names}

    def badness(n):
        c = cmps[n]
        return (not c.passed, margin(c))

    worst = max(names, key=badness)
    c = cmps[worst]
    total_nan = sum(x.nan_mismatch for x in cmps.values())
    # the worst is a failing array whenever one fails, so the merged margin is above 1 exactly when the row fails
    merged = Comparison(c.max_abs_err, c.max_rel_err, c.atol, c.rtol, total_nan, all(x.passed for x in cmps.values()),
                        all(x.values_ok is not False for x in cmps.values()),
                        sum(x.compared for x in cmps.values()), sum(x.size for x in cmps.values()), margin=c.margin)
    note = f"worst: {worst}" + ("" if c.passed else " (fails)")
    empty = [n for n in names if cmps[n].nothing_compared]
    if empty and len(empty) < len(names):  # all of them: the row's own message says so (checks.Unit.row)
        note += f"; {', '.join(empty)}: {NOTHING_COMPARED}"
    off = [n for n in names if cmps[n].values_ok is False]
    if len(off) > 1 or (off and off != [worst]):
        note += f"; values off the bound in {', '.join(off)}"
    nans = [f"{n}: {nan_note(got[n], expected[n])}" for n in names if cmps[n].nan_mismatch]
    if nans:
        note += f"; NaN placement differs in {'; '.join(nans)}"
    return merged, note


def margin(c: Comparison) -> float:
    """max error ÷ the bound it was allowed, as the comparison computed it with its verdict: at most 1 passes,
    the smaller the more room (`parity.tolerances.settled_margin`)."""
    if c.margin is not None:
        return c.margin
    return settled_margin(ratio(c.max_abs_err, (c.atol or 0.0) + (c.rtol or 0.0)), c.passed)
