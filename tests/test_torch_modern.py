"""mha_torch's layers after Llama (head_dim, qk_norm, scale, softcap, sinks) against the float64 oracle:
forward and gradients on the eager and fused paths, the KV cache, the stages, which kernel the fused path
runs, the converters and bad input. Every weight is redrawn (no norm weight at 1, no zero sink)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mha_torch.attention as attention
from mha_spec import AttentionConfig
from mha_torch import MultiHeadAttention, parallel
from parity import convert, reference

B, T, S, E, N, K, H = 3, 5, 7, 12, 3, 1, 8
ATOL = 1e-10

FEATURES = {
    "head-dim": {},
    "qk-norm-head": {"qk_norm": "head"},
    "qk-norm-flat": {"qk_norm": "flat", "qk_norm_eps": 1e-3, "qk_norm_offset": 1.0},
    "scale": {"scale": 0.3},
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": True},
    "combined": {"qk_norm": "head", "qk_norm_offset": 1.0, "scale": 0.2, "softcap": 2.0, "sinks": True},
}


def _state_dict(rng, features: dict) -> dict:
    cfg = AttentionConfig(E, N, num_kv_heads=K, head_dim=H, qk_norm=features.get("qk_norm"),
                          sinks=features.get("sinks", False))
    sd = {name: rng.uniform(-0.5, 0.5, shape) for name, shape in cfg.weight_shapes().items()}
    for name in ("q_norm.weight", "k_norm.weight"):
        if name in sd:
            sd[name] = sd[name] + 0.8  # around 1 (or 1 + offset), never exactly the init
    if "sinks" in sd:
        sd["sinks"] = rng.normal(0.0, 1.0, (N,))
    return sd


def _layer(features: dict) -> dict:
    return {k: v for k, v in features.items() if k != "sinks"}


def _problem(rng):
    q, k, v = rng.standard_normal((B, T, E)), rng.standard_normal((B, S, E)), rng.standard_normal((B, S, E))
    keep = rng.random((B, T, S)) > 0.4
    keep[..., 0] = True
    keep[1, 2] = False  # a row that keeps no key
    return q, k, v, keep


POS, KEY_POS = np.arange(T) + 3, np.arange(S) + 1  # RoPE positions past 0


def _run(m, q, k, v, keep, need_weights, **kwargs):
    args = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out, w = m(*args, torch.from_numpy(keep), need_weights=need_weights, positions=torch.from_numpy(POS),
               key_positions=torch.from_numpy(KEY_POS), **kwargs)
    return args, out, w


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_forward_and_gradients_match_the_oracle(feature, need_weights, rng):
    features = FEATURES[feature]
    sd = _state_dict(rng, features)
    q, k, v, keep = _problem(rng)
    policy = "zero"  # a row that keeps no key: finite, so every gradient is compared
    m = convert.to_torch(sd, N, num_kv_heads=K, rope="half", masked_rows=policy, **_layer(features))
    (tq, tk, tv), out, _ = _run(m, q, k, v, keep, need_weights)
    layer = dict(num_heads=N, num_kv_heads=K, rope="half", masked_rows=policy, positions=POS, key_positions=KEY_POS,
                 **_layer(features))
    np.testing.assert_allclose(out.detach().numpy(), reference.forward(sd, q, k, v, keep, **layer).output, atol=ATOL)
    g = rng.standard_normal((B, T, E))
    (out * torch.from_numpy(g)).sum().backward()
    ref = reference.backward(sd, q, k, v, keep, g, **layer)
    got = {"query": tq.grad, "key": tk.grad, "value": tv.grad, **{n: p.grad for n, p in m.named_parameters()}}
    assert set(ref) == set(got), (sorted(ref), sorted(got))
    for name, expected in ref.items():
        np.testing.assert_allclose(got[name].numpy(), expected, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("policy", ["nan", "uniform"])
def test_sinks_take_a_fully_masked_row_whatever_the_policy(policy, need_weights, rng):
    sd = _state_dict(rng, FEATURES["sinks"])
    q, k, v, keep = _problem(rng)
    m = convert.to_torch(sd, N, num_kv_heads=K, masked_rows=policy)
    with torch.no_grad():
        out, w = m(*(torch.from_numpy(x) for x in (q, k, v, keep)), need_weights=need_weights)
    ref = reference.forward(sd, q, k, v, keep, num_heads=N, num_kv_heads=K, masked_rows=policy)
    np.testing.assert_allclose(out.numpy(), ref.output, atol=ATOL)
    np.testing.assert_array_equal(out[1, 2].numpy(), sd["out_proj.bias"])  # zero context: the bias alone
    if need_weights:
        assert (w[1, :, 2] == 0).all() and torch.isfinite(w).all()


@pytest.mark.parametrize("feature", ["qk-norm-flat", "combined"])
def test_stages_hold_the_norms_and_the_capped_scores(feature, rng):
    features = FEATURES[feature]
    sd = _state_dict(rng, features)
    q, k, v, keep = _problem(rng)
    m = convert.to_torch(sd, N, num_kv_heads=K, rope="interleaved", **_layer(features))
    with torch.no_grad():
        _, _, st = m(*(torch.from_numpy(x) for x in (q, k, v, keep)), positions=torch.from_numpy(POS),
                     key_positions=torch.from_numpy(KEY_POS), return_intermediates=True)
    ref = reference.forward(sd, q, k, v, keep, num_heads=N, num_kv_heads=K, rope="interleaved", positions=POS,
                            key_positions=KEY_POS, **_layer(features))
    for name in ("q", "k", "q_norm", "k_norm", "q_rot", "k_rot", "scores", "weights"):
        np.testing.assert_allclose(getattr(st, name).numpy(), getattr(ref, name), atol=ATOL, err_msg=name)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("feature", ["qk-norm-flat", "softcap", "combined"])
def test_decode_with_a_cache_equals_the_oracle_and_one_causal_forward(feature, need_weights, rng):
    features, L, prefill = FEATURES[feature], 6, 3
    sd = _state_dict(rng, features)
    x = rng.standard_normal((B, L, E))
    starts = np.array([0, 2, 1])
    m = convert.to_torch(sd, N, num_kv_heads=K, rope="half", masked_rows="zero", **_layer(features))
    cache, outs = m.init_cache(B, L, starts=torch.from_numpy(starts)), []
    with torch.no_grad():
        for lo, hi in [(0, prefill)] + [(t, t + 1) for t in range(prefill, L)]:
            xt = torch.from_numpy(x[:, lo:hi])
            out, _, cache = m(xt, xt, xt, need_weights=need_weights, cache=cache)
            outs.append(out.numpy())
    got = np.concatenate(outs, axis=1)
    layer = dict(num_heads=N, num_kv_heads=K, rope="half", masked_rows="zero", **_layer(features))
    np.testing.assert_allclose(got, reference.decode(sd, x, starts=starts, prefill=prefill, **layer).output, atol=ATOL)
    one = reference.forward(sd, x, x, x, reference.decode_keep(starts, L), positions=reference.decode_positions(starts, L),
                            key_positions=reference.decode_positions(starts, L), **layer)
    np.testing.assert_allclose(got, one.output, atol=ATOL)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """The scale of every SDPA call."""
    calls = []
    real = attention.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("scale"))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("features, sdpa_scale", [
    ({}, H ** -0.5), ({"scale": 0.3}, 0.3), ({"qk_norm": "head"}, H ** -0.5),
    ({"softcap": 1.5}, None), ({"sinks": True}, None),
])
@pytest.mark.parametrize("is_causal", [False, True])
def test_fused_path_runs_sdpa_unless_softcap_or_sinks(features, sdpa_scale, is_causal, sdpa_calls, rng):
    m = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, dtype=torch.float64, **features)
    q, k, v, _ = _problem(rng)
    args = [torch.from_numpy(x) for x in (q, k, v)]
    with torch.no_grad():
        fused, _ = m(*args, need_weights=False, is_causal=is_causal)
        eager, _ = m(*args, need_weights=True, is_causal=is_causal)
    assert sdpa_calls == ([] if sdpa_scale is None else [pytest.approx(sdpa_scale, rel=1e-15)])
    np.testing.assert_allclose(fused.numpy(), eager.numpy(), atol=ATOL)


def test_parameters_and_their_initial_values():
    m = MultiHeadAttention(E, N, num_kv_heads=K, head_dim=H, qk_norm="flat", qk_norm_offset=1.0, sinks=True)
    shapes = {name: tuple(p.shape) for name, p in m.state_dict().items()}
    assert shapes == m.config.weight_shapes()
    assert shapes["q_proj.weight"] == (N * H, E) and shapes["out_proj.weight"] == (E, N * H)
    assert (m.q_norm.weight == 0).all() and (m.k_norm.weight == 0).all()  # offset + w = 1
    assert (m.sinks == 0).all()
    assert MultiHeadAttention(E, N, qk_norm="head").k_norm.weight.tolist() == [1.0] * (E // N)
    assert "softcap=2.0" in repr(MultiHeadAttention(E, N, softcap=2.0))


def test_converters_round_trip_every_tensor(rng):
    features = FEATURES["combined"]
    sd = _state_dict(rng, features)
    m = convert.to_torch(sd, N, num_kv_heads=K, **_layer(features))
    assert m.config.sinks and m.config.head_dim == H and m.config.softcap == 2.0
    back = convert.from_torch(m)
    assert set(back) == set(sd) and all(np.array_equal(back[n], sd[n]) for n in sd)


def test_bad_input_names_the_field(rng):
    with pytest.raises(ValueError, match="qk_norm"):
        MultiHeadAttention(E, N, qk_norm="rms")
    with pytest.raises(TypeError, match="sinks"):
        MultiHeadAttention(E, N, sinks=1)
    with pytest.raises(ValueError, match="softcap"):
        MultiHeadAttention(E, N, softcap=0.0)
    with pytest.raises(ValueError, match="head_dim"):
        MultiHeadAttention(E, 5)
    sd = _state_dict(rng, FEATURES["qk-norm-head"])
    with pytest.raises(ValueError, match="q_norm.weight"):
        convert.to_torch(sd, N, num_kv_heads=K)  # norm weights without qk_norm
    with pytest.raises(ValueError, match="head_dim"):
        convert.to_torch(sd, N, num_kv_heads=K, qk_norm="head", head_dim=4)
    with pytest.raises(ValueError, match="sinks"):
        attention.attention_core(*(torch.zeros(1, N, 2, H) for _ in range(3)), None, sinks=torch.zeros(N + 1))


@pytest.mark.parametrize("features", [{"qk_norm": "flat"}, {"qk_norm": "head"}, {"sinks": True}])
def test_tensor_parallel_refuses_what_it_does_not_shard(features):
    m = MultiHeadAttention(E, N, **features)
    x = torch.zeros(1, 2, E)
    with pytest.raises(ValueError, match="tensor parallel"):
        parallel.parallelize_heads(m, mesh=None)
    with pytest.raises(ValueError, match="tensor parallel"):
        parallel.tp_forward(m, x, x, x)


def test_ring_attention_runs_every_feature(rng):
    """One rank's ring (the online-softmax recurrence, the sink starting it) against the oracle."""
    import torch.distributed as dist

    features = FEATURES["combined"]
    sd = _state_dict(rng, features)
    q, k, v, keep = _problem(rng)
    m = convert.to_torch(sd, N, num_kv_heads=K, rope="half", masked_rows="nan", **_layer(features))
    args = [torch.from_numpy(x) for x in (q, k, v)]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out = parallel.sequence_parallel_forward(m, *args, torch.from_numpy(keep), positions=torch.from_numpy(POS),
                                                 key_positions=torch.from_numpy(KEY_POS))
    finally:
        dist.destroy_process_group()
    ref = reference.forward(sd, q, k, v, keep, num_heads=N, num_kv_heads=K, rope="half", masked_rows="nan",
                            positions=POS, key_positions=KEY_POS, **_layer(features))
    np.testing.assert_allclose(out.detach().numpy(), ref.output, atol=ATOL)
    g = rng.standard_normal((B, T, E))
    (out * torch.from_numpy(g)).sum().backward()
    grads = reference.backward(sd, q, k, v, keep, g, num_heads=N, num_kv_heads=K, rope="half", masked_rows="nan",
                               positions=POS, key_positions=KEY_POS, **_layer(features))
    for name in ("sinks", "q_norm.weight", "k_norm.weight"):
        np.testing.assert_allclose(dict(m.named_parameters())[name].grad.numpy(), grads[name], atol=ATOL, err_msg=name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_16_bit_inputs_err_no_more_than_the_low_dtype_oracle(dtype, need_weights, rng):
    """Norm, scores, cap and softmax in float32: the error against float64 is the low-dtype oracle's."""
    import ml_dtypes

    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    features = FEATURES["combined"] | {"qk_norm": "flat"}
    sd = {name: x.astype(np_dtype) for name, x in _state_dict(rng, features).items()}
    q, k, v, keep = _problem(rng)
    m = convert.to_torch(sd, N, num_kv_heads=K, masked_rows="zero", **_layer(features))
    with torch.no_grad():
        out, _ = m(*(convert.numpy_to_tensor(x.astype(np_dtype)) for x in (q, k, v)), torch.from_numpy(keep),
                   need_weights=need_weights)
    layer = dict(num_heads=N, num_kv_heads=K, masked_rows="zero", **_layer(features))
    exact = reference.forward(sd, q, k, v, keep, **layer).output
    low = reference.forward(sd, q, k, v, keep, dtype=np_dtype, **layer).output
    assert np.abs(out.float().numpy() - exact).max() <= 2 * np.abs(low - exact).max()
