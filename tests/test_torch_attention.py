"""mha_torch.attention against the float64 oracle: the classic layer's autograd under each
masked-row policy and torch.compile; then grouped key/value heads, RoPE and bias-free projections,
alone and together (TestVariants), and the tests of one feature (TestGrouped, TestRope).

What the classic layer shares with the JAX module (masks, policies, dtypes, bad input) is tested
on both frameworks at once in tests/test_modules.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import SIZES, make_inputs, random_keep_mask
from helpers import assert_close, build, oracle
from mha_torch import MultiHeadAttention
from mha_torch.attention import rotate
from parity import reference
from parity.tolerances import compare, tolerance_for

# ------------------------------------------------------------- the classic layer (conftest's SIZES)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("policy", ["nan", "zero", "uniform"])
def test_torch_autograd_matches_oracle(need_weights, policy, sd64, rng):
    """Under "nan", NaN gradients must sit where the oracle's are (the V slices of the masked row's batch)."""
    q, k, v = make_inputs(rng)
    g = rng.standard_normal((SIZES.B, SIZES.T, SIZES.E))
    keep = random_keep_mask(rng, (SIZES.B, SIZES.T, SIZES.S))
    m = build("torch", sd64, SIZES.N, masked_rows=policy)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out, _ = m(tq, tk, tv, torch.from_numpy(keep), need_weights=need_weights)
    (out * torch.from_numpy(g)).sum().backward()
    ref = reference.backward(sd64, q, k, v, keep, g, num_heads=SIZES.N, masked_rows=policy)
    got = {"query": tq.grad, "key": tk.grad, "value": tv.grad, **dict(m.named_parameters())}
    tol = tolerance_for("float64").gradient
    for name, expected in ref.items():
        t = got[name] if name in ("query", "key", "value") else got[name].grad
        c = compare(t.numpy(), expected, tol)
        assert c.passed, (name, c)


@pytest.mark.slow
def test_torch_compile_fullgraph(sd64, rng):
    """fullgraph=True fails on any graph break, i.e. on data-dependent Python control flow."""
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (SIZES.B, SIZES.T, SIZES.S))
    m = build("torch", sd64, SIZES.N, masked_rows="uniform")
    compiled = torch.compile(m, fullgraph=True, dynamic=False)
    # A float 0/1 keep-mask: eager checks its values (NaN, additive 0/-inf), which would be a
    # graph break; the check must step aside under compile (torch.compiler.is_compiling()).
    args = [torch.from_numpy(x) for x in (q, k, v, keep.astype(np.float64))]
    with torch.no_grad():
        out, w = compiled(*args)
        out_fused, _ = compiled(*args, need_weights=False)
    ref = oracle(sd64, q, k, v, keep, "uniform")
    assert_close(out.numpy(), ref.output)
    assert_close(w.numpy(), ref.weights)
    assert_close(out_fused.numpy(), ref.output)


# ------------------------------------------------------------- grouped key/value heads, RoPE, bias-free projections
# Float64 throughout: module and oracle compute the same maths in a different order, so they
# agree to a few ulps of float64 (tolerance 1e-10 on values of order 1); a wrong head order,
# RoPE pairing or position would miss by order 1.

B, T, S, N, H = 3, 5, 7, 6, 4
E = N * H  # 24
THETA = 500.0  # a small base so every pair turns visibly over positions < 40
TOL = dict(rtol=1e-10, atol=1e-10)

# (num_kv_heads, rope, qkv_bias, out_bias)
VARIANTS = [
    pytest.param(2, None, True, True, id="gqa"),
    pytest.param(1, None, True, True, id="mqa"),
    pytest.param(None, "half", True, True, id="rope-half"),
    pytest.param(2, "interleaved", True, True, id="gqa-rope-interleaved"),
    pytest.param(1, "half", False, False, id="mqa-rope-half-no-bias"),
    pytest.param(None, None, False, True, id="no-qkv-bias"),
    pytest.param(2, None, True, False, id="gqa-no-out-bias"),
]


def _module(rng, n_kv, rope, qkv_bias, out_bias, policy):
    mod = MultiHeadAttention(E, N, num_kv_heads=n_kv, qkv_bias=qkv_bias, out_bias=out_bias, rope=rope,
                             rope_theta=THETA, masked_rows=policy, dtype=torch.float64)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) / math.sqrt(p.shape[-1])))
    sd = {k: v.detach().numpy().copy() for k, v in mod.state_dict().items()}
    return mod, sd


def _inputs(rng, rope):
    q, k, v = (rng.standard_normal((B, L, E)) for L in (T, S, S))
    keep = rng.random((B, T, S)) < 0.7
    keep[:, :, 0] = True
    keep[1, 2] = False  # a fully masked row
    pos = rng.integers(0, 40, size=(B, T)) if rope else None
    kpos = rng.integers(0, 40, size=(S,)) if rope else None
    return q, k, v, keep, pos, kpos


def _t(x):
    return None if x is None else torch.from_numpy(np.asarray(x))


def _kw(n_kv, rope, policy):
    return dict(num_heads=N, num_kv_heads=n_kv, rope=rope, rope_theta=THETA, masked_rows=policy)


class TestVariants:
    """Every feature alone and together (VARIANTS): forward and autograd against the oracle, the
    layer's shapes and its bad configurations."""

    @pytest.mark.parametrize("policy", ["nan", "zero", "uniform"])
    @pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
    @pytest.mark.parametrize("n_kv, rope, qkv_bias, out_bias", VARIANTS)
    def test_forward_matches_the_oracle(self, n_kv, rope, qkv_bias, out_bias, need_weights, policy):
        rng = np.random.default_rng(0)
        mod, sd = _module(rng, n_kv, rope, qkv_bias, out_bias, policy)
        q, k, v, keep, pos, kpos = _inputs(rng, rope)
        ref = reference.forward(sd, q, k, v, keep, positions=pos, key_positions=kpos, **_kw(n_kv, rope, policy))
        with torch.no_grad():
            out, weights, st = mod(_t(q), _t(k), _t(v), _t(keep), need_weights=need_weights,
                                   positions=_t(pos), key_positions=_t(kpos), return_intermediates=True)
        np.testing.assert_allclose(out.numpy(), ref.output, **TOL)
        np.testing.assert_allclose(st.context.numpy(), ref.context, **TOL)
        # q, k, v before RoPE; k and v keep their K heads (the oracle's layouts)
        for name in ("q", "k", "v"):
            np.testing.assert_allclose(getattr(st, name).numpy(), getattr(ref, name), **TOL)
        if need_weights:
            np.testing.assert_allclose(weights.numpy(), ref.weights, **TOL)
            np.testing.assert_allclose(st.scores.numpy(), ref.scores, **TOL)
        else:
            assert weights is None
        nan_rows = np.isnan(ref.output).any(axis=-1)
        assert nan_rows[1, 2] == (policy == "nan") and nan_rows.sum() == (policy == "nan")

    @pytest.mark.parametrize("policy", ["zero", "uniform"])
    @pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
    @pytest.mark.parametrize("n_kv, rope, qkv_bias, out_bias", VARIANTS)
    def test_autograd_matches_the_oracle_backward(self, n_kv, rope, qkv_bias, out_bias, need_weights, policy):
        rng = np.random.default_rng(2)
        mod, sd = _module(rng, n_kv, rope, qkv_bias, out_bias, policy)
        q, k, v, keep, pos, kpos = _inputs(rng, rope)
        g = rng.standard_normal((B, T, E))
        xs = [_t(x).requires_grad_() for x in (q, k, v)]
        out, _ = mod(*xs, _t(keep), need_weights=need_weights, positions=_t(pos), key_positions=_t(kpos))
        out.backward(_t(g))
        ref = reference.backward(sd, q, k, v, keep, g, positions=pos, key_positions=kpos, **_kw(n_kv, rope, policy))
        got = {"query": xs[0].grad, "key": xs[1].grad, "value": xs[2].grad}
        got.update({name: p.grad for name, p in mod.named_parameters()})
        assert sorted(got) == sorted(ref)
        for name in ref:
            np.testing.assert_allclose(got[name].numpy(), ref[name], err_msg=name, **TOL)

    def test_shapes_and_config(self):
        mod = MultiHeadAttention(E, N, num_kv_heads=2, qkv_bias=False, out_bias=False, rope="half")
        assert mod.k_proj.weight.shape == (2 * H, E) and mod.v_proj.weight.shape == (2 * H, E)
        assert mod.q_proj.bias is None and mod.out_proj.bias is None
        assert mod.config.kv_heads == 2 and mod.config.rope == "half"
        assert "num_kv_heads=2" in repr(mod) and "rope='half'" in repr(mod)
        classic = MultiHeadAttention(E, N)
        assert classic.config.num_kv_heads is None and classic.k_proj.weight.shape == (E, E)
        assert classic.q_proj.bias is not None

    @pytest.mark.parametrize("kwargs, error, match", [
        (dict(num_kv_heads=4), ValueError, "num_kv_heads=4 must divide num_heads=6"),
        (dict(num_kv_heads=0), ValueError, "num_kv_heads must be positive"),
        (dict(rope="neox"), ValueError, "rope='neox'"),
        (dict(rope_theta=1.0), ValueError, "rope_theta"),
        (dict(qkv_bias=1), TypeError, "qkv_bias must be a bool"),
    ])
    def test_bad_config_is_named(self, kwargs, error, match):
        with pytest.raises(error, match=match):
            MultiHeadAttention(E, N, **kwargs)


class TestGrouped:
    """K key/value heads, each read by N/K consecutive query heads, on both paths."""

    def test_repeat_not_tile(self):
        """Each query head uses key/value head h // (N/K): a module that tiled would give other numbers."""
        rng = np.random.default_rng(3)
        mod, sd = _module(rng, 2, None, True, True, "nan")
        q, k, v, *_ = _inputs(rng, None)
        with torch.no_grad():
            _, _, st = mod(_t(q), _t(k), _t(v), return_intermediates=True)
        ctx = st.context.numpy().reshape(B, T, N, H)
        for h in range(N):
            j = h // 3
            s = np.einsum("BTH,BSH->BTS", st.q[:, h].numpy(), st.k[:, j].numpy()) / math.sqrt(H)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            np.testing.assert_allclose(ctx[:, :, h], w @ st.v[:, j].numpy(), **TOL)

    @pytest.mark.parametrize("policy", ["nan", "zero", "uniform"])
    @pytest.mark.parametrize("mask", ["random", "causal", "none"])
    def test_fused_core_with_k_heads_places_nan_as_the_weights_path(self, policy, mask):
        """SDPA with enable_gqa on K heads: values and NaNs (a NaN key and a NaN value in one key/value
        head only) are those of the weights path on the repeated heads."""
        from mha_torch import attention_core, fused_attention_core

        rng = np.random.default_rng(4)
        q = torch.from_numpy(rng.standard_normal((B, N, T, H)))
        k, v = (torch.from_numpy(rng.standard_normal((B, 2, S, H))) for _ in range(2))
        k[0, 1, 3, 2] = float("nan")  # key head 1 -> query heads 3, 4, 5 of batch 0
        v[2, 0, 5, 1] = float("nan")  # value head 0 -> query heads 0, 1, 2 of batch 2
        if mask == "random":
            keep = torch.from_numpy(rng.random((B, 1, T, S)) < 0.6)
            keep[1, 0, 2] = False
        else:
            keep = torch.ones(T, S, dtype=torch.bool).tril() if mask == "causal" else None
        want, _ = attention_core(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), keep, masked_rows=policy)
        got = fused_attention_core(q, k, v, keep, masked_rows=policy)
        np.testing.assert_array_equal(got.isnan().numpy(), want.isnan().numpy())
        assert want[0, 3:].isnan().any() and not want[0, :3].isnan().any()  # the NaN key stays in its group
        np.testing.assert_allclose(got.numpy(), want.numpy(), equal_nan=True, **TOL)


class TestRope:
    """The rotation, and the positions and head sizes it refuses."""

    @pytest.mark.parametrize("rope", ["half", "interleaved"])
    def test_rotation_matches_the_oracle_rotation(self, rope):
        """The module's RoPE (the oracle's q_rot/k_rot) is the oracle's rotation, pairs and frequencies."""
        rng = np.random.default_rng(1)
        x = rng.standard_normal((B, 2, T, H))
        pos = rng.integers(0, 40, size=(B, T))
        ang = reference.rope_angles(pos.astype(np.float64).reshape(B, 1, T, 1), H, THETA)
        want = reference.rotate(x, np.cos(ang), np.sin(ang), rope)
        got = rotate(torch.from_numpy(x), torch.from_numpy(pos).reshape(B, 1, T, 1), THETA, rope)
        np.testing.assert_allclose(got.numpy(), want, **TOL)
        assert np.abs(want - x).max() > 0.1  # positions turn the features visibly

    def test_odd_head_dim_with_rope_is_named(self):
        with pytest.raises(ValueError, match="even head_dim"):
            MultiHeadAttention(15, 5, rope="half")

    @pytest.mark.parametrize("rope, kwargs, error, match", [
        (None, dict(positions=torch.arange(T)), ValueError, "rope=None"),
        ("half", dict(positions=torch.arange(T + 1)), ValueError, r"positions must have shape \(5,\) or \(3, 5\)"),
        ("half", dict(key_positions=torch.zeros(2, S, dtype=torch.int64)), ValueError, "key_positions must have shape"),
        ("half", dict(positions=torch.arange(T, dtype=torch.float64)), TypeError, "positions must be integers"),
        ("half", dict(positions=list(range(T))), TypeError, "positions must be a torch.Tensor"),
    ])
    def test_bad_positions_are_named(self, rope, kwargs, error, match):
        mod = MultiHeadAttention(E, N, num_kv_heads=2, rope=rope)
        x, y = torch.zeros(B, T, E), torch.zeros(B, S, E)
        with pytest.raises(error, match=match):
            mod(x, y, y, **kwargs)
