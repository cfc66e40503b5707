"""Equinox (parity.peers.equinox) against ours on converted weights: equinox.nn.MultiheadAttention's
masked-row policy, the converters' round trips and refusals, and the equinox-mha adapter against
the oracle."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SIZES, make_inputs, random_keep_mask
from helpers import DTYPES, cast_sd, np_dtype
from parity import convert, reference
from parity.peers.equinox import equinox_mha_forward
from parity.tolerances import compare, tolerance_for
from peer_helpers import assert_bit_identical, ours_both

S = SIZES


@pytest.fixture(scope="module")
def eqx_module():
    """A real equinox MHA with all four biases, equinox's own random init, float64."""
    biases = {f"use_{w}_bias": True for w in ("query", "key", "value", "output")}
    return eqx.nn.MultiheadAttention(S.N, S.E, dtype=jnp.float64, key=jax.random.PRNGKey(11), **biases)

def test_equinox_matches_ours_in_float64(eqx_module, rng):
    """Equinox is unbatched (vmapped here); mask (T, S) True = attend; a fully masked row is the mean of V."""
    sd = convert.from_equinox(eqx_module)
    assert sd["q_proj.weight"].dtype == np.float64 and np.abs(sd["v_proj.bias"]).min() > 0
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    expected = np.asarray(jax.vmap(lambda q, k, v, m: eqx_module(q, k, v, mask=m, inference=True))(q, k, v, keep))
    for framework, out in ours_both(sd, "uniform", q, k, v, keep):
        c = compare(out, expected, tolerance_for("float64").forward)
        assert c.passed, (framework, c)

def test_equinox_round_trip_into_the_real_module_is_bit_exact(eqx_module):
    back = convert.to_equinox(convert.from_equinox(eqx_module), S.N)
    for a, b in zip(jax.tree.leaves(eqx_module), jax.tree.leaves(back)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()

@pytest.mark.parametrize("dtype", DTYPES)
def test_equinox_round_trips_every_dtype(dtype, sd64):
    sd = cast_sd(sd64, np_dtype(dtype))
    assert_bit_identical(convert.from_equinox(convert.to_equinox(sd, S.N)), sd)


def test_equinox_without_biases_is_an_error_not_a_zero():
    m = eqx.nn.MultiheadAttention(S.N, S.E, use_query_bias=True, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"\['use_key_bias', 'use_value_bias', 'use_output_bias'\] = False"):
        convert.from_equinox(m)


# ------------------------------------------------------------- the peer adapter vs the oracle


def test_equinox_adapter_follows_its_measured_policy(sd64, rng):
    """equinox_mha_forward (the equinox-mha peer's function, the real module inside) vs the float64
    oracle under the "uniform" policy, in float64."""
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    expected = reference.forward(sd64, q, k, v, keep, num_heads=S.N, masked_rows="uniform").output
    c = compare(equinox_mha_forward(sd64, S.N, q, k, v, keep, "float64"), expected, tolerance_for("float64").forward)
    assert c.passed, c
