"""The RoPE cases of `mha-parity --cases modern` catch the RoPE porting bugs, each at its stage.

A port that hard-codes rope_theta=10000 is red at q_rot on every RoPE case (none has that base);
a port that rotates its keys with the query positions is red at k_rot on the cross-attention
cases with T < S, which both conventions have (their keys draw positions of their own). Each bug
is planted in our torch module (`tests/planted.py`, no XLA compile) twice: declaring every
variant, and declaring rotate-half only, as the example Llama port does, so the interleaved case
is a skip row for it and the rotate-half cases alone must catch it. Our module passes them.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_spec import LLAMA_FEATURES, ROPE_CONVENTIONS
from parity.harness import draw_inputs, run
from parity.harness.matrix import VARIANT_SHAPES, default_matrix, modern_matrix
from tests import planted

DEFAULT_BASE = 10000.0


def _one_case_per_rope_layer():
    """The Llama-era RoPE layers (the layers after Llama rotate the same way; their own slips are
    tests/test_modern_examples.py's and tests/test_modern_cases.py's)."""
    first = {}
    for c in modern_matrix():
        if c.shape.rope is not None and c.config.features <= set(LLAMA_FEATURES):
            first.setdefault(c.shape.name, c)
    return tuple(first.values())


ROPE_CASES = _one_case_per_rope_layer()  # llama (self), rope-half and rope-interleaved (cross, T < S)
SELF = {c.name for c in ROPE_CASES if not c.shape.cross}
HALF = {c.name for c in ROPE_CASES if c.shape.rope == "half"}
ALL = {c.name for c in ROPE_CASES}
FEATURES = {c.name: c.config.features for c in ROPE_CASES}
THETA, KEYS, HALF_ONLY = planted.theta_10000, planted.keys_rotated_at_query_positions, planted.ROTATE_HALF_ONLY
HALF_ONLY_RUNS = {c for c in HALF if FEATURES[c] <= set(HALF_ONLY)}  # its Llama-era rotate-half layers
# bug -> (its implementation, the stage the harness blames, the cases where it is red). Elsewhere
# the bug skips (a rotate-half-only port on the interleaved case or a layer after Llama) or is right
# (the keys' positions are the queries' in self-attention).
BUGS = {impl.name: (impl, stage, red) for impl, stage, red in (
    (THETA(), "q_rot", ALL), (THETA(HALF_ONLY), "q_rot", HALF_ONLY_RUNS),
    (KEYS(), "k_rot", ALL - SELF), (KEYS(HALF_ONLY), "k_rot", HALF_ONLY_RUNS - SELF))}


def _keys_apart(case) -> bool:
    """Whether no batch row's key positions are its query positions, nor what a one-list port makes of them."""
    x = draw_inputs(case, 0)
    T, S = case.shape.T, case.shape.S
    guessed = planted.keys_at_query_positions(x.positions, S, np)
    return all(not np.array_equal(k[:T], q) and not np.array_equal(k[S - T:], q) and (k != g).any()
               for k, q, g in zip(x.key_positions, x.positions, guessed))


def test_no_rope_case_has_the_default_base():
    rope = [c for c in (*modern_matrix(), *default_matrix()) if c.shape.rope is not None]
    assert {c.shape.rope for c in rope} == set(ROPE_CONVENTIONS)
    assert any(c.shape.rope is not None for c in default_matrix())
    assert [c.name for c in rope if c.shape.rope_theta == DEFAULT_BASE] == []


def test_both_conventions_have_cross_attention_with_fewer_queries_and_keys_positioned_apart():
    for convention in ROPE_CONVENTIONS:
        apart = [c for c in modern_matrix() if c.shape.rope == convention and c.shape.cross and c.shape.T < c.shape.S]
        assert apart, convention
        assert all(_keys_apart(c) for c in apart), convention


def test_the_llama_layer_has_every_feature_at_a_base_of_its_own():
    llama = VARIANT_SHAPES["llama"]
    assert llama.features == {"grouped", "rope-half", "no-qkv-bias", "no-out-bias"}
    assert set(LLAMA_FEATURES) - llama.features == {"rope-interleaved"}  # one convention per layer
    assert llama.rope_theta != DEFAULT_BASE and llama.K < llama.N
    for cases in (default_matrix(), modern_matrix()):
        assert any(c.shape is llama for c in cases)


@pytest.fixture(scope="module")
def rope_report():
    impls = ("torch", *(impl for impl, _, _ in BUGS.values()))
    return run(cases=ROPE_CASES, checks=("forward",), dtypes=("float32",), impls=impls, device="cpu")


def _rows(report, impl, case):
    return [r for r in report.rows if r.impl == impl and r.case == case]


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_rope_porting_bug_is_red_at_its_stage(rope_report, bug):
    impl, stage, red = BUGS[bug]
    assert red, bug
    for case in sorted(ALL):
        rows = _rows(rope_report, bug, case)
        assert rows, (bug, case)
        if case in red:
            bad = [r for r in rows if r.reference == "oracle"]
            assert bad and all(r.status == "fail" for r in rows), (bug, case, rows)
            assert {r.stage for r in bad} == {stage}, (bug, case)
        elif not FEATURES[case] <= set(impl.variants):  # a half-only port: skips what it does not declare
            missing = sorted(FEATURES[case] - set(impl.variants))
            assert all(r.status == "skip" and ", ".join(missing) in r.message for r in rows), (bug, case, missing)
        else:
            assert all(r.status == "pass" for r in rows), (bug, case, rows)


def test_a_rotate_half_only_port_with_either_bug_fails_the_rope_cases():
    """The false green of a port that never runs the interleaved case: without a rotate-half case
    whose base is not 10000 and whose keys have positions of their own, it passes (exit 0)."""
    cases = [c for c in ROPE_CASES if c.shape.rope == "half" and c.shape.cross]
    assert cases
    for make in (THETA, KEYS):
        impl = make(HALF_ONLY)
        report = run(cases=cases, checks=("forward",), dtypes=("float32",), impls=(impl,), device="cpu")
        assert not report.ok and any(r.status == "fail" for r in report.rows), impl.name


def test_our_module_passes_the_rope_cases(rope_report):
    rows = [r for r in rope_report.rows if r.impl == "torch"]
    assert {r.case for r in rows} == ALL
    assert all(r.status == "pass" for r in rows), [r for r in rows if r.status != "pass"]
