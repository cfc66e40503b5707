"""flax linen and nnx multi-head attention (parity.peers.flax) against ours on converted weights:
the "uniform" policy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen

from conftest import SIZES, make_inputs, random_keep_mask
from helpers import cast_sd
from parity import convert, reference
from parity.tolerances import compare, tolerance_for
from peer_helpers import ours

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
