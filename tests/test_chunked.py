"""The chunked (online-softmax) JAX attention: oracle agreement with chunks smaller than the
sequence, the masked-row policies, gradients, and no (B, N, T, S) array in its program."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import mha_jax.attention
from conftest import make_state_dict, random_keep_mask
from helpers import build, run
from mha_jax import attention_core, chunked_attention
from parity import reference
from parity.tolerances import compare, tolerance_for

B, T, S, N, H = 2, 37, 29, 3, 4  # chunks of 8 and 5 leave ragged tails on both axes


def _qkv(rng, dtype=np.float64):
    return (rng.standard_normal(shape).astype(dtype) for shape in ((B, T, N, H), (B, S, N, H), (B, S, N, H)))


@pytest.mark.parametrize("policy", ["nan", "zero", "uniform"])
@pytest.mark.parametrize("mask_kind", ["none", "random", "causal"])
def test_chunked_matches_materialised_core(policy, mask_kind, rng):
    q, k, v = _qkv(rng)
    keep = None
    if mask_kind == "random":
        keep = random_keep_mask(rng, (B, 1, T, S), fully_masked_row=(1, 30))
    elif mask_kind == "causal":  # query t sees keys s <= t - 3: rows 0..2 see nothing
        keep = (np.arange(S)[None, :] <= np.arange(T)[:, None] - 3)[None, None]
    expected, _ = attention_core(q, k, v, keep, masked_rows=policy)
    got = chunked_attention(q, k, v, keep, masked_rows=policy, q_chunk=8, k_chunk=5)
    c = compare(np.asarray(got), np.asarray(expected), tolerance_for("float64").forward)
    assert c.passed, c
    if keep is not None and policy == "nan":
        assert np.isnan(np.asarray(got)).any()


def test_chunked_module_path_matches_oracle_with_grads(rng, monkeypatch):
    """Force the module's fused path onto the chunked kernel and check forward and VJP at 1e-12."""
    monkeypatch.setattr(mha_jax.attention, "MATERIALIZE_LIMIT", 0)
    E = N * H
    sd = make_state_dict(rng, E)
    x_q, x_k, x_v = rng.standard_normal((B, T, E)), rng.standard_normal((B, S, E)), rng.standard_normal((B, S, E))
    keep = random_keep_mask(rng, (B, T, S), fully_masked_row=(0, 4))
    g = rng.standard_normal((B, T, E))
    m = build("jax", sd, N, masked_rows="uniform")
    out, _ = run("jax", m, x_q, x_k, x_v, keep, need_weights=False)
    ref = reference.forward(sd, x_q, x_k, x_v, keep, num_heads=N, masked_rows="uniform")
    assert compare(out, ref.output, tolerance_for("float64").forward).passed
    grads = jax.grad(lambda a, b, c: jnp.sum(m(a, b, c, keep, need_weights=False)[0] * g), argnums=(0, 1, 2))(x_q, x_k, x_v)
    ref_g = reference.backward(sd, x_q, x_k, x_v, keep, g, num_heads=N, masked_rows="uniform")
    for name, got in zip(("query", "key", "value"), grads):
        c = compare(np.asarray(got), ref_g[name], tolerance_for("float64").gradient)
        assert c.passed, (name, c)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_low_precision_close_to_plain(dtype, rng):
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    q, k, v = _qkv(rng, dt)
    exact, _ = attention_core(*(x.astype(np.float64) for x in (q, k, v)))
    got = chunked_attention(q, k, v, q_chunk=8, k_chunk=5)
    plain, _ = attention_core(q, k, v)
    assert got.dtype == dt
    err_chunked = np.abs(np.asarray(got, np.float64) - np.asarray(exact)).max()
    err_plain = np.abs(np.asarray(plain, np.float64) - np.asarray(exact)).max()
    # Same accumulation dtype, different summation order: within 2x of the plain path's
    # error plus a few units of the dtype's rounding (measured: ratio ~1 in float32 and bfloat16).
    eps = float(jnp.finfo(dt).eps)
    assert err_chunked <= 2 * err_plain + 4 * eps, (err_chunked, err_plain)


def _largest_intermediate(jaxpr) -> int:
    """The largest element count of any value produced anywhere in a jaxpr, sub-jaxprs included."""
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            biggest = max(biggest, int(np.prod(var.aval.shape)) if var.aval.shape else 1)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            biggest = max(biggest, _largest_intermediate(sub))
    return biggest


@pytest.mark.parametrize("with_grad", [False, True])
def test_chunked_never_builds_the_score_tensor(with_grad):
    Bq, L, Nh, Hd = 1, 256, 2, 4
    q = jnp.zeros((Bq, L, Nh, Hd))

    def f(q):
        return chunked_attention(q, q, q, q_chunk=32, k_chunk=64).sum()

    fn = jax.grad(f) if with_grad else f
    biggest = _largest_intermediate(jax.make_jaxpr(fn)(q).jaxpr)
    assert biggest < Bq * Nh * L * L // 4, biggest  # far below the (B, N, T, S) = 131072 elements
    # and the check can fail: the materialised core does build it
    plain = jax.make_jaxpr(lambda q: attention_core(q, q, q)[0].sum())(q).jaxpr
    assert _largest_intermediate(plain) >= Bq * Nh * L * L
