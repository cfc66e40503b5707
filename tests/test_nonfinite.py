"""A reference that is not finite everywhere is never a silent pass.

Comparisons count what they compared; a 16-bit bound that overflowed is no bound; a row
whose reference holds NaN/inf from non-finite inputs fails naming them; a row whose
reference is NaN everywhere from finite inputs (the "nan" policy's) passes and says that
nothing was compared. The checkpoint side (a NaN weight in a save_pretrained Llama) is in
tests/test_checkpoint_cli.py.
"""

from __future__ import annotations

import numpy as np

from parity.harness import Case, Shape, run
from parity.harness.checks import Unit
from parity.harness.judge import judge, judge_grads
from parity.harness.matrix import draw_inputs
from parity.tolerances import TOLERANCES, Comparison, compare, compare_three_way

CASE = Case(Shape("t", B=3, T=5, S=7, E=12, N=3, cross=True), "random", "nan")  # a fully masked row (random)
F16 = TOLERANCES["float16"]


def test_a_comparison_counts_the_elements_it_compared():
    e = np.array([1.0, np.nan, 3.0, np.inf])
    c = compare(np.array([1.0, np.nan, 3.0, 2.0]), e, TOLERANCES["float64"].forward)
    assert (c.compared, c.size, c.not_compared, c.nothing_compared) == (2, 4, 2, False)
    both_nan = compare(np.full(3, np.nan), np.full(3, np.nan), TOLERANCES["float64"].forward)
    assert both_nan.passed and both_nan.nothing_compared and both_nan.not_compared == 3  # the caller decides
    c, note = judge_grads({"a": np.full(2, np.nan), "b": np.ones(2)}, {"a": np.full(2, np.nan), "b": np.ones(2)},
                          TOLERANCES["float64"].gradient, ("a", "b"))
    assert c.passed and (c.compared, c.size) == (2, 4) and "a: NaN everywhere in both, so nothing was compared" in note


def test_a_16_bit_bound_that_overflowed_is_no_bound():
    """The oracle's own float16 maths overflowing to inf makes the yardstick inf: k times it bounds
    nothing, so the comparison fails instead of passing any error at all."""
    exact = np.array([1.0, 2.0, 3.0])
    low = np.array([1.0, np.inf, 3.0])  # the yardstick's inf
    wrong = exact + 100.0
    assert not judge(wrong, exact, F16.forward, F16.three_way_k, low).passed
    assert not judge(wrong, exact, F16.forward, F16.three_way_k, yard_err=np.inf).passed
    assert not compare_three_way(wrong, exact, low, F16.three_way_k, F16.forward.atol).passed
    assert judge(exact, exact, F16.forward, F16.three_way_k, exact + 1e-3).passed  # a finite bound still passes


def _unit(state_dict=None) -> Unit:
    return Unit(CASE, "float32", draw_inputs(CASE, 0, state_dict).in_dtype(np.dtype(np.float32)), runners={})


def test_non_finite_inputs_fail_every_row_whose_reference_they_reach():
    sd = dict(draw_inputs(CASE, 0).state_dict)
    sd["k_proj.bias"] = sd["k_proj.bias"].copy()
    sd["k_proj.bias"][1] = np.inf
    vacuous = Comparison(0.0, 0.0, 1e-6, 1e-5, 0, True, True, compared=0, size=6)
    partial = Comparison(0.0, 0.0, 1e-6, 1e-5, 0, True, True, compared=4, size=6)
    for c in (vacuous, partial):
        st, message = _unit(sd).nonfinite_verdict("pass", c, "worst: query")
        assert st == "fail" and message.startswith(f"{c.not_compared} of 6 reference values are NaN/inf")
        assert "(k_proj.bias)" in message and message.endswith("; worst: query")
    finite = Comparison(0.0, 0.0, 1e-6, 1e-5, 0, True, True, compared=6, size=6)
    assert _unit(sd).nonfinite_verdict("pass", finite, "") == ("pass", "")  # a reference they do not reach
    # From finite inputs a reference NaN everywhere is the "nan" policy's: a pass that says so.
    st, message = _unit().nonfinite_verdict("pass", vacuous, "")
    assert st == "pass" and message.startswith("NaN everywhere in both, so nothing was compared")


def test_the_policy_nan_gradients_pass_and_are_named_as_uncompared():
    """Under "nan" a fully masked row makes v_proj's and out_proj.weight's gradients NaN everywhere
    (the row's NaN context reaches every entry): right, and the row names them."""
    report = run(cases=[CASE], impls=["torch"], dtypes=("float32",), checks=("gradient",), device="cpu")
    (row,) = [r for r in report.rows if r.quantity == "d_params"]
    assert row.status == "pass", row.message
    assert "v_proj.weight, v_proj.bias, out_proj.weight: NaN everywhere in both, so nothing was compared" in row.message
