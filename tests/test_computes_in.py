"""`computes_in` judges a layer at that dtype with that dtype's yardstick, in every row that uses it.

A layer that honestly computes in bfloat16 inside a float32 model (it casts its inputs and weights
to bfloat16 and calls our module there) must pass its float32 rows when it says so
(computes_in="bfloat16"): its error is bfloat16's, and bfloat16's bound is k times the oracle's own
maths in bfloat16 -- not k times float32's maths plus bfloat16's floor. Without the declaration the
same layer is red. The rows between two such layers of different frameworks are judged the same way.
"""

from __future__ import annotations

import pytest

from parity.harness import Case, Shape, run
from parity.harness.report import margin
from parity.impls import Implementation, builtin

CASE = Case(Shape("t", B=3, T=5, S=7, E=12, N=3, cross=True), "padding", "uniform")


def torch_in_bfloat16(name: str, computes_in: str | None) -> Implementation:
    """Our torch module run in bfloat16: inputs and weights cast down, outputs cast back to the inputs' dtype."""
    import torch

    base = builtin("torch")

    def factory(sd, num_heads, **kw):
        fn = base.resolve_factory()(sd, num_heads, **kw)

        def call(params, q, k, v, keep, **positions):
            low = {n: p.to(torch.bfloat16) for n, p in params.items()}
            out, w = fn(low, *(x.to(torch.bfloat16) for x in (q, k, v)), keep, **positions)
            return out.to(q.dtype), w.to(q.dtype)

        return call

    return Implementation(name, "torch", factory, returns_weights=True, masked_rows=None, role="user",
                          computes_in=computes_in)


def jax_rounded_to_bfloat16(name: str) -> Implementation:
    """Our JAX module (jit) on inputs and weights rounded to bfloat16, computing in float32 from there: a
    bfloat16 layer that rounds in other places than the torch one, so the two differ by bfloat16's rounding."""
    import jax.numpy as jnp

    base = builtin("jax-jit")

    def factory(sd, num_heads, **kw):
        fn = base.resolve_factory()(sd, num_heads, **kw)

        def call(params, q, k, v, keep, **positions):
            def rounded(x):
                return x.astype(jnp.bfloat16).astype(x.dtype)

            return fn({n: rounded(p) for n, p in params.items()}, *(rounded(x) for x in (q, k, v)), keep, **positions)

        return call

    return Implementation(name, "jax", factory, "jit", True, masked_rows=None, role="user", computes_in="bfloat16")


def _rows(report, impl, reference=None):
    return [r for r in report.rows if r.impl == impl and r.status != "skip"
            and (reference is None or r.reference == reference)]


def test_a_declared_bfloat16_layer_passes_its_float32_rows_and_the_same_layer_undeclared_fails():
    declared, undeclared = torch_in_bfloat16("bf16-declared", "bfloat16"), torch_in_bfloat16("bf16-undeclared", None)
    report = run(cases=[CASE], impls=(declared, undeclared), dtypes=("float32",), checks=("forward", "gradient"),
                 device="cpu")
    ok = _rows(report, declared.name)
    assert {r.reference for r in ok} == {"oracle", "torch"} and {r.check for r in ok} == {"forward", "gradient"}
    assert all(r.status == "pass" for r in ok), [(r.reference, r.quantity, r.message) for r in ok if r.status != "pass"]
    assert all("judged at the bfloat16 bound" in r.message for r in ok)
    # it uses a real part of bfloat16's bound: its error is bfloat16's, far above float32's
    assert max(margin(r) for r in ok) > 0.05
    bad = _rows(report, undeclared.name, "oracle")
    assert bad and all(r.status == "fail" for r in bad if r.quantity in ("output", "weights", "d_params"))
    assert min(margin(r) for r in bad if r.status == "fail") > 10


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_two_bfloat16_layers_of_different_frameworks_pass_against_each_other(dtype):
    torch_layer, jax_layer = torch_in_bfloat16("bf16-torch", "bfloat16"), jax_rounded_to_bfloat16("bf16-jax")
    report = run(cases=[CASE], impls=(torch_layer, jax_layer), dtypes=(dtype,), checks=("forward", "gradient"),
                 device="cpu")
    pair = [r for r in report.rows if r.impl == torch_layer.name and r.reference == jax_layer.name]
    assert {(r.check, r.quantity) for r in pair} == {("forward", "output"), ("forward", "weights"),
                                                    ("gradient", "d_inputs"), ("gradient", "d_params")}
    # the two differ by bfloat16's rounding, which float32's yardstick does not cover
    assert max(r.max_abs_err for r in pair) > 1e-4
    assert all(r.status == "pass" for r in pair), [(r.check, r.quantity, r.message) for r in pair]
    assert report.ok, [(r.impl, r.reference, r.quantity, r.message) for r in report.rows if r.status != "pass"]
