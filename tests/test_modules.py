"""The two modules against the float64 oracle and each other, each test on both frameworks: every
semantic point of the core issue. What one framework alone does (autograd, torch.compile, jax.jit,
nnx.grad, x64), the variants and the oracle's own checks: tests/test_torch_attention.py,
tests/test_jax_attention.py, tests/test_oracle.py."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import mha_jax
import mha_torch
from conftest import SIZES, make_inputs, make_state_dict, random_keep_mask
from helpers import assert_close, build, cast_sd, np_dtype, oracle, run
from parity import reference
from parity.tolerances import compare_three_way, tolerance_for

FRAMEWORKS = ("torch", "jax")
S = SIZES


# ------------------------------------------------------------- 1. cross-attention


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cross_attention_matches_oracle(framework, need_weights, dtype, sd64, rng):
    q, k, v = (x.astype(dtype) for x in make_inputs(rng))
    sd = cast_sd(sd64, dtype)
    m = build(framework, sd, S.N)
    out, w = run(framework, m, q, k, v, need_weights=need_weights)
    ref = oracle(sd, q, k, v)
    assert out.shape == (S.B, S.T, S.E) and out.dtype == np.dtype(dtype)
    assert_close(out, ref.output, dtype)
    if need_weights:
        assert w.shape == (S.B, S.N, S.T, S.S)
        assert_close(w, ref.weights, dtype)
    else:
        assert w is None


# ------------------------------------------------------------- 2. masks


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("mask_dtype", [np.bool_, np.int32, np.float32])
def test_3d_mask_is_per_batch_not_per_head(framework, need_weights, mask_dtype, sd64, rng):
    """A [B, T, S] mask with B != N: batch b must use mask[b] (the classic code broadcasts it wrongly)."""
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    m = build(framework, sd64, S.N, masked_rows="zero")
    out, _ = run(framework, m, q, k, v, keep.astype(mask_dtype), need_weights=need_weights)
    for b in range(S.B):  # independent expectation: one batch element at a time with its 2-D mask
        ref_b = oracle(sd64, q[b : b + 1], k[b : b + 1], v[b : b + 1], keep[b], masked_rows="zero")
        assert_close(out[b : b + 1], ref_b.output)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("shape", [(S.T, S.S), (S.B, 1, S.T, S.S), (S.B, S.N, S.T, S.S), (1, S.N, 1, S.S)])
def test_mask_shapes_broadcast(framework, shape, sd64, rng):
    q, k, v = make_inputs(rng)
    keep = rng.random(shape) > 0.3
    keep[..., 0] = True
    full = np.broadcast_to(keep.reshape((1,) * (4 - len(shape)) + shape), (S.B, S.N, S.T, S.S))
    m = build(framework, sd64, S.N)
    for need_weights in (True, False):
        out, w = run(framework, m, q, k, v, keep, need_weights=need_weights)
        ref = oracle(sd64, q, k, v, full)
        assert_close(out, ref.output)
        if need_weights:
            assert_close(w, ref.weights)
            assert np.all(w[~full] == 0)  # masked keys get exactly zero weight


# ------------------------------------------------------------- 3. fully masked rows


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("need_weights", [True, False])
def test_masked_row_policies(framework, need_weights, sd64, rng):
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.B, S.T, S.S), fully_masked_row=(1, 2))
    row = (1, 2)
    outs = {}
    for policy in ("nan", "zero", "uniform"):
        m = build(framework, sd64, S.N, masked_rows=policy)
        out, w = run(framework, m, q, k, v, keep, need_weights=need_weights)
        outs[policy] = out
        ref = oracle(sd64, q, k, v, keep, masked_rows=policy)
        assert_close(out, ref.output)
        if policy == "nan":
            assert np.isnan(out[row]).all()
            if need_weights:
                assert np.isnan(w[row[0], :, row[1]]).all()
        elif policy == "zero":  # context 0, so the output is exactly out_proj's bias
            np.testing.assert_array_equal(out[row], sd64["out_proj.bias"])
            if need_weights:
                assert np.all(w[row[0], :, row[1]] == 0)
        else:  # uniform: the context is the mean of the projected values
            v_proj = v[row[0]] @ sd64["v_proj.weight"].T + sd64["v_proj.bias"]
            expected = v_proj.mean(axis=0) @ sd64["out_proj.weight"].T + sd64["out_proj.bias"]
            np.testing.assert_allclose(out[row], expected, rtol=1e-12, atol=1e-12)
            if need_weights:
                np.testing.assert_allclose(w[row[0], :, row[1]], 1.0 / S.S, rtol=1e-15)
        assert not np.isnan(np.delete(out.reshape(-1, S.E), row[0] * S.T + row[1], axis=0)).any()
    others = np.ones((S.B, S.T), bool)
    others[row] = False
    for policy in ("zero", "uniform"):  # other rows are bit-identical under every policy
        np.testing.assert_array_equal(outs[policy][others], outs["nan"][others])


@pytest.mark.parametrize("policy", ["nan", "zero", "uniform"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_policies_agree_across_frameworks(policy, need_weights, sd64, rng):
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    out_t, w_t = run("torch", build("torch", sd64, S.N, masked_rows=policy), q, k, v, keep, need_weights=need_weights)
    out_j, w_j = run("jax", build("jax", sd64, S.N, masked_rows=policy), q, k, v, keep, need_weights=need_weights)
    assert_close(out_t, out_j)
    if need_weights:
        assert_close(w_t, w_j)


# ------------------------------------------------------------- 4. precision


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_output_keeps_input_dtype(framework, dtype, need_weights, sd64, rng):
    dt = np_dtype(dtype)
    q, k, v = (x.astype(dt) for x in make_inputs(rng))
    m = build(framework, cast_sd(sd64, dt), S.N)
    out, w = run(framework, m, q, k, v, need_weights=need_weights)
    assert out.dtype == dt
    if need_weights:
        assert w.dtype == dt


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_16bit_three_way_against_oracle(framework, dtype, need_weights, rng):
    """Large logits (weights scaled x3), so rounding the scores to 16 bits would show."""
    dt = np_dtype(dtype)
    sd = cast_sd(make_state_dict(rng, S.E, scale=1.5), dt)
    q, k, v = (x.astype(dt) for x in make_inputs(rng))
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    m = build(framework, sd, S.N, masked_rows="zero")
    out, w = run(framework, m, q, k, v, keep, need_weights=need_weights)
    exact = oracle({n: reference.as_float64(a) for n, a in sd.items()}, *(reference.as_float64(x) for x in (q, k, v)), keep, "zero")
    low = oracle(sd, *(reference.as_float64(x) for x in (q, k, v)), keep, "zero", dtype=dt)
    tol = tolerance_for(dt)
    c = compare_three_way(out, exact.output, low.output, tol.three_way_k, tol.forward.atol)
    assert c.passed, c
    if need_weights:
        c = compare_three_way(w, exact.weights, low.weights, tol.three_way_k, tol.forward.atol)
        assert c.passed, c


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bfloat16_softmax_accumulates_in_float32(framework):
    """300 equal logits: a bfloat16 running sum stalls at 256 (1 + 256 == 256), giving 1/256, not 1/300."""
    E, N, L = 4, 1, 300
    sd = {f"{p}.{w}": np.zeros((E, E) if w == "weight" else (E,), ml_dtypes.bfloat16) for p in ("q_proj", "k_proj", "v_proj", "out_proj") for w in ("weight", "bias")}
    x = np.ones((1, 1, E), ml_dtypes.bfloat16)
    kv = np.ones((1, L, E), ml_dtypes.bfloat16)
    m = build(framework, sd, N)
    _, w = run(framework, m, x, kv, kv)
    np.testing.assert_array_equal(w.astype(np.float64), np.float64(ml_dtypes.bfloat16(1.0 / L)))


# ------------------------------------------------------------- 5./6. fused path, jit, grad, compile
# One framework's each: tests/test_torch_attention.py, tests/test_jax_attention.py.


# ------------------------------------------------------------- 7. bad input


def _torch_factory(E, N, **kw):
    return mha_torch.MultiHeadAttention(E, N, dtype=torch.float64, **kw)


def _jax_factory(E, N, **kw):
    from flax import nnx

    return mha_jax.MultiHeadAttention(E, N, rngs=nnx.Rngs(0), param_dtype=jnp.float64, **kw)


FACTORIES = {"torch": _torch_factory, "jax": _jax_factory}


def _array(framework, x):
    return torch.from_numpy(np.asarray(x)) if framework == "torch" else jnp.asarray(x)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_config(framework):
    with pytest.raises(ValueError, match="embed_dim=10 is not divisible by num_heads=3"):
        FACTORIES[framework](10, 3)
    with pytest.raises(ValueError, match="masked_rows='ignore'"):
        FACTORIES[framework](12, 3, masked_rows="ignore")


BAD_INPUTS = [
    # (query shape, key shape, value shape, mask shape or None, message fragment)
    ((3, 5), (3, 7, 12), (3, 7, 12), None, r"query must have rank 3 .* \(3, 5\)"),
    ((3, 5, 11), (3, 7, 12), (3, 7, 12), None, r"query last dim must be embed_dim=12, got shape \(3, 5, 11\)"),
    ((3, 5, 12), (3, 7, 12), (3, 6, 12), None, r"same length, got key \(3, 7, 12\) and value \(3, 6, 12\)"),
    ((3, 5, 12), (2, 7, 12), (2, 7, 12), None, r"batch sizes differ: query \(3, 5, 12\), key \(2, 7, 12\)"),
    ((3, 5, 12), (3, 7, 12), (3, 7, 12), (3, 5, 6), r"mask of shape \(3, 5, 6\) .* does not broadcast to \[B, N, T, S\] = \(3, 3, 5, 7\)"),
    ((3, 5, 12), (3, 7, 12), (3, 7, 12), (2, 3, 5, 7), r"mask of shape \(2, 3, 5, 7\)"),
    ((3, 5, 12), (3, 7, 12), (3, 7, 12), (7,), r"mask must have rank 2 .* got shape \(7,\)"),
]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("q_shape, k_shape, v_shape, mask_shape, message", BAD_INPUTS)
@pytest.mark.parametrize("need_weights", [True, False])
def test_bad_input_shapes(framework, q_shape, k_shape, v_shape, mask_shape, message, need_weights):
    m = FACTORIES[framework](12, 3)
    args = [_array(framework, np.zeros(s)) for s in (q_shape, k_shape, v_shape)]
    mask = None if mask_shape is None else _array(framework, np.ones(mask_shape, bool))
    with pytest.raises(ValueError, match=message):
        m(*args, mask, need_weights=need_weights)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_input_types(framework):
    m = FACTORIES[framework](12, 3)
    x = np.zeros((3, 5, 12))
    with pytest.raises(TypeError, match="float32"):  # no silent promotion or demotion
        m(_array(framework, x.astype(np.float32)), _array(framework, x), _array(framework, x))
    with pytest.raises(TypeError, match="mask must be bool, int or float"):
        m(*(_array(framework, x) for _ in range(3)), _array(framework, np.ones((5, 5), np.complex64)))
    with pytest.raises(TypeError, match="query must be a"):
        m([[0.0]], _array(framework, x), _array(framework, x))

