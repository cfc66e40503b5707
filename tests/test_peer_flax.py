"""flax linen and nnx multi-head attention (parity.peers.flax): the per-head layout table, round trips
and refusals of the converters, and the modules against ours on converted weights (the "uniform"
policy)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

from conftest import SIZES, make_inputs, random_keep_mask
from helpers import DTYPES, cast_sd, np_dtype
from parity import convert, reference
from parity.tolerances import compare, tolerance_for
from peer_helpers import assert_bit_identical, ours

S = SIZES


@pytest.mark.parametrize("peer_kind", ["linen", "nnx"])
def test_flax_peers_are_the_uniform_policy(peer_kind, sd64, rng):
    """flax masks where False (same polarity as ours) and gives fully masked rows uniform weights.

    flax computes its softmax in float32 even for float64 inputs, so it is compared in
    float32 with the float32 tolerance (its float64 deviation is the harness's to report).
    """
    sd = cast_sd(sd64, np.float32)
    q, k, v = (x.astype(np.float32) for x in make_inputs(rng))
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    if peer_kind == "linen":
        variables = convert.to_flax_linen(sd, S.N)
        out = linen.MultiHeadDotProductAttention(num_heads=S.N).apply(variables, q, k, v, mask=keep[:, None])
    else:
        out = convert.to_flax_nnx(sd, S.N)(q, k, v, mask=jnp.asarray(keep[:, None]))
    mine = ours(sd, "uniform", q, k, v, keep, framework="jax")[0]
    c = compare(np.asarray(out), mine, tolerance_for("float32").forward)
    assert c.passed, c
    exact = reference.forward(sd64, q, k, v, keep, num_heads=S.N, masked_rows="uniform")
    assert compare(np.asarray(out), exact.output, tolerance_for("float32").forward).passed


@pytest.mark.parametrize("dtype", DTYPES)
def test_flax_nnx_round_trip_is_bit_identical(dtype, sd64):
    sd = cast_sd(sd64, np_dtype(dtype))
    assert_bit_identical(convert.from_flax_nnx(convert.to_flax_nnx(sd, S.N)), sd)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flax_linen_round_trip_is_bit_identical(dtype, sd64):
    sd = cast_sd(sd64, np_dtype(dtype))
    assert_bit_identical(convert.from_flax_linen(convert.to_flax_linen(sd, S.N)), sd)


def test_flax_layout_table(sd64):
    """Head n owns features n*H .. n*H+H-1 of the classic layout; flax's kernel axes are (E, N, H) and (N, H, E)."""
    H = S.E // S.N
    p = convert.to_flax_linen(sd64, S.N)["params"]
    n, h, e = 2, 1, 5
    assert p["query"]["kernel"][e, n, h] == sd64["q_proj.weight"][n * H + h, e]
    assert p["value"]["bias"][n, h] == sd64["v_proj.bias"][n * H + h]
    assert p["out"]["kernel"][n, h, e] == sd64["out_proj.weight"][e, n * H + h]


def test_flax_linen_bad_tree(sd64):
    variables = convert.to_flax_linen(sd64, S.N)
    with pytest.raises(ValueError, match=r"missing keys \['params'\]"):
        convert.from_flax_linen(variables["params"])
    del variables["params"]["out"]["bias"]
    with pytest.raises(ValueError, match=r"\['out'\]: missing keys \['bias'\]"):
        convert.from_flax_linen(variables)


def test_flax_linen_malformed_trees_are_clear_errors(sd64):
    """Not AttributeError: a non-mapping level or a non-array leaf is a TypeError naming where."""
    good = convert.to_flax_linen(sd64, S.N)["params"]
    with pytest.raises(TypeError, match=r"flax.linen params must be a mapping, got int"):
        convert.from_flax_linen({"params": 5})
    with pytest.raises(TypeError, match=r"\['key'\] must be a mapping, got list"):
        convert.from_flax_linen({"params": dict(good, key=[1, 2])})
    with pytest.raises(TypeError, match=r"\['out'\]\['kernel'\] must be an array, got str"):
        convert.from_flax_linen({"params": dict(good, out={"kernel": "w", "bias": good["out"]["bias"]})})


def test_flax_nnx_grouped_heads_are_named():
    with pytest.raises(ValueError, match="GQA|grouped"):
        convert.from_flax_nnx(nnx.MultiHeadAttention(4, 12, num_kv_heads=2, rngs=nnx.Rngs(0), decode=False))
