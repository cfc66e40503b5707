"""F.scaled_dot_product_attention (parity.peers.sdpa) on our projections: the "zero" policy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conftest import SIZES, make_inputs, random_keep_mask
from parity.tolerances import compare, tolerance_for
from peer_helpers import ours

S = SIZES


def test_sdpa_peer_is_the_zero_policy(sd64, rng):
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    H = S.E // S.N

    def proj(x, p):
        y = x @ sd64[f"{p}.weight"].T + sd64[f"{p}.bias"]
        return torch.from_numpy(y.reshape(*y.shape[:2], S.N, H).transpose(0, 2, 1, 3))

    ctx = F.scaled_dot_product_attention(proj(q, "q_proj"), proj(k, "k_proj"), proj(v, "v_proj"), attn_mask=torch.from_numpy(keep[:, None]))
    ctx = ctx.numpy().transpose(0, 2, 1, 3).reshape(S.B, S.T, S.E)
    out = ctx @ sd64["out_proj.weight"].T + sd64["out_proj.bias"]
    c = compare(out, ours(sd64, "zero", q, k, v, keep)[0], tolerance_for("float64").forward)
    assert c.passed, c
