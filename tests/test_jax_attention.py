"""mha_jax.attention against the float64 oracle: the classic layer under jax.jit with a traced
mask, nnx.jit/nnx.grad and jax.grad under each masked-row policy, float64 without x64; then
grouped key/value heads, RoPE and bias-free projections, alone and together (TestVariants), and
the tests of one feature (TestGrouped, TestRope).

Float64 throughout (x64 is on for the session, conftest). What the classic layer shares with the
torch module (masks, policies, dtypes, bad input) is tested on both frameworks at once in
tests/test_modules.py.
"""

from __future__ import annotations

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
from helpers import assert_close, build, oracle
from mha_jax import MultiHeadAttention, attention_core, chunked_attention, fused_attention_core
from mha_jax.attention import rope_cos_sin
from parity import convert, reference
from parity.tolerances import compare, tolerance_for

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
            cos, _ = rope_cos_sin(jnp.asarray(pos, jnp.int32), pos.size, H, THETA, jnp.float32)
            traced, _ = jax.jit(lambda p: rope_cos_sin(p, pos.size, H, THETA, jnp.float32))(jnp.asarray(pos, jnp.int32))
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
