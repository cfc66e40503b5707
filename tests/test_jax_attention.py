"""mha_jax.attention against the float64 oracle: the classic layer under jax.jit with a traced
mask, nnx.jit/nnx.grad and jax.grad under each masked-row policy, float64 without x64; then
grouped key/value heads, RoPE and bias-free projections, alone and together (TestVariants), and
the tests of one feature (TestGrouped, TestRope).

Float64 throughout (x64 is on for the session, conftest). What the classic layer shares with the
torch module (masks, policies, dtypes, bad input) is tested on both frameworks at once in
tests/test_modules.py.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import mha_jax.kernels as kernels
import mha_torch
from conftest import SIZES, make_inputs, random_keep_mask
from helpers import DTYPES, assert_close, build, cast_sd, np_dtype, oracle
from mha_jax import (KVCache, MultiHeadAttention, attention_core, cached_attention, chunked_attention, fused_attention_core,
                     segment_positions)
from mha_jax.attention import rope_cos_sin
from parity import convert, reference
from mha_spec import AttentionConfig
from parity.tolerances import compare, compare_three_way, tolerance_for

# ------------------------------------------------------------- the classic layer (conftest's SIZES)


def test_jax_jit_matches_eager_with_a_traced_mask(sd64, rng):
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (SIZES.B, SIZES.T, SIZES.S))
    m = build("jax", sd64, SIZES.N, masked_rows="uniform")

    @jax.jit
    def f(q, k, v, keep):  # the mask's values are traced: no Python branch may look at them
        return m(q, k, v, keep)[0], m(q, k, v, keep, need_weights=False)[0]

    got, got_fused = f(q, k, v, keep)
    ref = oracle(sd64, q, k, v, keep, "uniform").output
    assert_close(np.asarray(got), ref)
    assert_close(np.asarray(got_fused), ref)


def test_nnx_jit_and_nnx_grad(sd64, rng):
    from flax import nnx

    q, k, v = make_inputs(rng)
    g = rng.standard_normal((SIZES.B, SIZES.T, SIZES.E))
    keep = random_keep_mask(rng, (SIZES.B, SIZES.T, SIZES.S))
    m = build("jax", sd64, SIZES.N, masked_rows="zero")

    @nnx.jit
    def loss_and_grads(m, q, k, v):
        def loss(m, q, k, v):
            return jnp.sum(m(q, k, v, keep)[0] * g)

        return nnx.grad(loss, argnums=(0, 1, 2, 3))(m, q, k, v)

    gm, gq, gk, gv = loss_and_grads(m, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    ref = reference.backward(sd64, q, k, v, keep, g, num_heads=SIZES.N, masked_rows="zero")
    tol = tolerance_for("float64").gradient
    for name, got in (("query", gq), ("key", gk), ("value", gv)):
        c = compare(np.asarray(got), ref[name], tol)
        assert c.passed, (name, c)
    for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
        c = compare(np.asarray(getattr(gm, p).kernel[...]).T, ref[f"{p}.weight"], tol)
        assert c.passed, (p, c)
        c = compare(np.asarray(getattr(gm, p).bias[...]), ref[f"{p}.bias"], tol)
        assert c.passed, (p, c)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("policy", ["nan", "zero", "uniform"])
def test_jax_grad_matches_oracle(need_weights, policy, sd64, rng):
    q, k, v = make_inputs(rng)
    g = rng.standard_normal((SIZES.B, SIZES.T, SIZES.E))
    keep = random_keep_mask(rng, (SIZES.B, SIZES.T, SIZES.S))
    m = build("jax", sd64, SIZES.N, masked_rows=policy)
    grads = jax.grad(lambda q, k, v: jnp.sum(m(q, k, v, keep, need_weights=need_weights)[0] * g), argnums=(0, 1, 2))(q, k, v)
    ref = reference.backward(sd64, q, k, v, keep, g, num_heads=SIZES.N, masked_rows=policy)
    for name, got in zip(("query", "key", "value"), grads):
        c = compare(np.asarray(got), ref[name], tolerance_for("float64").gradient)
        assert c.passed, (name, c)
    if policy == "nan":  # the check above could fail: the oracle does put NaNs in d(value)
        assert np.isnan(ref["value"]).any() and not np.isnan(ref["value"]).all()


def test_jax_float64_without_x64_is_an_error(sd64):
    m = build("jax", sd64, SIZES.N)
    x = np.zeros((SIZES.B, SIZES.T, SIZES.E))
    with jax.enable_x64(False):
        with pytest.raises(TypeError, match="jax_enable_x64"):
            m(x, x, x)


# ------------------------------------------------------------- grouped key/value heads, RoPE, bias-free projections
# Module and oracle compute the same maths in a different order, so they agree to a few ulps of
# float64 (tolerance 1e-10 on values of order 1); a wrong head order, RoPE pairing or position
# misses by order 1. The fused path runs whichever kernel the module picks for these sizes; the
# kernel-level tests force each of the three (einsum, chunked with several blocks on both axes,
# jax.nn.dot_product_attention).

B, T, S, N, H = 3, 5, 7, 6, 4
E = N * H  # 24
THETA = 500.0  # a small base so every pair turns visibly over positions < 40
TOL = dict(rtol=1e-10, atol=1e-10)
POLICIES = ("nan", "zero", "uniform")

# (num_kv_heads, rope, qkv_bias, out_bias, positions shape): every feature, alone and together
VARIANTS = [
    pytest.param(2, None, True, True, None, id="gqa"),
    pytest.param(1, None, True, True, None, id="mqa"),
    pytest.param(None, "half", True, True, "BT", id="rope-half"),
    pytest.param(2, "interleaved", True, True, "T", id="gqa-rope-interleaved"),
    pytest.param(1, "half", False, False, "BT", id="mqa-rope-half-no-bias"),
    pytest.param(None, None, False, True, None, id="no-qkv-bias"),
    pytest.param(2, None, True, False, None, id="gqa-no-out-bias"),
]
# The gradient checks: grouped and multi-query heads, both RoPE conventions, both bias flags off.
GRAD_VARIANTS = [VARIANTS[i] for i in (3, 4)]


@pytest.fixture
def force_kernel(monkeypatch):
    """Make fused_attention_core run one kernel, e.g. force_kernel("chunked", 2, 3)."""

    def force(kernel, q_chunk=None, k_chunk=None):
        monkeypatch.setattr(kernels, "choose", lambda **kw: kernels.Choice(kernel, q_chunk, k_chunk, "forced by a test"))

    return force


def _sd(rng, n_kv, qkv_bias, out_bias):
    """Random float64 canonical weights of the variant (biases nonzero, so a dropped one shows)."""
    cfg = mha_torch.MultiHeadAttention(E, N, num_kv_heads=n_kv, qkv_bias=qkv_bias, out_bias=out_bias).config
    return {name: rng.standard_normal(shape) / math.sqrt(shape[-1]) for name, shape in cfg.weight_shapes().items()}


def _module(sd, n_kv, rope, policy):
    return convert.to_jax(sd, N, num_kv_heads=n_kv, rope=rope, rope_theta=THETA, masked_rows=policy)


def _inputs(rng, pos_shape):
    q, k, v = (rng.standard_normal((B, L, E)) for L in (T, S, S))
    keep = rng.random((B, T, S)) < 0.7
    keep[:, :, 0] = True
    keep[1, 2] = False  # a fully masked row
    pos = kpos = None
    if pos_shape is not None:  # non-default positions; the other argument's other shape
        pos = rng.integers(0, 40, size=(B, T) if pos_shape == "BT" else (T,))
        kpos = rng.integers(0, 40, size=(S,) if pos_shape == "BT" else (B, S))
    return q, k, v, keep, pos, kpos


def _kw(n_kv, rope, policy):
    return dict(num_heads=N, num_kv_heads=n_kv, rope=rope, rope_theta=THETA, masked_rows=policy)


def _np(x):
    return None if x is None else np.asarray(x)


def _grads(m, q, k, v, keep, g, pos, kpos, need_weights):
    """Gradients of sum(output * g) w.r.t. the inputs and every parameter, in the oracle's names."""

    def loss(m, q, k, v):
        out = m(q, k, v, jnp.asarray(keep), need_weights=need_weights, positions=pos, key_positions=kpos)[0]
        return jnp.sum(out * g)

    gm, gq, gk, gv = nnx.grad(loss, argnums=(0, 1, 2, 3))(m, *(jnp.asarray(x) for x in (q, k, v)))
    got = {"query": gq, "key": gk, "value": gv}
    for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
        layer = getattr(gm, p)
        got[f"{p}.weight"] = np.asarray(layer.kernel[...]).T
        if "bias" in layer:  # a bias-free projection has no bias gradient
            got[f"{p}.bias"] = layer["bias"][...]
    return {name: np.asarray(x) for name, x in got.items()}


def _largest_intermediate(jaxpr) -> int:
    """The largest element count of any value produced anywhere in a jaxpr, sub-jaxprs included."""
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            biggest = max(biggest, int(np.prod(var.aval.shape)) if var.aval.shape else 1)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            biggest = max(biggest, _largest_intermediate(sub))
    return biggest


def _positions_call(**kw):
    m = MultiHeadAttention(E, N, rngs=nnx.Rngs(0), num_kv_heads=2, rope="half", param_dtype=jnp.float64)
    x, y = jnp.zeros((B, T, E)), jnp.zeros((B, S, E))
    return m(x, y, y, **kw)


class TestVariants:
    """Every feature alone and together (VARIANTS): forward, stages and gradients against the
    oracle, the torch module after conversion, the layers it refuses."""

    @pytest.mark.parametrize("n_kv, rope, qkv_bias, out_bias, pos_shape", VARIANTS)
    def test_forward_and_stages_match_the_oracle_on_both_paths(self, n_kv, rope, qkv_bias, out_bias, pos_shape):
        rng = np.random.default_rng(0)
        sd = _sd(rng, n_kv, qkv_bias, out_bias)
        m = _module(sd, n_kv, rope, "nan")
        q, k, v, keep, pos, kpos = _inputs(rng, pos_shape)
        ref = reference.forward(sd, q, k, v, keep, positions=pos, key_positions=kpos, **_kw(n_kv, rope, "nan"))
        for need_weights in (True, False):
            out, weights, st = m(q, k, v, keep, need_weights=need_weights, positions=pos, key_positions=kpos,
                                 return_intermediates=True)
            np.testing.assert_allclose(np.asarray(out), ref.output, **TOL)
            np.testing.assert_allclose(np.asarray(st.context), ref.context, **TOL)
            # q, k, v before RoPE and q_rot, k_rot after it; k, v and k_rot keep their K heads (the oracle's layouts)
            for name in ("q", "k", "v", "q_rot", "k_rot"):
                want = getattr(ref, name)
                if want is None:
                    assert getattr(st, name) is None, name
                else:
                    np.testing.assert_allclose(np.asarray(getattr(st, name)), want, err_msg=name, **TOL)
            assert st.k.shape == (B, n_kv or N, S, H)
            if need_weights:
                np.testing.assert_allclose(np.asarray(weights), ref.weights, **TOL)
                np.testing.assert_allclose(np.asarray(st.scores), ref.scores, **TOL)
            else:
                assert weights is None and st.scores is None
            nan_rows = np.isnan(np.asarray(out)).any(axis=-1)
            assert nan_rows[1, 2] and nan_rows.sum() == 1  # exactly the fully masked row, under "nan"

    @pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
    @pytest.mark.parametrize("n_kv, rope, qkv_bias, out_bias, pos_shape", GRAD_VARIANTS)
    def test_every_gradient_matches_the_oracle_backward(self, n_kv, rope, qkv_bias, out_bias, pos_shape, need_weights):
        rng = np.random.default_rng(2)
        sd = _sd(rng, n_kv, qkv_bias, out_bias)
        m = _module(sd, n_kv, rope, "zero")
        q, k, v, keep, pos, kpos = _inputs(rng, pos_shape)
        g = rng.standard_normal((B, T, E))
        got = _grads(m, q, k, v, keep, g, pos, kpos, need_weights)
        ref = reference.backward(sd, q, k, v, keep, g, positions=pos, key_positions=kpos, **_kw(n_kv, rope, "zero"))
        assert sorted(got) == sorted(ref) == sorted(list(sd) + ["query", "key", "value"])
        for name in ref:
            np.testing.assert_allclose(got[name], ref[name], err_msg=name, **TOL)

    @pytest.mark.parametrize("n_kv, rope, qkv_bias, out_bias, pos_shape", [VARIANTS[i] for i in (3, 4, 6)])
    def test_torch_module_equals_jax_module_after_conversion(self, n_kv, rope, qkv_bias, out_bias, pos_shape):
        rng = np.random.default_rng(4)
        tm = mha_torch.MultiHeadAttention(E, N, num_kv_heads=n_kv, qkv_bias=qkv_bias, out_bias=out_bias, rope=rope,
                                          rope_theta=THETA, masked_rows="uniform", dtype=torch.float64)
        with torch.no_grad():
            for p in tm.parameters():
                p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape))))
        jm = convert.torch_to_jax(tm)
        assert jm.config == tm.config
        for name, x in convert.from_jax(jm).items():  # bit for bit, and no key invented
            np.testing.assert_array_equal(x, tm.state_dict()[name].numpy())
        assert sorted(convert.from_jax(jm)) == sorted(tm.state_dict())
        back = convert.jax_to_torch(jm)
        assert back.config == tm.config
        q, k, v, keep, pos, kpos = _inputs(rng, pos_shape)
        t = [None if x is None else torch.from_numpy(np.asarray(x)) for x in (q, k, v, keep, pos, kpos)]
        for need_weights in (True, False):
            with torch.no_grad():
                want = tm(*t[:4], need_weights=need_weights, positions=t[4], key_positions=t[5])[0].numpy()
            got = jm(q, k, v, keep, need_weights=need_weights, positions=pos, key_positions=kpos)[0]
            np.testing.assert_allclose(np.asarray(got), want, **TOL)

    def test_bad_layers_are_named(self):
        with pytest.raises(ValueError, match="num_kv_heads=4 must divide num_heads=6"):
            MultiHeadAttention(E, N, rngs=nnx.Rngs(0), num_kv_heads=4)
        with pytest.raises(ValueError, match="rope='neox' is not None or one of"):
            MultiHeadAttention(E, N, rngs=nnx.Rngs(0), rope="neox")
        with pytest.raises(ValueError, match="rope needs an even head_dim, got 3"):
            MultiHeadAttention(18, N, rngs=nnx.Rngs(0), rope="half")
        m = MultiHeadAttention(E, N, rngs=nnx.Rngs(0), num_kv_heads=2, param_dtype=jnp.float64)
        x = jnp.zeros((B, T, E))
        with pytest.raises(ValueError, match="positions/key_positions are given but rope=None"):
            m(x, x, x, positions=np.arange(T))
        with pytest.raises(ValueError, match=r"k_proj.weight has shape \(8, 24\), expected \(24, 24\)"):
            convert.to_jax(convert.from_jax(m), N)  # K·H rows without num_kv_heads
        with pytest.raises(ValueError, match=r"key/value heads must divide the query heads.*k \(3, 7, 4, 4\)"):
            chunked_attention(jnp.zeros((B, T, N, H)), jnp.zeros((B, S, 4, H)), jnp.zeros((B, S, 4, H)))


class TestGrouped:
    """K key/value heads, each read by N/K consecutive query heads: repeated, never tiled, and never
    materialised at N heads by the fused kernels."""

    def test_tiled_key_value_heads_do_not_match_the_oracle(self):
        """Query head h reads key/value head h // G (repeat); h % K (tile) gives order-1 differences,
        so the forward test above fails for a module that tiles."""
        rng = np.random.default_rng(3)
        sd = _sd(rng, 2, True, True)
        q, k, v, _, _, _ = _inputs(rng, None)
        ref = reference.forward(sd, q, k, v, None, **_kw(2, None, "nan"))
        _, _, st = _module(sd, 2, None, "nan")(q, k, v, return_intermediates=True)
        qh, kh, vh = (jnp.transpose(x, (0, 2, 1, 3)) for x in (st.q, st.k, st.v))  # (B, L, heads, H)
        G = N // 2
        for heads, close in ((lambda x: jnp.repeat(x, G, axis=2), True), (lambda x: jnp.tile(x, (1, 1, G, 1)), False)):
            context = np.asarray(attention_core(qh, heads(kh), heads(vh))[0]).reshape(B, T, E)
            assert np.allclose(context, ref.context, **TOL) == close
        assert np.abs(np.asarray(attention_core(qh, jnp.tile(kh, (1, 1, G, 1)), jnp.tile(vh, (1, 1, G, 1)))[0]).reshape(B, T, E)
                      - ref.context).max() > 0.05

    @pytest.mark.parametrize("kernel", ["einsum", "chunked", "dpa-xla"])
    def test_fused_kernels_never_repeat_keys_and_values_per_query_head(self, kernel, force_kernel):
        """Multi-query, few queries, many keys: K or V (or their gradients) at N heads would be the
        largest value of the program, B·N·S·H = 16384; scores and blocks are 4x smaller."""
        force_kernel(kernel, 4, 64)
        Bq, Tq, Sk, Nh, Hd = 1, 2, 256, 8, 8
        q = jnp.zeros((Bq, Tq, Nh, Hd), jnp.float32)
        kv = jnp.zeros((Bq, Sk, 1, Hd), jnp.float32)
        keep = jnp.ones((Bq, 1, Tq, Sk), bool)
        repeated = Bq * Nh * Sk * Hd

        def f(q, k, v):
            return fused_attention_core(q, k, v, keep, masked_rows="uniform").sum()

        assert _largest_intermediate(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, kv, kv).jaxpr) < repeated // 2
        # and the check can fail: the core on repeated heads builds them
        plain = jax.make_jaxpr(lambda q, k: attention_core(q, jnp.repeat(k, Nh, axis=2), jnp.repeat(k, Nh, axis=2))[0].sum())
        assert _largest_intermediate(plain(q, kv).jaxpr) >= repeated

    @pytest.mark.parametrize("kernel", ["einsum", "chunked", "dpa-xla"])
    def test_fused_masked_rows_use_their_own_key_value_head(self, kernel, force_kernel):
        """Grouped heads (K=2, G=3), one fully masked row in query head 4 (key/value head 1) and
        one in every head of another row: under each policy the row is NaN, 0 or the mean of V of
        key/value head h // G, which differs from the other head's by >= 5 (V's heads are offset)."""
        force_kernel(kernel, 2, 3)
        dtype = np.float32 if kernel == "dpa-xla" else np.float64  # dpa's softmax is float32
        rng = np.random.default_rng(5)
        K = 2
        q = rng.standard_normal((B, T, N, H)).astype(dtype)
        k = rng.standard_normal((B, S, K, H)).astype(dtype)
        v = (rng.standard_normal((B, S, K, H)) + 10.0 * np.arange(K)[:, None]).astype(dtype)
        keep = rng.random((B, N, T, S)) < 0.7
        keep[..., 0] = True
        keep[0, 4, 3] = False  # one head of one row
        keep[2, :, 1] = False  # every head of one row
        masked = [(0, 3, 4)] + [(2, 1, h) for h in range(N)]
        for policy in POLICIES:
            got = np.asarray(fused_attention_core(*(jnp.asarray(x) for x in (q, k, v, keep)), masked_rows=policy))
            want = np.asarray(attention_core(*(jnp.asarray(x) for x in (q, np.repeat(k, 3, 2), np.repeat(v, 3, 2), keep)),
                                             masked_rows=policy)[0])
            c = compare(got, want, tolerance_for(np.dtype(dtype).name).forward)
            assert c.passed, (policy, c)
            for b, t, h in masked:
                row = got[b, t, h]
                if policy == "nan":
                    assert np.isnan(row).all()
                elif policy == "zero":
                    assert (row == 0).all()
                else:
                    np.testing.assert_allclose(row, v[b, :, h // 3].astype(np.float64).mean(axis=0), rtol=1e-6)
            assert np.isfinite(np.delete(got[2], 1, axis=0)).all() and np.isfinite(got[0, 3, :4]).all()

    @pytest.mark.parametrize("kernel", ["chunked", "dpa-xla"])
    @pytest.mark.parametrize("policy", ["zero", "uniform"])
    def test_fused_fill_of_finite_values_near_the_largest_float32_stays_finite(self, kernel, policy, force_kernel):
        """V near float32's largest: a plain sum over the 7 keys overflows to inf (uniform: inf; zero:
        0 x inf = NaN); the fill sums V·(1/S) and stays finite, as the weights path's row does."""
        force_kernel(kernel, 2, 3)
        rng = np.random.default_rng(6)
        q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((B, S, 2, H)), jnp.float32)
        v = jnp.asarray(rng.uniform(2.5e38, 3.0e38, (B, S, 2, H)), jnp.float32)
        assert not np.isfinite(np.asarray(jnp.sum(v, axis=1))).any()  # the overflow the fill avoids
        keep = np.ones((B, 1, T, S), bool)
        keep[1, :, 2] = False
        got = np.asarray(fused_attention_core(q, k, v, jnp.asarray(keep), masked_rows=policy))[1, 2]  # (N, H)
        want = 0.0 if policy == "zero" else np.repeat(np.asarray(v, np.float64).mean(axis=1)[1], 3, axis=0)
        np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-6)


class TestRope:
    """Positions traced under jit, the angles without x64, the positions it refuses."""

    def test_fused_path_under_jit_with_traced_positions_equals_eager(self):
        rng = np.random.default_rng(7)
        sd = _sd(rng, 2, False, True)
        m = _module(sd, 2, "interleaved", "uniform")
        q, k, v, keep, pos, kpos = _inputs(rng, "BT")

        @nnx.jit
        def fused(m, q, k, v, keep, pos, kpos):
            return m(q, k, v, keep, need_weights=False, positions=pos, key_positions=kpos)[0]

        got = fused(m, *(jnp.asarray(x) for x in (q, k, v, keep, pos, kpos)))
        ref = reference.forward(sd, q, k, v, keep, positions=pos, key_positions=kpos, **_kw(2, "interleaved", "uniform"))
        np.testing.assert_allclose(np.asarray(got), ref.output, **TOL)

    def test_float32_rope_angles_without_x64(self):
        """Without x64: known positions get float64 angles on the host (cos/sin rounded once, as
        the oracle's float32 stage); traced ones float32 angles, within |angle|·2⁻²³ + 2⁻²³."""
        pos = np.array([0, 1, 7, 3000, 65535])
        ang = reference.rope_angles(pos.astype(np.float64).reshape(1, 1, -1, 1), H, THETA)  # (1, 1, L, H/2)
        want_cos = np.cos(ang).astype(np.float32).reshape(1, -1, 1, H // 2)
        with jax.enable_x64(False):
            cfg = AttentionConfig(H, 1, rope="half", rope_theta=THETA)  # one head of H features, unscaled
            cos, _ = rope_cos_sin(cfg, jnp.asarray(pos, jnp.int32), pos.size, jnp.float32)
            traced, _ = jax.jit(lambda p: rope_cos_sin(cfg, p, pos.size, jnp.float32))(jnp.asarray(pos, jnp.int32))
        assert cos.dtype == jnp.float32 and traced.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(cos), want_cos)
        bound = (np.abs(ang) * 2.0 ** -23 + 2.0 ** -23).reshape(want_cos.shape)
        assert (np.abs(np.asarray(traced, np.float64) - np.cos(ang).reshape(want_cos.shape)) <= bound).all()

    @pytest.mark.parametrize("kwargs, error, match", [
        (dict(positions=np.arange(T + 1)), ValueError, r"positions must have shape \(5,\) or \(3, 5\), got \(6,\)"),
        (dict(key_positions=np.zeros((B, T), int)), ValueError, r"key_positions must have shape \(7,\) or \(3, 7\), got \(3, 5\)"),
        (dict(positions=np.arange(T, dtype=np.float32)), TypeError, "positions must be integers, got dtype float32"),
        (dict(key_positions=np.ones(S, bool)), TypeError, "key_positions must be integers, got dtype bool"),
        (dict(positions=list(range(T))), TypeError, "positions must be a jax or numpy array of integers, got list"),
    ])
    def test_bad_positions_are_named(self, kwargs, error, match):
        with pytest.raises(error, match=match):
            _positions_call(**kwargs)


# ------------------------------------------------------------- decoding with a KV cache
# B=3 rows with starts [0, 2, 1] (left padding), N=4 query heads on K=2 key/value heads of H=6,
# a prompt of P=5 and 4 single-token steps into C=11 slots: L=9 tokens, 2 slots left empty.
# Most checks run the shared jitted step and forward below (one compile per layer, dtype and
# token count, reused across tests); the eager checks share one layer (EAGER), so each eager
# primitive compiles once for these shapes.

DB, DN, DK, DH = 3, 4, 2, 6
DE = DN * DH  # 24
P, STEPS, CAP = 5, 4, 11
L = P + STEPS  # 9
STARTS = np.array([0, 2, 1])
DTOL = dict(rtol=1e-12, atol=1e-12)

# (num_kv_heads, rope, qkv_bias, out_bias, starts)
DECODE_VARIANTS = [
    pytest.param(None, None, True, True, None, id="classic"),
    pytest.param(DK, None, True, True, STARTS, id="grouped-left-padded"),
    pytest.param(DK, "half", True, True, STARTS, id="grouped-rope-half"),
    pytest.param(1, "interleaved", True, True, STARTS, id="mqa-rope-interleaved"),
    pytest.param(DK, "half", False, False, STARTS, id="rope-half-bias-free"),
]
EAGER = (DK, "half")  # the layer of the eager checks


@nnx.jit(static_argnames="need_weights")
def _jit_step(m, xi, cache, need_weights=True):
    return m(xi, xi, xi, cache=cache, need_weights=need_weights)


@nnx.jit(static_argnames="need_weights")
def _jit_forward(m, x, keep, pos, need_weights=True):
    return m(x, x, x, keep, need_weights=need_weights, positions=pos, key_positions=pos)


def _jitted(need_weights):
    return lambda m, xi, cache: _jit_step(m, xi, cache, need_weights=need_weights)


def _eager(need_weights):
    return lambda m, xi, cache: m(xi, xi, xi, cache=cache, need_weights=need_weights)


def _decode_sd(rng, n_kv, qkv_bias=True, out_bias=True):
    """Random float64 canonical weights of the decode sizes (biases nonzero, so a dropped one shows)."""
    cfg = AttentionConfig(DE, DN, num_kv_heads=n_kv, qkv_bias=qkv_bias, out_bias=out_bias)
    return {name: rng.standard_normal(shape) / math.sqrt(shape[-1]) for name, shape in cfg.weight_shapes().items()}


def _decode_module(sd, n_kv, rope, masked_rows="nan", **kw):
    return convert.to_jax(sd, DN, num_kv_heads=n_kv, rope=rope, rope_theta=THETA, masked_rows=masked_rows, **kw)


def _causal_from(starts, length=L):
    """What decoding equals: keep[b, t, s] = starts[b] <= s <= t (B, L, L), positions t - starts[b] (B, L)."""
    starts = np.zeros(DB, int) if starts is None else starts
    t = np.arange(length)
    keep = (t[None, None, :] >= starts[:, None, None]) & (t[None, None, :] <= t[None, :, None])
    return keep, t[None, :] - starts[:, None]


def _padding_rows(starts, length=L):
    starts = np.zeros(DB, int) if starts is None else starts
    return np.arange(length)[None, :] < starts[:, None]  # (B, L)


def _full_forward(m, x, starts, need_weights=True, stretch=1):
    """The module's own jitted forward over all L tokens, causal keep-mask, positions (· stretch)."""
    keep, pos = _causal_from(starts, x.shape[1])
    pos = jnp.asarray(pos * stretch) if m.config.rope else None
    out, w = _jit_forward(m, x, jnp.asarray(keep), pos, need_weights=need_weights)
    return np.asarray(out), None if w is None else np.asarray(w)


def _oracle_decode(sd, x, starts, n_kv, rope, **kw):
    keep, pos = _causal_from(starts, x.shape[1])
    pos = pos if rope else None
    return reference.forward(sd, x, x, x, keep, num_heads=DN, num_kv_heads=n_kv, rope=rope, rope_theta=THETA,
                             positions=pos, key_positions=pos, **kw)


def _run_decode(m, x, starts, step, chunks=(P,) + (1,) * STEPS, capacity=CAP):
    """Feed x (B, L, E) to a fresh cache in chunks of these lengths; -> (outputs (B, L, E),
    weights (B, N, L, C) or None, the last cache)."""
    cache = m.init_cache(x.shape[0], capacity, starts=starts)
    outs, ws, at = [], [], 0
    for n in chunks:
        out, w, cache = step(m, x[:, at:at + n], cache)
        assert out.shape == (x.shape[0], n, DE)
        outs.append(np.asarray(out))
        ws.append(None if w is None else np.asarray(w))
        at += n
    assert at == x.shape[1]
    weights = None if ws[0] is None else np.concatenate(ws, axis=2)
    return np.concatenate(outs, axis=1), weights, cache


class TestDecode:
    """Prefill + single-token steps against a KVCache equal one causal forward of the same module
    and the float64 oracle; a jitted step serves every position from one compile; no room; bad calls."""

    def _check(self, got, got_w, want, want_w, ref, starts):
        np.testing.assert_allclose(got, want, **DTOL)  # NaNs at the same places too
        np.testing.assert_allclose(got, ref.output, **DTOL)
        # left-padding rows attend nothing: NaN under the default policy; every other row finite
        np.testing.assert_array_equal(np.isnan(got).any(axis=-1), _padding_rows(starts))
        assert not np.isnan(got[~_padding_rows(starts)]).any()
        if got_w is not None:
            assert got_w.shape == (DB, DN, L, CAP)
            np.testing.assert_allclose(got_w[..., :L], want_w, **DTOL)
            np.testing.assert_allclose(got_w[..., :L], ref.weights, **DTOL)
            real = ~_padding_rows(starts)  # (B, L)
            assert (got_w[..., L:].transpose(0, 2, 1, 3)[real] == 0).all()  # the empty slots get no weight

    @pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
    @pytest.mark.parametrize("n_kv, rope, qkv_bias, out_bias, starts", DECODE_VARIANTS)
    def test_jitted_prefill_and_steps_equal_one_causal_forward(self, n_kv, rope, qkv_bias, out_bias, starts,
                                                               need_weights):
        rng = np.random.default_rng(10)
        sd = _decode_sd(rng, n_kv, qkv_bias, out_bias)
        m = _decode_module(sd, n_kv, rope)
        x = rng.standard_normal((DB, L, DE))
        got, got_w, cache = _run_decode(m, jnp.asarray(x), starts, _jitted(need_weights))
        want, want_w = _full_forward(m, jnp.asarray(x), starts)
        self._check(got, got_w if need_weights else None, want, want_w, _oracle_decode(sd, x, starts, n_kv, rope),
                    starts)
        assert need_weights or got_w is None
        np.testing.assert_array_equal(np.asarray(cache.lengths), np.full(DB, L))

    @pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
    def test_eager_prefill_and_steps_equal_one_causal_forward(self, need_weights):
        rng = np.random.default_rng(10)
        sd = _decode_sd(rng, *EAGER[:1])
        m = _decode_module(sd, *EAGER)
        x = rng.standard_normal((DB, L, DE))
        got, got_w, _ = _run_decode(m, jnp.asarray(x), STARTS, _eager(need_weights))
        want, want_w = _full_forward(m, jnp.asarray(x), STARTS)
        self._check(got, got_w, want, want_w, _oracle_decode(sd, x, STARTS, *EAGER), STARTS)
        assert need_weights or got_w is None

    def test_prefill_in_chunks_and_a_multi_token_step(self):
        rng = np.random.default_rng(11)
        sd = _decode_sd(rng, DK)
        m = _decode_module(sd, DK, "half")
        x = jnp.asarray(rng.standard_normal((DB, L, DE)))
        got, got_w, _ = _run_decode(m, x, STARTS, _jitted(True), chunks=(2, 3, 1, 3))
        want, want_w = _full_forward(m, x, STARTS)
        np.testing.assert_allclose(got, want, **DTOL)
        np.testing.assert_allclose(got_w[..., :L], want_w, **DTOL)

    def test_cache_holds_the_rotated_keys_and_values_of_K_heads(self):
        rng = np.random.default_rng(12)
        sd = _decode_sd(rng, DK)
        m = _decode_module(sd, *EAGER)
        x = rng.standard_normal((DB, L, DE))
        _, _, cache = _run_decode(m, jnp.asarray(x), STARTS, _eager(True))
        ref = _oracle_decode(sd, x, STARTS, *EAGER)
        assert cache.k.shape == cache.v.shape == (DB, CAP, DK, DH) and cache.k.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(cache.k[:, :L]), ref.k_rot.transpose(0, 2, 1, 3), **DTOL)
        np.testing.assert_allclose(np.asarray(cache.v[:, :L]), ref.v.transpose(0, 2, 1, 3), **DTOL)
        # not the keys before RoPE: the check above can fail
        assert np.abs(np.asarray(cache.k[:, 1:L]) - ref.k.transpose(0, 2, 1, 3)[:, 1:]).max() > 1e-2
        assert (np.asarray(cache.k[:, L:]) == 0).all() and (np.asarray(cache.v[:, L:]) == 0).all()
        np.testing.assert_array_equal(np.asarray(cache.starts), STARTS)
        np.testing.assert_array_equal(np.asarray(cache.lengths), np.full(DB, L))

    def test_intermediates_are_the_new_tokens_in_the_oracles_layout(self):
        rng = np.random.default_rng(13)
        sd = _decode_sd(rng, DK)
        m = _decode_module(sd, *EAGER)
        x = rng.standard_normal((DB, P + 1, DE))
        _, _, cache = m(x[:, :P], x[:, :P], x[:, :P], cache=m.init_cache(DB, CAP, starts=STARTS))
        xs = x[:, P:]
        out, w, cache, st = m(xs, xs, xs, cache=cache, return_intermediates=True)
        ref = _oracle_decode(sd, x, STARTS, *EAGER)
        new = slice(P, P + 1)
        for name in ("q", "q_rot"):  # (B, N, 1, H)
            np.testing.assert_allclose(np.asarray(getattr(st, name)), getattr(ref, name)[:, :, new], err_msg=name, **DTOL)
        for name in ("k", "v", "k_rot"):  # (B, K, 1, H): the new token's, K heads
            assert getattr(st, name).shape == (DB, DK, 1, DH), name
            np.testing.assert_allclose(np.asarray(getattr(st, name)), getattr(ref, name)[:, :, new], err_msg=name, **DTOL)
        assert st.scores.shape == st.weights.shape == (DB, DN, 1, CAP)
        np.testing.assert_allclose(np.asarray(st.scores[..., :P + 1]), ref.scores[:, :, new], **DTOL)
        assert np.isneginf(np.asarray(st.scores[..., P + 1:])).all()
        np.testing.assert_allclose(np.asarray(st.context), ref.context[:, new], **DTOL)
        np.testing.assert_array_equal(np.asarray(st.output), np.asarray(out))
        np.testing.assert_array_equal(np.asarray(st.weights), np.asarray(w))
        _, none, _, st = m(xs, xs, xs, cache=cache, need_weights=False, return_intermediates=True)
        assert none is None and st.scores is None and st.weights is None

    def test_zero_policy_padding_rows_give_the_output_bias(self):
        rng = np.random.default_rng(14)
        sd = _decode_sd(rng, DK)
        m = _decode_module(sd, *EAGER, masked_rows="zero")
        x = jnp.asarray(rng.standard_normal((DB, L, DE)))
        got, _, _ = _run_decode(m, x, STARTS, _eager(False))
        np.testing.assert_allclose(got, _full_forward(m, x, STARTS)[0], **DTOL)
        pad = _padding_rows(STARTS)
        np.testing.assert_array_equal(got[pad], np.broadcast_to(sd["out_proj.bias"], got[pad].shape))

    def test_positions_override_the_cache_default(self):
        rng = np.random.default_rng(15)
        sd = _decode_sd(rng, DK)
        m = _decode_module(sd, *EAGER)
        x = jnp.asarray(rng.standard_normal((DB, L, DE)))

        def step(m, xi, cache):  # stretched, not shifted: RoPE's scores depend on position differences only
            return m(xi, xi, xi, cache=cache, positions=cache.positions(xi.shape[1]) * 3)

        got, _, _ = _run_decode(m, x, STARTS, step)
        np.testing.assert_allclose(got, _full_forward(m, x, STARTS, stretch=3)[0], **DTOL)
        default = _full_forward(m, x, STARTS)[0]
        real = ~_padding_rows(STARTS)
        assert np.abs(got[real] - default[real]).max() > 1e-2  # the override is not ignored

    @pytest.mark.parametrize("how, need_weights", [("nnx.jit", True), ("jax.jit-split", False)])
    def test_one_jitted_step_serves_every_position(self, how, need_weights):
        """Traces counted by a Python side effect (and jax.jit's own cache size): the prefill (T=5)
        and the step (T=1) trace once each; the steps at positions 5..8 reuse that compile."""
        rng = np.random.default_rng(16)
        m = _decode_module(_decode_sd(rng, DK), DK, "interleaved")
        x = jnp.asarray(rng.standard_normal((DB, L, DE)))
        traces = []
        if how == "nnx.jit":
            @nnx.jit
            def call(m, xi, cache):
                traces.append(xi.shape[1])
                return m(xi, xi, xi, cache=cache, need_weights=need_weights)
        else:
            graphdef, state = nnx.split(m)

            @jax.jit
            def pure(state, xi, cache):
                traces.append(xi.shape[1])
                return nnx.merge(graphdef, state)(xi, xi, xi, cache=cache, need_weights=need_weights)

            def call(m, xi, cache):
                return pure(state, xi, cache)

        got, got_w, cache = _run_decode(m, x, STARTS, call)
        assert traces == [P, 1]
        if how != "nnx.jit":
            assert pure._cache_size() == 2
        want, want_w = _full_forward(m, x, STARTS)
        np.testing.assert_allclose(got, want, **DTOL)
        if need_weights:
            np.testing.assert_allclose(got_w[..., :L], want_w, **DTOL)
        np.testing.assert_array_equal(np.asarray(cache.lengths), np.full(DB, L))

    def _nearly_full(self, m, x):
        """A prefilled cache whose rows hold 9, 11 and 10 of 11 slots: row 1 has no room for a token."""
        _, _, cache = m(x[:, :P], x[:, :P], x[:, :P], cache=m.init_cache(DB, CAP, starts=STARTS))
        return dataclasses.replace(cache, lengths=jnp.asarray([9, 11, 10], jnp.int32))

    def test_no_room_is_a_value_error_where_the_lengths_are_known(self):
        rng = np.random.default_rng(17)
        m = _decode_module(_decode_sd(rng, DK), *EAGER)
        x = jnp.asarray(rng.standard_normal((DB, P + 1, DE)))
        cache = self._nearly_full(m, x)
        xs = x[:, P:]
        with pytest.raises(ValueError, match=r"holds 11 slots per row; rows \[1\] with lengths \[11\] "
                                             r"have no room for 1 more tokens"):
            m(xs, xs, xs, cache=cache)

    @pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
    def test_no_room_under_jit_gives_a_nan_row_and_leaves_it_unwritten(self, need_weights):
        """Row 1 has no room: NaN output (and weights), its cache row unchanged; rows 0 and 2 are
        what the same step gives with row 1 shortened so that it fits."""
        rng = np.random.default_rng(19)
        m = _decode_module(_decode_sd(rng, DK), *EAGER)
        x = jnp.asarray(rng.standard_normal((DB, P + 1, DE)))
        cache = self._nearly_full(m, x)
        xs = x[:, P:]
        out, w, new = _jit_step(m, xs, cache, need_weights=need_weights)
        out = np.asarray(out)
        assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()
        if need_weights:
            w = np.asarray(w)
            assert np.isnan(w[1]).all() and np.isfinite(w[[0, 2]]).all()
        for name in ("k", "v"):
            np.testing.assert_array_equal(np.asarray(getattr(new, name))[1], np.asarray(getattr(cache, name))[1])
        np.testing.assert_array_equal(np.asarray(new.lengths), [10, 11, 11])
        fitting = dataclasses.replace(cache, lengths=jnp.asarray([9, 7, 10], jnp.int32))
        want, _, want_cache = _jit_step(m, xs, fitting, need_weights=need_weights)
        np.testing.assert_array_equal(out[[0, 2]], np.asarray(want)[[0, 2]])
        np.testing.assert_array_equal(np.asarray(new.k)[[0, 2]], np.asarray(want_cache.k)[[0, 2]])
        assert (np.asarray(new.k)[[0, 2]] != np.asarray(cache.k)[[0, 2]]).any()  # rows 0 and 2 were written

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_low_precision_decoding_equals_the_forward(self, dtype):
        """Same module and dtype, decoding vs one forward: the scores and sums run over C slots
        instead of L keys (the extra ones masked). Measured worst differences here (outputs up to
        2.9): float32 4.8e-7 (bound: the float32 forward entry, 1e-6 + 1e-5·|x|); bfloat16 with
        float32 parameters 0.0078 on the fused path, one bfloat16 ulp of an entry in [1, 2), 0 on
        the weights path (bound: 2·2⁻⁸·max|output| = 0.023, 2⁻⁸ being bfloat16's unit roundoff)."""
        rng = np.random.default_rng(20)
        sd = {k: v.astype(np.float32) for k, v in _decode_sd(rng, DK).items()}
        m = _decode_module(sd, DK, "half", dtype=jnp.dtype(dtype))
        x = jnp.asarray(rng.standard_normal((DB, L, DE)), dtype)
        want = _full_forward(m, x, STARTS)[0]
        assert m.init_cache(DB, CAP).k.dtype == dtype
        for need_weights in (True, False):
            got, _, cache = _run_decode(m, x, STARTS, _jitted(need_weights))
            assert cache.k.dtype == got.dtype == want.dtype == dtype
            g, w = got.astype(np.float64), want.astype(np.float64)
            np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
            if dtype == "float32":
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
            else:
                assert np.nanmax(np.abs(g - w)) <= 2 * 2.0 ** -8 * np.nanmax(np.abs(w))

    def test_float32_jitted_without_x64_matches_the_oracle(self):
        """Without x64 the jitted step's positions (the cache's, traced) take float32 angles, an
        angle error up to |angle|·2⁻²⁴; at positions < 9 the output stays within the float32 entry
        of the tolerance table against the float64 oracle."""
        rng = np.random.default_rng(21)
        sd = _decode_sd(rng, DK)
        x = rng.standard_normal((DB, L, DE))
        with jax.enable_x64(False):
            m = _decode_module({k: v.astype(np.float32) for k, v in sd.items()}, DK, "half")
            got, _, _ = _run_decode(m, jnp.asarray(x, jnp.float32), STARTS, _jitted(False))
        assert got.dtype == np.float32
        c = compare(got, _oracle_decode(sd, x.astype(np.float32), STARTS, DK, "half").output,
                    tolerance_for("float32").forward)
        assert c.passed, c

    def test_bad_calls_are_named(self):
        m = _decode_module(_decode_sd(np.random.default_rng(22), DK), *EAGER)
        x = jnp.zeros((DB, 2, DE))
        cache = m.init_cache(DB, CAP)
        with pytest.raises(ValueError, match="mask= with a cache"):
            m(x, x, x, np.ones((2, 2), bool), cache=cache)
        with pytest.raises(ValueError, match="key_positions= with a cache"):
            m(x, x, x, key_positions=np.arange(2), cache=cache)
        y = jnp.zeros((DB, 3, DE))
        with pytest.raises(ValueError, match=r"same new tokens: got query \(3, 2, 24\), key \(3, 3, 24\)"):
            m(x, y, y, cache=cache)
        with pytest.raises(TypeError, match="the cache holds float32 but the module computes in float64"):
            m(x, x, x, cache=KVCache.empty(DB, CAP, DK, DH, dtype=jnp.float32))
        with pytest.raises(ValueError, match=r"cache keys \(3, 11, 4, 6\) \(BCKH\) have K=4 heads of H=6; the layer has K=2"):
            m(x, x, x, cache=KVCache.empty(DB, CAP, DN, DH, dtype=jnp.float64))
        with pytest.raises(ValueError, match=r"holds 2 rows, the new tokens \(3, 2, 24\) 3"):
            m(x, x, x, cache=m.init_cache(2, CAP))
        with pytest.raises(TypeError, match="cache must be a mha_jax.kv_cache.KVCache"):
            m(x, x, x, cache=(cache.k, cache.v))
        with pytest.raises(ValueError, match=r"positions must have shape \(2,\) or \(3, 2\), got \(3,\)"):
            m(x, x, x, positions=np.arange(3), cache=cache)
        plain = _decode_module(_decode_sd(np.random.default_rng(22), DK), DK, None)
        with pytest.raises(ValueError, match="rope=None"):
            plain(x, x, x, positions=np.arange(2), cache=cache)
        with pytest.raises(ValueError, match=r"q \(3, 2, 4, 6\) .* the cache \(3, 11, 4, 6\)"):
            cached_attention(jnp.zeros((DB, 2, DN, DH)), jnp.zeros((DB, 2, DK, DH)), jnp.zeros((DB, 2, DK, DH)),
                             KVCache.empty(DB, CAP, DN, DH, dtype=jnp.float64))
        with pytest.raises(TypeError, match="new keys have dtype float32, the cache holds float64"):
            cached_attention(jnp.zeros((DB, 2, DN, DH)), jnp.zeros((DB, 2, DK, DH), jnp.float32),
                             jnp.zeros((DB, 2, DK, DH)), cache)


# ------------------------------------------------------------- structured masks
# docs/semantics.md, "Packed sequences, sliding windows and causal alignment", as in
# tests/test_torch_attention.py's TestMasks (the same cases): against the float64 oracle, both
# paths, every dtype; gradients in float64; under jax.jit with traced segment ids.

SEG = np.array([[0, 0, 0, 1, 1, 1, 1, 1],  # two documents
                [0, 0, 1, 1, 1, 2, 2, 2],  # three
                [5, 5, 5, 5, 5, 7, 7, 9]])  # three, other ids, a one-token document last
PAD = np.ones((3, 1, 1, 8), bool)  # key padding, ANDed with the structure
PAD[0, ..., 3] = False  # row 0: the first key of its second document
PAD[2, ..., 7] = False  # row 2: the one-token document's key, so its query keeps nothing
# (id, layer, T, S, keywords, mask); "grouped" is E=24 N=4 K=2 H=6 with RoPE at segment_positions(SEG)
MASK_CASES = [
    ("causal T<S", "classic", 5, 7, dict(is_causal=True), None),
    ("causal bottom-right T<S", "classic", 5, 7, dict(is_causal=True, alignment="bottom-right"), None),
    ("causal T>S", "classic", 7, 5, dict(is_causal=True), None),
    ("causal bottom-right T>S", "classic", 7, 5, dict(is_causal=True, alignment="bottom-right"), None),  # 2 rows keep nothing
    ("window (2, 0)", "classic", 8, 8, dict(window=(2, 0)), None),
    ("window (1, 1) bottom-right", "classic", 5, 7, dict(window=(1, 1), alignment="bottom-right"), None),
    ("window 2", "classic", 8, 8, dict(window=2), None),
    ("window (None, 1)", "classic", 5, 7, dict(window=(None, 1)), None),
    ("packed", "classic", 8, 8, dict(segment_ids=SEG), None),
    ("packed cross", "classic", 5, 7, dict(segment_ids=SEG[:, :5], key_segment_ids=SEG[:, 1:]), None),
    ("packed causal window padding", "grouped", 8, 8,
     dict(segment_ids=SEG, is_causal=True, window=(2, 1), positions=reference.segment_positions(SEG),
          key_positions=reference.segment_positions(SEG)), PAD),
]
MASK_LAYERS = {"classic": dict(num_heads=3), "grouped": dict(num_heads=4, num_kv_heads=2, rope="half", rope_theta=THETA)}
# Eager JAX compiles each operation once per shape and dtype: the cases run under one jax.jit per
# dtype (segment ids, positions and masks traced arguments), and the other dtypes and the gradients
# take the cases of two or three shapes: alignment, window, cross packing and the combined case with
# its fully masked row (float32/16-bit); rows keeping nothing by alignment, cross packing, the
# combined case (gradients). tests/test_torch_attention.py runs every case in every dtype.
DTYPE_CASES = [MASK_CASES[i] for i in (1, 5, 9, 10)]
GRAD_CASES = [MASK_CASES[i] for i in (3, 9, 10)]


def _mask_sd(layer: str, seed: int = 0) -> dict:
    cfg = AttentionConfig(12 if layer == "classic" else 24, MASK_LAYERS[layer]["num_heads"],
                          num_kv_heads=MASK_LAYERS[layer].get("num_kv_heads"))
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape) / math.sqrt(shape[-1]) for name, shape in cfg.weight_shapes().items()}


def _mask_inputs(layer: str, T: int, S: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    E = 12 if layer == "classic" else 24
    return tuple(rng.standard_normal((3, L, E)) for L in (T, S, S))


def _mask_module(sd, layer: str, **kw):
    return convert.to_jax(sd, **MASK_LAYERS[layer], **kw)


def _judge_forward(out, exact, low, dtype):
    """float64/float32 against the exact output elementwise (the table's entry: these modules' errors at these
    sizes sit far below it), 16-bit three-way against its stored-stage yardstick `low`."""
    tol = tolerance_for(dtype)
    if low is None:
        return compare(out, exact, tol.forward)
    return compare_three_way(out, exact, low, tol.three_way_k, tol.forward.atol)


class TestMasks:
    """Each structured mask kind against the float64 oracle, on both paths (and each fused kernel),
    in every dtype; the gradients in float64; traced segment ids; alignment; segment_positions; bad
    arguments."""

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_each_kind_matches_the_oracle_on_both_paths(self, dtype):
        dt = np_dtype(dtype)
        cases = MASK_CASES if dtype == "float64" else DTYPE_CASES
        sds = [cast_sd(_mask_sd(layer), dt) for _, layer, *_ in cases]
        xss = [[x.astype(dt) for x in _mask_inputs(layer, T, S)] for _, layer, T, S, _, _ in cases]
        got = _run_cases(cases, [_mask_module(sd, case[1]) for sd, case in zip(sds, cases)], xss)
        for (name, layer, T, S, kw, mask), sd, xs, outs in zip(cases, sds, xss, got):
            sd64, x64 = {n: reference.as_float64(a) for n, a in sd.items()}, [reference.as_float64(x) for x in xs]
            exact = reference.forward(sd64, *x64, mask, **MASK_LAYERS[layer], **kw)
            low = reference.forward(sd, *x64, mask, dtype=dt, **MASK_LAYERS[layer], **kw) if dt.itemsize < 4 else None
            for need_weights, (out, w) in zip((True, False), outs):
                c = _judge_forward(np.asarray(out), exact.output, None if low is None else low.output, dtype)
                assert c.passed, (name, need_weights, c)
                if need_weights:
                    c = _judge_forward(np.asarray(w), exact.weights, None if low is None else low.weights, dtype)
                    assert c.passed, (name, "weights", c)
                else:
                    assert w is None

    @pytest.mark.parametrize("kernel", ["chunked", "dpa-xla"])
    def test_each_fused_kernel_takes_the_structure(self, kernel, force_kernel):
        """The combined case (packing, window, padding: whole 2x3 blocks masked, and a row that keeps
        nothing) on the kernels the tiny sizes would not pick: the chunked one and
        jax.nn.dot_product_attention (float32: its softmax runs in float32)."""
        force_kernel(kernel, 2, 3)
        dtype = "float32" if kernel == "dpa-xla" else "float64"
        name, layer, T, S, kw, mask = MASK_CASES[-1]
        sd = cast_sd(_mask_sd(layer), np.dtype(dtype))
        xs = [x.astype(dtype) for x in _mask_inputs(layer, T, S)]
        sd64 = {n: a.astype(np.float64) for n, a in sd.items()}
        exact = reference.forward(sd64, *(x.astype(np.float64) for x in xs), mask, **MASK_LAYERS[layer], **kw)
        out, _ = _mask_module(sd, layer)(*(jnp.asarray(x) for x in xs), mask, need_weights=False, **kw)
        c = compare(np.asarray(out), exact.output, tolerance_for(dtype).forward)
        assert c.passed, (name, c)
        assert np.isnan(exact.output[2, 7]).all() and c.nan_mismatch == 0

    def test_the_chunked_kernel_is_given_a_band_as_structure_and_matches_the_oracle(self, force_kernel, monkeypatch):
        """The causal and window cases (no segment ids) on the chunked kernel: it gets is_causal, window
        and alignment and no keep-mask (the band is built into its blocks), and matches the float64 oracle,
        forward and gradients (the T > S bottom-right case's first rows keep nothing)."""
        import mha_jax.attention as attention_module

        force_kernel("chunked", 2, 3)
        seen = []

        def spy(q, k, v, keep=None, **kw):
            seen.append((keep, kw["structure"]))  # a mha_spec.Structure: is_causal, window, alignment
            return chunked_attention(q, k, v, keep, **kw)

        monkeypatch.setattr(attention_module, "chunked_attention", spy)
        for name, layer, T, S, kw, mask in MASK_CASES[:8]:
            sd, xs = _mask_sd(layer), _mask_inputs(layer, T, S)
            m = _mask_module(sd, layer, masked_rows="zero")
            g = np.random.default_rng(5).standard_normal(xs[0].shape)
            out, vjp = jax.vjp(lambda q, k, v: m(q, k, v, mask, need_weights=False, **kw)[0], *map(jnp.asarray, xs))
            assert seen[-1][0] is None and seen[-1][1].is_causal == kw.get("is_causal", False), name
            exact = reference.forward(sd, *xs, mask, masked_rows="zero", **MASK_LAYERS[layer], **kw)
            c = compare(np.asarray(out), exact.output, tolerance_for("float64").forward)
            assert c.passed, (name, c)
            ref = reference.backward(sd, *xs, mask, g, masked_rows="zero", **MASK_LAYERS[layer], **kw)
            for grad_name, got in zip(("query", "key", "value"), vjp(jnp.asarray(g))):
                c = compare(np.asarray(got), ref[grad_name], tolerance_for("float64").gradient)
                assert c.passed, (name, grad_name, c)

    def test_every_gradient_matches_the_oracle_backward(self):
        """float64, the "zero" policy (fully masked rows have no gradient)."""
        sds = [_mask_sd(layer, seed=2) for _, layer, *_ in GRAD_CASES]
        xss = [_mask_inputs(layer, T, S, seed=3) for _, layer, T, S, _, _ in GRAD_CASES]
        gs = [np.random.default_rng(4).standard_normal(xs[0].shape) for xs in xss]
        mods = [_mask_module(sd, case[1], masked_rows="zero") for sd, case in zip(sds, GRAD_CASES)]
        got = _run_cases(GRAD_CASES, mods, xss, gs)
        for (name, layer, T, S, kw, mask), sd, xs, g, grads in zip(GRAD_CASES, sds, xss, gs, got):
            ref = reference.backward(sd, *xs, mask, g, masked_rows="zero", **MASK_LAYERS[layer], **kw)
            for need_weights, (gm, gq, gk, gv) in zip((True, False), grads):
                got_named = {"query": gq, "key": gk, "value": gv}
                for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
                    got_named[f"{p}.weight"] = np.asarray(getattr(gm, p).kernel[...]).T
                    got_named[f"{p}.bias"] = getattr(gm, p)["bias"][...]
                assert sorted(got_named) == sorted(ref)
                for grad_name, want in ref.items():
                    c = compare(np.asarray(got_named[grad_name]), want, tolerance_for("float64").gradient)
                    assert c.passed, (name, need_weights, grad_name, c)

    def test_under_jit_segment_ids_are_traced_data(self):
        """One trace (both paths) serves two packing layouts: the ids are traced, not constants; each
        layout matches the oracle. segment_positions likewise."""
        sd = _mask_sd("classic")
        m = _mask_module(sd, "classic")
        q, k, v = _mask_inputs("classic", 8, 8)
        traces = []

        @jax.jit
        def f(q, k, v, seg):
            traces.append(seg)
            return [m(q, k, v, need_weights=nw, segment_ids=seg, is_causal=True, window=(3, 0))[0] for nw in (True, False)]

        for seg in (SEG, SEG[::-1]):
            ref = reference.forward(sd, q, k, v, num_heads=3, segment_ids=seg, is_causal=True, window=(3, 0))
            for out in f(*(jnp.asarray(x) for x in (q, k, v, seg))):
                assert_close(np.asarray(out), ref.output)
        assert len(traces) == 1 and isinstance(traces[0], jax.core.Tracer)
        jitted = jax.jit(lambda seg: segment_positions(seg))
        for seg in (SEG, SEG[::-1]):
            np.testing.assert_array_equal(np.asarray(jitted(jnp.asarray(seg))), reference.segment_positions(seg))
        assert jitted._cache_size() == 1

    def test_the_two_alignments_differ_and_each_matches_the_oracle(self):
        sd = _mask_sd("classic")
        q, k, v = _mask_inputs("classic", 5, 7)
        m = _mask_module(sd, "classic")
        outs = {}
        for alignment in ("top-left", "bottom-right"):
            ref = reference.forward(sd, q, k, v, num_heads=3, is_causal=True, alignment=alignment).output
            for need_weights in (True, False):
                out = np.asarray(m(q, k, v, need_weights=need_weights, is_causal=True, alignment=alignment)[0])
                assert_close(out, ref)
            outs[alignment] = out
        # top-left row 0 keeps key 0 only, bottom-right keys 0..2: every row differs
        assert (np.abs(outs["top-left"] - outs["bottom-right"]).max(axis=-1) > 1e-3).all()

    def test_segment_positions_equal_the_oracles(self):
        for seg in (np.array([[4, 4, 1, 1, 4, 4, 4]]), np.zeros((3, 0), np.int64), SEG.astype(np.uint8)):
            got = segment_positions(jnp.asarray(seg))
            assert jnp.issubdtype(got.dtype, jnp.integer)
            np.testing.assert_array_equal(np.asarray(got), reference.segment_positions(seg))

    @pytest.mark.parametrize("kw, error, match", [
        (dict(window=(-1, 0)), ValueError, r"window left must be a non-negative int or None, got -1"),
        (dict(window=(1.5, None)), ValueError, r"window left must be a non-negative int or None, got 1.5"),
        (dict(window=(1, 2, 3)), TypeError, r"window must be None, an int or a \(left, right\) pair"),
        (dict(is_causal="yes"), TypeError, r"is_causal must be a bool"),
        (dict(alignment="bottom"), ValueError, r"alignment='bottom' is not one of \('top-left', 'bottom-right'\)"),
        (dict(segment_ids=np.zeros((3, 5), np.int64)), ValueError, r"with T=5 != S=7: pass key_segment_ids \(B, S\)"),
        (dict(segment_ids=np.zeros((3, 5)), key_segment_ids=np.zeros((3, 7), np.int64)), TypeError,
         r"segment_ids must be integers, got dtype float64"),
        (dict(segment_ids=np.zeros((2, 5), np.int64), key_segment_ids=np.zeros((2, 7), np.int64)), ValueError,
         r"segment_ids must have shape \(B, T\) with B=3, T=5, got \(2, 5\)"),
        (dict(segment_ids=np.zeros((3, 5), np.int64), key_segment_ids=np.zeros((3, 5), np.int64)), ValueError,
         r"key_segment_ids must have shape \(B, S\) with B=3, S=7, got \(3, 5\)"),
        (dict(key_segment_ids=np.zeros((3, 7), np.int64)), ValueError, r"key_segment_ids without segment_ids"),
    ])
    def test_bad_arguments_are_named(self, kw, error, match):
        m = _mask_module(_mask_sd("classic"), "classic")
        q, k, v = _mask_inputs("classic", 5, 7)
        with pytest.raises(error, match=match):
            m(q, k, v, **kw)

    def test_with_a_cache_they_are_value_errors(self):
        m = _mask_module(_mask_sd("classic"), "classic")
        x = jnp.zeros((3, 2, 12), jnp.float64)
        for kw in (dict(is_causal=True), dict(window=2), dict(segment_ids=jnp.zeros((3, 2), jnp.int32)),
                   dict(alignment="bottom-right")):
            with pytest.raises(ValueError, match=f"{next(iter(kw))} with a cache"):
                m(x, x, x, cache=m.init_cache(3, 4), **kw)


def _run_cases(cases, mods, xss, cotangents=None):
    """Every case on both paths under one jax.jit (its arrays traced): per case [(output, weights)
    with need_weights True, False], or with cotangents the gradients of sum(output * g),
    [(module state, d_query, d_key, d_value)] per path."""
    statics = [{n: v for n, v in kw.items() if not isinstance(v, np.ndarray)} for *_, kw, _ in cases]
    arrays = [({n: jnp.asarray(v) for n, v in kw.items() if isinstance(v, np.ndarray)},
               None if mask is None else jnp.asarray(mask)) for *_, kw, mask in cases]

    @nnx.jit
    def run(mods, xss, arrays, cotangents):
        results = []
        for i, (m, xs, (kw, mask)) in enumerate(zip(mods, xss, arrays)):
            def call(m, q, k, v, need_weights):
                return m(q, k, v, mask, need_weights=need_weights, **statics[i], **kw)

            if cotangents is None:
                results.append([call(m, *xs, nw) for nw in (True, False)])
            else:
                def loss(m, q, k, v, nw):
                    return jnp.sum(call(m, q, k, v, nw)[0] * cotangents[i])

                results.append([nnx.grad(loss, argnums=(0, 1, 2, 3))(m, *xs, nw) for nw in (True, False)])
        return results

    return run(mods, [[jnp.asarray(x) for x in xs] for xs in xss], arrays,
               None if cotangents is None else [jnp.asarray(g) for g in cotangents])
