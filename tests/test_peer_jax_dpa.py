"""jax.nn.dot_product_attention (parity.peers.jax_dpa) on our projections: the "uniform" policy."""

from __future__ import annotations

import numpy as np

from conftest import SIZES, make_inputs, random_keep_mask
from helpers import cast_sd
from parity.tolerances import compare, tolerance_for
from peer_helpers import ours

S = SIZES


def test_jax_dot_product_attention_peer_is_the_uniform_policy(sd64, rng):
    """jax.nn.dot_product_attention (True = attend, layout BTNH) on our projections, float32."""
    import jax

    sd = cast_sd(sd64, np.float32)
    q, k, v = (x.astype(np.float32) for x in make_inputs(rng))
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    H = S.E // S.N

    def proj(x, p):
        return (x @ sd[f"{p}.weight"].T + sd[f"{p}.bias"]).reshape(x.shape[0], x.shape[1], S.N, H)

    ctx = jax.nn.dot_product_attention(proj(q, "q_proj"), proj(k, "k_proj"), proj(v, "v_proj"), mask=keep[:, None])
    out = np.asarray(ctx).reshape(S.B, S.T, S.E) @ sd["out_proj.weight"].T + sd["out_proj.bias"]
    c = compare(out, ours(sd, "uniform", q, k, v, keep, framework="jax")[0], tolerance_for("float32").forward)
    assert c.passed, c
