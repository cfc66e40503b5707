"""--checkpoint with T < S: the T queries are the newest of S tokens, so with RoPE their positions
are the last T of the keys' (where the bottom-right causal mask puts them)."""

from __future__ import annotations

import numpy as np
import pytest
from torch.func import functional_call

from mha_spec import AttentionConfig
from parity import convert, draw
from parity.harness import checkpoint, run
from parity.harness.matrix import SHAPES, Case, draw_inputs
from parity.harness.runner import case_inputs
from parity.impls import implementation

B, T, S = 3, 5, 7
CONFIG = AttentionConfig(12, 3, num_kv_heads=1, rope="half", rope_theta=500.0)  # H = 4


@pytest.mark.parametrize("redraw", [(), ("q_proj.bias",)])
def test_query_positions_are_the_last_of_the_key_positions(redraw):
    for case in checkpoint.cases(CONFIG, B, T, S, redraw=redraw):
        x, matrix = case_inputs(case, 0), draw_inputs(case, 0)
        assert x.positions.shape == (B, T) and x.key_positions.shape == (B, S)
        np.testing.assert_array_equal(x.positions, x.key_positions[:, S - T:])
        # Everything else is the matrix's draw, the key positions included.
        np.testing.assert_array_equal(x.key_positions, matrix.key_positions)
        for name in ("query", "key", "value", "cotangent"):
            np.testing.assert_array_equal(getattr(x, name), getattr(matrix, name))
        assert not np.array_equal(matrix.positions, x.positions)  # the matrix's own draw differs


def test_self_attention_and_the_matrix_cases_keep_their_draw():
    for case in checkpoint.cases(CONFIG, B, S, S):  # T == S: one sequence
        x = case_inputs(case, 0)
        np.testing.assert_array_equal(x.positions, x.key_positions)
    cross = Case(SHAPES["cross"], "causal", "nan")  # a matrix case: no positions, the matrix's draw
    assert case_inputs(cross, 0).positions is None
    np.testing.assert_array_equal(case_inputs(cross, 0).query, draw_inputs(cross, 0).query)


@implementation(name="decoder-with-cache", framework="torch", mode="eager", mask="keep", masked_rows="nan",
                returns_weights=False, variants=("grouped", "rope-half"))
def decoder_with_cache(state_dict, num_heads, *, dtype, device, problem):
    """Our torch module as a decoder with a cache calls it: the queries' positions are the last T of
    the S positions the cache holds, whatever positions it is given."""
    c = problem.config
    m = convert.to_torch(state_dict, num_heads, num_kv_heads=c.num_kv_heads, rope=c.rope, rope_theta=c.rope_theta).to(device)

    def fn(params, query, key, value, keep, *, positions, key_positions):
        newest = key_positions[:, key_positions.shape[1] - query.shape[1]:]
        kw = {"need_weights": False, "positions": newest, "key_positions": key_positions}
        return functional_call(m, params, (query, key, value, keep), kw)[0]

    return fn


def test_a_decoder_with_a_cache_passes_the_checkpoint_case():
    sd = draw.state_dict(np.random.default_rng(3), CONFIG)
    causal = checkpoint.cases(CONFIG, B, T, S)[:1]  # checkpoint/causal/nan: no row keeps nothing
    report = run(cases=causal, state_dict=sd, impls=["torch", decoder_with_cache], dtypes=("float64",),
                 checks=("forward",), device="cpu")
    mine = [r for r in report.rows if r.impl == "decoder-with-cache" and r.quantity == "output"]
    assert mine and all(r.status == "pass" for r in mine), mine
    assert report.ok
