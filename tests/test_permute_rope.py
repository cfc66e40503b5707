"""convert.permute_rope checks k's rows against the key/value heads it is told.

A grouped layer whose k rows happen to divide into 2 * num_heads blocks (here K·H = 16 rows,
num_heads = 4) would pass a divisibility test with num_kv_heads omitted and be permuted in
blocks of the wrong size.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity import convert, reference

B, T, N, K, H = 2, 5, 4, 2, 8  # K·H = 16 rows, a multiple of 2·N = 8
E = N * H


def _meta_sd(rng):
    """A grouped, bias-free, Meta-layout (rope="interleaved") layer, as Llama 2 70B / Llama 3 store it."""
    shapes = {"q_proj.weight": (N * H, E), "k_proj.weight": (K * H, E), "v_proj.weight": (K * H, E),
              "out_proj.weight": (E, N * H)}
    return {name: rng.standard_normal(shape) / np.sqrt(shape[1]) for name, shape in shapes.items()}


@pytest.mark.parametrize("to", ["half", "interleaved"])
def test_grouped_checkpoint_without_num_kv_heads_names_k_and_the_heads(to):
    sd = _meta_sd(np.random.default_rng(0))
    with pytest.raises(ValueError) as err:
        convert.permute_rope(sd, num_heads=N, to=to)
    msg = str(err.value)
    assert msg.startswith(f"k_proj.weight has shape {(K * H, E)}"), msg
    assert f"num_kv_heads=None means num_heads={N}" in msg and f"head_dim {H}" in msg and f"need {N * H} rows" in msg
    assert f"pass num_kv_heads={K}" in msg, msg


def test_a_k_bias_of_another_width_is_named():
    sd = _meta_sd(np.random.default_rng(1))
    sd["k_proj.bias"] = np.zeros(H)  # one head's worth: a multiple of 2·K, so only the head dim exposes it
    with pytest.raises(ValueError, match=rf"k_proj.bias has shape \({H},\), but num_kv_heads={K} key/value heads "
                                         rf"of head_dim {H} \(from q_proj.weight\) need {K * H} rows"):
        convert.permute_rope(sd, num_heads=N, num_kv_heads=K, to="half")


def test_grouped_checkpoint_with_num_kv_heads_round_trips_and_keeps_the_output():
    rng = np.random.default_rng(2)
    sd = _meta_sd(rng)
    half = convert.permute_rope(sd, num_heads=N, num_kv_heads=K, to="half")
    back = convert.permute_rope(half, num_heads=N, num_kv_heads=K, to="interleaved")
    for name in sd:
        np.testing.assert_array_equal(back[name], sd[name])
    x = rng.standard_normal((B, T, E))
    kw = dict(num_heads=N, num_kv_heads=K)
    meta = reference.forward(sd, x, x, x, rope="interleaved", **kw).output
    hf = reference.forward(half, x, x, x, rope="half", **kw).output
    np.testing.assert_allclose(hf, meta, rtol=1e-12, atol=1e-12)
