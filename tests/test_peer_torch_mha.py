"""torch.nn.MultiheadAttention (parity.peers.torch_mha): its converters (the packed in_proj table, round
trips, refusals) and the module against ours on converted weights: its mask polarity and its
masked-row policy, with and without weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import SIZES, make_inputs, random_keep_mask
from helpers import DTYPES, cast_sd, np_dtype
from parity import convert
from parity.tolerances import compare, tolerance_for
from peer_helpers import assert_bit_identical, ours

S = SIZES


@pytest.mark.parametrize("need_weights", [True, False])
def test_torch_mha_peer(need_weights, sd64, rng):
    """torch.nn.MultiheadAttention masks where True: pass ~keep, per batch*head for a 3-D mask.

    With need_weights=True a fully masked row is NaN (our "nan"); with need_weights=False it
    takes SDPA's fast path and gives a zero context (our "zero").
    """
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    peer = convert.to_torch_mha(sd64, S.N)
    attn_mask = torch.from_numpy(~np.repeat(keep, S.N, axis=0))  # (B*N, T, S), True = masked
    with torch.no_grad():
        out, w = peer(*(torch.from_numpy(x) for x in (q, k, v)), attn_mask=attn_mask, need_weights=need_weights, average_attn_weights=False)
    policy = "nan" if need_weights else "zero"
    ours_out, ours_w = ours(sd64, policy, q, k, v, keep)
    tol = tolerance_for("float64").forward
    c = compare(out.numpy(), ours_out, tol)
    assert c.passed, c
    if need_weights:
        c = compare(w.numpy(), ours_w, tol)
        assert c.passed, c

def test_from_torch_mha_accepts_batch_first_false(sd64, rng):
    """The weights do not depend on batch_first: the same sd gives the same attention, sequence-first."""
    seq_first = convert.to_torch_mha(sd64, S.N, batch_first=False)
    assert seq_first.batch_first is False
    assert_bit_identical(convert.from_torch_mha(seq_first), sd64)
    q, k, v = make_inputs(rng)
    with torch.no_grad():
        out, _ = seq_first(*(torch.from_numpy(x.transpose(1, 0, 2)) for x in (q, k, v)))
    mine = ours(sd64, "nan", q, k, v, None)[0]
    c = compare(out.numpy().transpose(1, 0, 2), mine, tolerance_for("float64").forward)
    assert c.passed, c


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_mha_round_trip_is_bit_identical(dtype, sd64):
    sd = cast_sd(sd64, np_dtype(dtype))
    assert_bit_identical(convert.from_torch_mha(convert.to_torch_mha(sd, S.N)), sd)


def test_torch_mha_packing(sd64):
    m = convert.to_torch_mha(sd64, S.N)
    E = S.E
    np.testing.assert_array_equal(m.in_proj_weight.detach().numpy()[E : 2 * E], sd64["k_proj.weight"])
    np.testing.assert_array_equal(m.in_proj_bias.detach().numpy()[2 * E :], sd64["v_proj.bias"])


def test_torch_mha_unsupported_configs_are_named():
    with pytest.raises(ValueError, match="packed in_proj_weight"):
        convert.from_torch_mha(torch.nn.MultiheadAttention(12, 3, batch_first=True, kdim=8, vdim=8))
