"""float32 and float64 are judged by a bound that grows with the size of the terms a layer sums.

A correct layer with large weights (a Llama layer of std-0.3 weights: outputs up to ~10, where
float32 rounding of large terms that cancel leaves errors of ~1e-5 near zero) is green at every
seed; a projection 1% off stays red; and a row's margin, verdict and message say the same thing.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from rich.console import Console

from mha_spec import VARIANT_FEATURES
from parity.harness import Case, Shape, run
from parity.harness.report import Report, failure_numbers, margin, print_report
from parity.impls import Implementation, builtin

# A Llama layer (grouped K=2, rotate-half RoPE at 1e4, no biases) at tiny sizes, weights N(0, 0.3²) as a
# checkpoint's: the float32 bound of 1e-6 + 1e-5·|expected| failed our torch module at every seed 0-9 here.
LLAMA = Shape("llama-std0.3", B=3, T=7, S=7, E=48, N=4, cross=False, num_kv_heads=2, qkv_bias=False, out_bias=False,
              rope="half", rope_theta=1e4)
CASE = Case(LLAMA, "causal", "nan", jax_eager=False)
WEIGHTS = {n: np.random.default_rng(0).normal(0.0, 0.3, s) for n, s in LLAMA.config.weight_shapes().items()}


def one_percent_off(projection: str) -> Implementation:
    """Our torch module with `projection`'s weight 1% too large (the case's policy, every variant)."""
    base = builtin("torch")

    def around(fn):
        @functools.wraps(fn)
        def call(params, *args, **kw):
            return fn({**params, f"{projection}.weight": params[f"{projection}.weight"] * 1.01}, *args, **kw)

        return call

    def factory(sd, num_heads, **kw):
        fn = base.resolve_factory()(sd, num_heads, **kw)
        wrapped = around(fn)
        wrapped.intermediates = around(fn.intermediates)
        return wrapped

    return Implementation(f"1%-{projection}", "torch", factory, returns_weights=True, masked_rows=None, role="user",
                          variants=VARIANT_FEATURES)


def _bad(report):
    return [(r.impl, r.dtype, r.check, r.reference, r.quantity, r.message[:120]) for r in report.rows
            if r.status in ("fail", "error")]


def _consistent(report) -> None:
    """Every judged row: margin <= 1 on a pass, > 1 on a fail; no fail line printed with `<=`."""
    for r in report.rows:
        m = margin(r)
        if r.status == "pass" and m is not None:
            assert m <= 1, (r.impl, r.quantity, m)
        if r.status == "fail" and r.max_abs_err is not None:
            assert m is not None and m > 1, (r.impl, r.quantity, m, r.message)
            assert "<=" not in failure_numbers(r), failure_numbers(r)


@pytest.mark.parametrize("seed", range(10))
def test_a_correct_llama_layer_of_large_weights_is_green_in_float32_and_float64(seed):
    report = run(cases=[CASE], state_dict=WEIGHTS, dtypes=("float32", "float64"), checks=("forward", "gradient"),
                 impls=("torch", "torch-fused"), device="cpu", seed=seed)
    assert report.ok, _bad(report)
    _consistent(report)


def test_our_jax_modules_are_green_on_the_same_layer():
    """jax-jit and jax-fused, which failed this layer's float32 output at 1e-6 + 1e-5·|expected|."""
    for seed in (0, 1):
        report = run(cases=[CASE], state_dict=WEIGHTS, dtypes=("float32",), checks=("forward", "gradient"),
                     impls=("jax-jit", "jax-fused"), device="cpu", seed=seed)
        assert report.ok, _bad(report)


@pytest.mark.parametrize("weights", [WEIGHTS, None], ids=["std-0.3", "drawn"])
def test_a_projection_1_percent_off_stays_red_and_its_rows_say_so_consistently(weights):
    bugs = [one_percent_off(p) for p in ("q_proj", "k_proj", "v_proj", "out_proj")]
    report = run(cases=[CASE], state_dict=weights, dtypes=("float32", "float64"), checks=("forward", "gradient"),
                 impls=("torch", *bugs), device="cpu", seed=0)
    for bug in bugs:
        for dtype in ("float32", "float64"):
            failed = [r for r in report.rows if r.impl == bug.name and r.dtype == dtype and r.status == "fail"]
            assert failed, (bug.name, dtype)
            # red by far, not by a hair: the least red of its failing rows against the oracle
            assert max(margin(r) for r in failed if r.reference == "oracle") > 10, (bug.name, dtype)
    assert all(r.status == "pass" for r in report.rows if r.impl == "torch")
    _consistent(report)
    console = Console(width=100, record=True, force_terminal=False)
    print_report(report, console)
    lines = [line for line in console.export_text().splitlines() if line.startswith("fail ")]
    assert lines and all(" > bound " in line and "<=" not in line for line in lines), lines


def _offset_output(name: str, only_with_autograd: bool) -> Implementation:
    """Our torch module whose output is 1e-3 off -- always, or only when autograd records -- with clean stages."""
    import torch

    base = builtin("torch")

    def factory(sd, num_heads, **kw):
        kw.setdefault("masked_rows", "uniform")  # a fixed policy is not passed to the factory
        fn = base.resolve_factory()(sd, num_heads, **kw)

        def call(*args, **kwargs):
            out, w = fn(*args, **kwargs)
            return (out + 1e-3 if torch.is_grad_enabled() or not only_with_autograd else out), w

        call.intermediates = fn.intermediates  # every stage the oracle's: the stage search names none
        return call

    return Implementation(name, "torch", factory, returns_weights=True, masked_rows="uniform", role="user")


def test_the_autograd_diagnosis_is_given_only_where_autograd_on_and_off_were_compared():
    case = Case(Shape("t", B=3, T=5, S=7, E=12, N=3, cross=True), "padding", "uniform")
    both, autograd = _offset_output("off-always", False), _offset_output("off-with-autograd", True)
    report = run(cases=[case], dtypes=("float32",), checks=("forward", "gradient"), impls=(both, autograd), device="cpu")
    rows = {(r.impl, r.check): r for r in report.rows if r.reference == "oracle" and r.quantity == "output"}
    claim = "computes differently with autograd on"
    assert rows[("off-always", "forward")].status == rows[("off-always", "gradient")].status == "fail"
    assert claim not in rows[("off-always", "gradient")].message  # off without autograd too: nothing apart
    assert rows[("off-with-autograd", "forward")].status == "pass"
    assert rows[("off-with-autograd", "gradient")].status == "fail"
    assert claim in rows[("off-with-autograd", "gradient")].message
    # with no forward check to compare against, nothing is claimed either
    alone = run(cases=[case], dtypes=("float32",), checks=("gradient",), impls=(autograd,), device="cpu")
    row = next(r for r in alone.rows if r.impl == autograd.name and r.quantity == "output")
    assert row.status == "fail" and claim not in row.message


def test_a_failure_printed_within_its_bound_says_why_without_a_comparison_sign():
    """A fail row whose values are within the bound (NaN placement) has margin inf, and its line no `<=`."""
    from parity.harness.report import Row

    rows = [Row("c", "forward", "mine", "oracle", "float32", "cpu", "fail", "output", 1e-7, 1e-7, 1e-6, 0.0,
                message="NaN placement differs: 3 NaN where the reference is finite", margin=0.1)]
    assert margin(rows[0]) == np.inf
    console = Console(width=100, record=True, force_terminal=False)
    print_report(Report({"seed": 0}, rows), console)
    text = console.export_text()
    line = next(line for line in text.splitlines() if line.startswith("fail "))
    assert "<=" not in line and "margin inf" in line and "bound 1.00e-06" in line
