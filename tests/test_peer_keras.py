"""Keras 3 (parity.peers.keras, JAX backend) against ours on converted weights: MultiHeadAttention
(its two paths and their masked-row policies) and GroupQueryAttention, the converters' round trips
and refusals (with the other classic-only peers' refusals of a grouped layer), the backend check,
and the keras-mha adapter against the oracle."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import SIZES, make_inputs, random_keep_mask
from helpers import DTYPES, cast_sd, np_dtype, run
from parity import convert, reference
from parity.peers.keras import keras_backend, keras_mha_forward
from parity.tolerances import compare, tolerance_for
from peer_helpers import assert_bit_identical, ours_both

keras = keras_backend()  # sets KERAS_BACKEND=jax before keras's first import

S = SIZES


@pytest.fixture(scope="module")
def keras_layer():
    """A real keras MHA, float32, every kernel and bias random (keras's Glorot init costs a ~5 s compile)."""
    layer = keras.layers.MultiHeadAttention(num_heads=S.N, key_dim=S.E // S.N, dtype="float32", kernel_initializer="zeros")
    layer.build(query_shape=(None, None, S.E), value_shape=(None, None, S.E))
    rng = np.random.default_rng(5)
    for w in layer.weights:
        w.assign(rng.uniform(-0.5, 0.5, w.shape).astype(np.float32))
    return layer

def test_keras_matches_ours(keras_layer, rng):
    """Keras's attention_mask has our polarity (True = attend); call order (query, value, key).

    Compared in float32: Keras's float64 run has a float32 stage (measured error 1e-7, see
    docs/conversion.md). A fully masked row comes out as the mean of V (our 'uniform').
    """
    sd = convert.from_keras(keras_layer)
    assert sd["q_proj.weight"].dtype == np.float32
    q, k, v = (x.astype(np.float32) for x in make_inputs(rng))
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    expected = np.asarray(keras_layer(q, v, key=k, attention_mask=keep, training=False))
    for framework, out in ours_both(sd, "uniform", q, k, v, keep):
        c = compare(out, expected, tolerance_for("float32").forward)
        assert c.passed, (framework, c)

def test_keras_softmax_path_zeroes_a_fully_masked_row(keras_layer, rng):
    """With return_attention_scores=True (or dropout > 0) Keras leaves jax.nn.dot_product_attention for its
    einsum + Softmax layer, which zeroes masked weights: a fully masked row is our 'zero' policy there."""
    sd = convert.from_keras(keras_layer)
    q, k, v = (x.astype(np.float32) for x in make_inputs(rng))
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    expected, weights = keras_layer(q, v, key=k, attention_mask=keep, training=False, return_attention_scores=True)
    assert not np.asarray(weights)[0, :, 1].any()  # the fully masked row's weights are all zero
    for framework, out in ours_both(sd, "zero", q, k, v, keep):
        c = compare(out, np.asarray(expected), tolerance_for("float32").forward)
        assert c.passed, (framework, c)

def test_keras_round_trip_into_the_real_layer_is_bit_exact(keras_layer):
    sd = convert.from_keras(keras_layer)
    back = convert.to_keras(sd, S.N)
    for a, b in zip(keras_layer.weights, back.weights):
        assert a.path.split("/", 1)[1] == b.path.split("/", 1)[1]
        assert np.asarray(a.value).tobytes() == np.asarray(b.value).tobytes(), a.path

@pytest.mark.parametrize("dtype", DTYPES)
def test_keras_round_trips_every_dtype(dtype, sd64):
    sd = cast_sd(sd64, np_dtype(dtype))
    assert_bit_identical(convert.from_keras(convert.to_keras(sd, S.N)), sd)


def test_keras_unsupported_layers_are_named():
    with pytest.raises(ValueError, match="not built yet"):
        convert.from_keras(keras.layers.MultiHeadAttention(num_heads=3, key_dim=4, kernel_initializer="zeros"))
    layer = keras.layers.MultiHeadAttention(num_heads=3, key_dim=4, use_bias=False, kernel_initializer="zeros")
    layer.build(query_shape=(None, None, 12), value_shape=(None, None, 12))
    with pytest.raises(ValueError, match="use_bias=True"):
        convert.from_keras(layer)
    with pytest.raises(TypeError, match="expected keras.layers.MultiHeadAttention or keras.layers.GroupQueryAttention, got Dense"):
        convert.from_keras(keras.layers.Dense(3))

# keras.layers.GroupQueryAttention: N=6 query heads, K=2 key/value heads, H=4 (tests/test_convert.py TestRope sizes)
GN, GK, GH = 6, 2, 4

GE = GN * GH

@pytest.fixture(scope="module")
def keras_gqa():
    """A real keras GroupQueryAttention, float32, every kernel and bias random."""
    layer = keras.layers.GroupQueryAttention(head_dim=GH, num_query_heads=GN, num_key_value_heads=GK, dtype="float32",
                                             kernel_initializer="zeros")
    layer.build(query_shape=(None, None, GE), value_shape=(None, None, GE))
    rng = np.random.default_rng(6)
    for w in layer.weights:
        w.assign(rng.uniform(-0.3, 0.3, w.shape).astype(np.float32))
    return layer

def test_keras_gqa_matches_ours_and_the_oracle(keras_gqa, rng):
    """Keras repeats each key/value head for N/K consecutive query heads, as ours does. Float32
    throughout: Keras and our torch module are each judged against the float64 oracle at
    float32's forward entry (measured: Keras 2.1e-7, ours 2.5e-7 max abs on outputs up to 1.5), and against each
    other at twice it (the two errors add at most). Keras's fused path (jax.nn.dot_product_attention)
    returns the mean of V on a fully masked row: our 'uniform'."""
    sd = convert.from_keras(keras_gqa)
    assert sd["k_proj.weight"].shape == (GK * GH, GE) and sd["q_proj.weight"].dtype == np.float32
    q, k, v = (rng.standard_normal((S.B, L, GE)).astype(np.float32) for L in (S.T, S.S, S.S))
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    expected = np.asarray(keras_gqa(q, v, key=k, attention_mask=keep, training=False))
    oracle = reference.forward(sd, q, k, v, keep, num_heads=GN, num_kv_heads=GK, masked_rows="uniform").output
    f32 = tolerance_for("float32").forward
    assert compare(expected, oracle, f32).passed, compare(expected, oracle, f32)
    ours = run("torch", convert.to_torch(sd, GN, num_kv_heads=GK, masked_rows="uniform"), q, k, v, keep)[0]
    assert compare(ours, oracle, f32).passed, compare(ours, oracle, f32)
    both = type(f32)(2 * f32.atol, 2 * f32.rtol)
    assert compare(ours, expected, both).passed, compare(ours, expected, both)
    # The porting bug -- query head n on key/value head n % K (tile) instead of n // (N/K) (repeat) --
    # is our layer with the query heads reordered so that head n is the original head order[n]:
    order = np.arange(GN).reshape(GN // GK, GK).T.reshape(-1)  # [0 2 4 1 3 5]: heads 0, 2, 4 use key/value head 0
    tiled = dict(sd)
    tiled["q_proj.weight"] = sd["q_proj.weight"].reshape(GN, GH, GE)[order].reshape(GE, GE)
    tiled["q_proj.bias"] = sd["q_proj.bias"].reshape(GN, GH)[order].reshape(GE)
    tiled["out_proj.weight"] = sd["out_proj.weight"].reshape(GE, GN, GH)[:, order].reshape(GE, GE)
    wrong = reference.forward(tiled, q, k, v, keep, num_heads=GN, num_kv_heads=GK, masked_rows="uniform").output
    assert np.abs(wrong - expected).max() > 1e3 * f32.atol

@pytest.mark.parametrize("use_bias", [True, False])
def test_keras_gqa_round_trip_is_bit_exact(use_bias, keras_gqa):
    if use_bias:
        layer = keras_gqa
    else:
        layer = keras.layers.GroupQueryAttention(head_dim=GH, num_query_heads=GN, num_key_value_heads=1, use_bias=False,
                                                 dtype="float32", kernel_initializer="ones")
        layer.build(query_shape=(None, None, GE), value_shape=(None, None, GE))
    sd = convert.from_keras(layer)
    assert sorted(sd) == sorted(k for k in convert.CANONICAL_KEYS if use_bias or k.endswith(".weight"))
    back = convert.to_keras(sd, GN, num_kv_heads=layer.num_key_value_heads)
    assert isinstance(back, keras.layers.GroupQueryAttention) and len(back.weights) == len(layer.weights)
    for a, b in zip(layer.weights, back.weights):
        assert a.path.split("/", 1)[1] == b.path.split("/", 1)[1]
        assert np.asarray(a.value).tobytes() == np.asarray(b.value).tobytes(), a.path
    assert_bit_identical(convert.from_keras(back), sd)

def test_keras_gqa_and_flax_refusals_are_named(keras_gqa):
    sd = convert.from_keras(keras_gqa)
    qkv_only = {k: v for k, v in sd.items() if k != "out_proj.bias"}
    with pytest.raises(ValueError, match="GroupQueryAttention has one use_bias for all four projections; this layer has qkv_bias=True, out_bias=False"):
        convert.to_keras(qkv_only, GN, num_kv_heads=GK)
    with pytest.raises(ValueError, match=r"keras.layers.MultiHeadAttention \(to_keras without num_kv_heads\) has no grouped .* to_keras\(..., num_kv_heads=K\)"):
        convert.to_keras(sd, GN)
    for to_peer, name in ((convert.to_flax_linen, r"flax\.linen\.MultiHeadDotProductAttention"),
                          (convert.to_flax_nnx, r"to_flax_nnx's flax\.nnx\.MultiHeadAttention \(built without num_kv_heads\)"),
                          (convert.to_torch_mha, "torch.nn.MultiheadAttention")):
        with pytest.raises(ValueError, match=name + r" has no grouped key/value heads .* grouped key/value heads \(k_proj.weight \(8, 24\)"):
            to_peer(sd, GN)
        with pytest.raises(ValueError, match=name + r" .* this layer has no out_proj.bias"):
            to_peer({k: v for k, v in _classic(sd).items() if k != "out_proj.bias"}, GN)
    convert.to_flax_linen(_classic(sd), GN)  # the same sizes with every head and bias: converts
    windowed = keras.layers.GroupQueryAttention(head_dim=GH, num_query_heads=GN, num_key_value_heads=GK, sliding_window=3,
                                                kernel_initializer="zeros")
    with pytest.raises(ValueError, match="not built yet"):
        convert.from_keras(windowed)
    windowed.build(query_shape=(None, None, GE), value_shape=(None, None, GE))
    with pytest.raises(ValueError, match="sliding_window=None .* got use_gate=False, sliding_window=3"):
        convert.from_keras(windowed)

def _classic(sd):
    """The grouped dict's key/value heads repeated to N: a classic layer of the same sizes."""
    out = dict(sd)
    for p in ("k_proj", "v_proj"):
        out[f"{p}.weight"] = np.repeat(sd[f"{p}.weight"].reshape(GK, GH, GE), GN // GK, axis=0).reshape(GE, GE)
        out[f"{p}.bias"] = np.repeat(sd[f"{p}.bias"].reshape(GK, GH), GN // GK, axis=0).reshape(GE)
    return out

def test_keras_on_another_backend_is_a_clear_error(monkeypatch):
    """keras already imported with another backend, or KERAS_BACKEND set to one: said, not run elsewhere.

    (In-process: a subprocess importing keras on torch costs ~10 s under load.)
    """
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with pytest.raises(RuntimeError, match="keras was imported with the 'torch' backend before parity.convert; it needs KERAS_BACKEND=jax"):
        convert.to_keras(None, 3)
    monkeypatch.undo()
    monkeypatch.delitem(sys.modules, "keras")  # as if keras were not imported yet
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    with pytest.raises(RuntimeError, match="KERAS_BACKEND='tensorflow' is set; parity.convert runs Keras on its JAX backend"):
        convert.from_keras(None)


# ------------------------------------------------------------- the peer adapter vs the oracle


def test_keras_adapter_follows_its_measured_policy(sd64, rng):
    """keras_mha_forward (the keras-mha peer's function, the real layer inside) vs the float64 oracle
    under the "uniform" policy, in float32 (its float64 run has a float32 stage)."""
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    expected = reference.forward(sd64, q, k, v, keep, num_heads=S.N, masked_rows="uniform").output
    c = compare(keras_mha_forward(sd64, S.N, q, k, v, keep, "float32"), expected, tolerance_for("float32").forward)
    assert c.passed, c
