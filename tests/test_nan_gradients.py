"""Where NaN lands in the gradients when a key or value holds NaN at a masked position (and a
query NaN on a row that keeps no key).

The float64 oracle (`parity.reference.backward`) is the reference: its query gradient is
dS·K over every key, masked ones included (dS is 0 there, and 0 x NaN is NaN), and a row
that keeps no key is a constant of the policy (no gradient reaches its query). Both fused
paths are held to it, on every JAX kernel; the JAX kernels run with 2 x 3 blocks, so the
key block holding key 6 (masked on every row) is one the chunked kernel skips.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import SIZES, make_inputs, make_state_dict
from helpers import build
from parity import reference
from parity.tolerances import compare, tolerance_for

S = SIZES
GRADS = ("query", "key", "value")


def _keep(rng):
    keep = rng.random((S.B, S.T, S.S)) > 0.3
    keep[..., 0] = True
    keep[:, :, 6] = False  # key 6 masked on every row: its 2 x 3 block keeps nothing
    keep[:, 2] = False  # query row 2 keeps no key: the policy's row
    return keep


def _scenario(name, rng):
    """(query, key, value, keep, the gradients whose NaN placement is checked)."""
    q, k, v = make_inputs(rng)
    keep = _keep(rng)
    if name == "key":
        k[1, 6] = np.nan  # batch 1: a key no row keeps, in a block no row keeps
        keep[2, :, 4] = False
        k[2, 4] = np.nan  # batch 2: a key no row keeps, in a block other batches keep
        return q, k, v, keep, GRADS
    if name == "query":
        q[1, 2] = np.nan  # the query of batch 1's row that keeps no key
        # The key gradient is left out: the oracle's is NaN on every key there (0 x NaN), and the
        # chunked kernel skips key 6's block (docs/semantics.md).
        return q, k, v, keep, ("query", "value")
    keep[1, :, 4] = False
    v[1, 4] = np.nan  # a value no row keeps: every output row of batch 1 is NaN
    # The key gradient is left out: the oracle's dS = P ∘ (dP - D) is NaN at masked entries too
    # (P = 0 there, D is NaN), where autodiff of the masked scores (both weights paths) gives 0
    # (docs/semantics.md, "NaN in, NaN out").
    return q, k, v, keep, ("query", "value")


def _kept_key_scenario(rng):
    q, k, v = make_inputs(rng)
    keep = _keep(rng)
    keep[1, :, 4] = False
    keep[1, 3, 4] = True  # only row 3 of batch 1 keeps key 4, which is NaN: that row is NaN
    k[1, 4] = np.nan
    return q, k, v, keep


def _torch_grads(sd, policy, q, k, v, keep, g):
    m = build("torch", sd, S.N, masked_rows=policy)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out, _ = m(tq, tk, tv, torch.from_numpy(keep), need_weights=False)
    (out * torch.from_numpy(g)).sum().backward()
    return dict(zip(GRADS, (t.grad.numpy() for t in (tq, tk, tv))))


def _jax_grads(sd, policy, q, k, v, keep, g):
    m = build("jax", sd, S.N, masked_rows=policy)
    grads = jax.grad(lambda q, k, v: jnp.sum(m(q, k, v, keep, need_weights=False)[0] * g), argnums=(0, 1, 2))(q, k, v)
    return dict(zip(GRADS, (np.asarray(x) for x in grads)))


def _grads(path, sd, policy, q, k, v, keep, g, force):
    if path == "torch-fused":
        return _torch_grads(sd, policy, q, k, v, keep, g)
    force(path.removeprefix("jax-"))
    return _jax_grads(sd, policy, q, k, v, keep, g)


def _tolerance(path):
    # jax.nn.dot_product_attention's XLA softmax runs in float32 whatever the inputs are.
    return tolerance_for("float32" if path == "jax-dpa-xla" else "float64").gradient


# A known difference, kept red: writing these NaNs into the torch fused path's gradients took plain
# elementwise passes over q, k and v on every masked call, which measured 185 -> 254 ms forward and
# 555 -> 687 ms fwd+bwd (B=4 T=2048 causal, 2-core Intel Xeon, JAX rows unchanged in the same run),
# so it is not in; docs/semantics.md says where the torch fused path's gradient NaNs differ.
TORCH_FUSED = pytest.param("torch-fused", marks=pytest.mark.xfail(
    strict=True, reason="torch fused path: NaN gradient placement differs from the oracle (docs/semantics.md)"))


@pytest.mark.parametrize("scenario, policy", [("key", "uniform"), ("key", "nan"), ("value", "uniform"), ("query", "zero")])
@pytest.mark.parametrize("path", [TORCH_FUSED, "jax-einsum", "jax-chunked", "jax-dpa-xla"])
def test_fused_gradients_put_nan_where_the_oracle_does(path, scenario, policy, forced_kernel):
    rng = np.random.default_rng(21)
    sd = make_state_dict(rng, S.E)
    q, k, v, keep, checked = _scenario(scenario, rng)
    g = rng.standard_normal((S.B, S.T, S.E))
    ref = reference.backward(sd, q, k, v, keep, g, num_heads=S.N, masked_rows=policy)
    got = _grads(path, sd, policy, q, k, v, keep, g, forced_kernel)
    tol = _tolerance(path)
    for name in checked:
        c = compare(got[name], ref[name], tol)  # NaNs required at the oracle's places, nowhere else
        assert c.passed, (name, c)
    # The comparisons can fail: the oracle's query gradient is NaN on a batch element's every row
    # (the policy's row included) for a NaN key, and finite on the policy's row for a NaN value.
    d_query = np.isnan(ref["query"]).reshape(S.B, S.T, S.E)
    if scenario == "key":
        assert d_query[1].all() and d_query[2].all() and not d_query[0].any()
    elif scenario == "query":  # nor NaN in the value gradient: the row's weights are the policy's constant
        assert not d_query.any() and not np.isnan(ref["value"]).any() and np.isnan(ref["key"][1]).all()
    else:
        assert d_query[1].any() and not d_query[1, 2].any()


@pytest.mark.parametrize("path", [TORCH_FUSED, "jax-einsum", "jax-dpa-xla"])
def test_a_kept_nan_key_makes_every_value_gradient_of_its_head_nan(path, forced_kernel):
    """The row that keeps the NaN key has NaN weights on every key, so V's gradient is NaN on every
    key of that batch element, as the oracle's (and the weights paths') is; the query gradient is
    NaN there too. (The chunked kernel skips key 6's block, so its V gradient there stays finite;
    docs/semantics.md.)"""
    rng = np.random.default_rng(22)
    sd = make_state_dict(rng, S.E)
    q, k, v, keep = _kept_key_scenario(rng)
    g = rng.standard_normal((S.B, S.T, S.E))
    ref = reference.backward(sd, q, k, v, keep, g, num_heads=S.N, masked_rows="uniform")
    got = _grads(path, sd, "uniform", q, k, v, keep, g, forced_kernel)
    for name in ("query", "value"):
        c = compare(got[name], ref[name], _tolerance(path))
        assert c.passed, (name, c)
    assert np.isnan(ref["value"][1]).all() and not np.isnan(ref["value"][[0, 2]]).any()
