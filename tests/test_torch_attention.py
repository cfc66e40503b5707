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
from helpers import DTYPES, assert_close, build, cast_sd, np_dtype, oracle
from mha_spec import AttentionConfig
from mha_torch import MultiHeadAttention, segment_positions
from mha_torch.attention import rotate
from parity import convert, reference
from parity.tolerances import compare, compare_three_way, tolerance_for

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
        got = rotate(torch.from_numpy(x), torch.from_numpy(pos).reshape(B, 1, T, 1),
                     AttentionConfig(E, N, rope=rope, rope_theta=THETA))
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


# ------------------------------------------------------------- incremental decoding with a KV cache
# Decode sizes, pairwise distinct: B rows, DE = DN * DH, DK key/value heads, a prompt of P tokens,
# STEPS single-token steps, CAP slots per row (room for P + STEPS = L tokens and two more).
DB, DN, DK, DH = 3, 4, 2, 6
DE = DN * DH  # 24
P, STEPS, CAP = 5, 4, 11
L = P + STEPS  # 9
PADDED = (0, 2, 1)  # left-padding slots of each row

# (num_kv_heads, rope, qkv_bias, out_bias)
DECODE_VARIANTS = [
    pytest.param(None, None, True, True, id="classic"),
    pytest.param(DK, None, True, True, id="grouped"),
    pytest.param(None, "half", True, True, id="rope-half"),
    pytest.param(DK, "interleaved", True, True, id="grouped-rope-interleaved"),
    pytest.param(DK, "half", False, False, id="grouped-rope-half-bias-free"),
]


def _decode_module(rng, n_kv, rope, qkv_bias=True, out_bias=True, masked_rows="nan"):
    mod = MultiHeadAttention(DE, DN, num_kv_heads=n_kv, qkv_bias=qkv_bias, out_bias=out_bias, rope=rope,
                             rope_theta=THETA, masked_rows=masked_rows, dtype=torch.float64)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) / math.sqrt(p.shape[-1])))
    sd = {k: v.detach().numpy().copy() for k, v in mod.state_dict().items()}
    return mod, sd


def _causal_padded(starts, length=L):
    """The one-forward equivalent of a decode: keep[b, t, s] = starts[b] <= s <= t, positions t - starts[b]."""
    starts = np.asarray(starts)
    t = np.arange(length)
    keep = (starts[:, None, None] <= t[None, None, :]) & (t[None, None, :] <= t[None, :, None])  # (B, L, L)
    pos = t[None, :] - starts[:, None]  # (B, L)
    return keep, pos


def _real_rows(starts, length=L):
    """bool (B, L): the columns holding a row's real tokens (t >= starts[b])."""
    return np.arange(length)[None, :] >= np.asarray(starts)[:, None]


def _decode(mod, x, starts, chunks, need_weights, capacity=CAP, positions=None):
    """Run x (B, sum(chunks), E) through mod chunk by chunk from an empty cache.
    Returns outputs (B, L, E), weights (B, N, L, C) or None, the last cache, each step's Stages."""
    cache = mod.init_cache(x.shape[0], capacity, starts=torch.tensor(starts))
    outs, weights, stages, at = [], [], [], 0
    with torch.no_grad():
        for n in chunks:
            xs = x[:, at:at + n]
            kw = {} if positions is None else {"positions": positions[:, at:at + n]}
            out, w, cache, st = mod(xs, xs, xs, cache=cache, need_weights=need_weights, return_intermediates=True, **kw)
            outs.append(out)
            weights.append(w)
            stages.append(st)
            at += n
    w = torch.cat(weights, dim=2) if need_weights else None
    return torch.cat(outs, dim=1), w, cache, stages


def _full(mod, x, starts, need_weights, offset=0):
    keep, pos = _causal_padded(starts, x.shape[1])
    pos = torch.from_numpy(pos + offset) if mod.config.rope else None
    with torch.no_grad():
        return mod(x, x, x, torch.from_numpy(keep), need_weights=need_weights, positions=pos, key_positions=pos,
                   return_intermediates=True)


class TestDecode:
    """A prefill and single-token steps through a KVCache give the one causal forward over all tokens
    (docs/semantics.md, "Decoding with a KV cache"), judged against the module itself and the oracle."""

    @pytest.mark.parametrize("starts", [(0, 0, 0), PADDED], ids=["unpadded", "left-padded"])
    @pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
    @pytest.mark.parametrize("n_kv, rope, qkv_bias, out_bias", DECODE_VARIANTS)
    def test_prefill_and_steps_equal_one_forward(self, n_kv, rope, qkv_bias, out_bias, need_weights, starts):
        rng = np.random.default_rng(10)
        mod, sd = _decode_module(rng, n_kv, rope, qkv_bias, out_bias)
        x = rng.standard_normal((DB, L, DE))
        got, weights, cache, _ = _decode(mod, _t(x), starts, [P] + [1] * STEPS, need_weights)
        full, full_w, _ = _full(mod, _t(x), starts, need_weights)
        keep, pos = _causal_padded(starts)
        ref = reference.forward(sd, x, x, x, keep, num_heads=DN, num_kv_heads=n_kv, rope=rope, rope_theta=THETA,
                                positions=pos if rope else None, key_positions=pos if rope else None)
        real = _real_rows(starts)
        np.testing.assert_allclose(got.numpy()[real], full.numpy()[real], rtol=1e-12, atol=1e-12)
        assert_close(got.numpy()[real], ref.output[real])
        assert np.abs(ref.output[real]).max() > 0.1  # order-1 outputs: the tolerance is tight
        # A padding column attends nothing: NaN under the default policy, in all three.
        assert np.isnan(got.numpy()[~real]).all() and np.isnan(ref.output[~real]).all()
        assert np.isnan(full.numpy()[~real]).all()
        assert cache.lengths.tolist() == [L] * DB and cache.starts.tolist() == list(starts)
        if need_weights:
            w = weights.numpy()  # (B, N, L, C)
            assert w.shape == (DB, DN, L, CAP)
            np.testing.assert_allclose(w[..., :L].transpose(0, 2, 1, 3)[real], ref.weights.transpose(0, 2, 1, 3)[real],
                                       rtol=1e-12, atol=1e-12)
            assert (w[..., L:].transpose(0, 2, 1, 3)[real] == 0).all()  # slots never written
        else:
            assert weights is None

    @pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
    @pytest.mark.parametrize("chunks", [(3, 2, 1, 1, 1, 1), (3, 2, 2, 2), (1,) * L], ids=["3+2", "3+2+2+2", "ones"])
    def test_chunks_equal_one_forward(self, chunks, need_weights):
        """A prefill in chunks (and steps of two tokens: causal within the new ones) changes nothing."""
        rng = np.random.default_rng(11)
        mod, _ = _decode_module(rng, DK, "half")
        x = _t(rng.standard_normal((DB, L, DE)))
        got, weights, _, _ = _decode(mod, x, PADDED, chunks, need_weights)
        full, full_w, _ = _full(mod, x, PADDED, need_weights)
        real = _real_rows(PADDED)
        np.testing.assert_allclose(got.numpy()[real], full.numpy()[real], rtol=1e-12, atol=1e-12)
        assert np.isnan(got.numpy()[~real]).all()
        if need_weights:
            np.testing.assert_allclose(weights[..., :L].numpy(), full_w.numpy(), rtol=1e-12, atol=1e-12)

    def test_cache_holds_rotated_keys_of_k_heads(self):
        """Slots 0..L-1 hold the full forward's k after RoPE and v, with K heads; the rest stay zero.
        Each step's Stages k/v/k_rot are the new tokens' (B, K, T, H)."""
        rng = np.random.default_rng(12)
        mod, sd = _decode_module(rng, DK, "interleaved")
        x = rng.standard_normal((DB, L, DE))
        empty = mod.init_cache(DB, CAP, starts=torch.tensor(PADDED))
        assert empty.k.shape == (DB, DK, CAP, DH) and empty.k.dtype == torch.float64
        assert (empty.k == 0).all() and empty.lengths.tolist() == [0] * DB
        _, _, cache, stages = _decode(mod, _t(x), PADDED, [P] + [1] * STEPS, True)
        _, _, full_st = _full(mod, _t(x), PADDED, True)
        keep, pos = _causal_padded(PADDED)
        ref = reference.forward(sd, x, x, x, keep, num_heads=DN, num_kv_heads=DK, rope="interleaved",
                                rope_theta=THETA, positions=pos, key_positions=pos)
        assert cache.k.shape == (DB, DK, CAP, DH) and cache.v.shape == (DB, DK, CAP, DH)
        np.testing.assert_allclose(cache.k[:, :, :L].numpy(), ref.k_rot, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(cache.k[:, :, :L].numpy(), full_st.k_rot.numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(cache.v[:, :, :L].numpy(), ref.v, rtol=1e-12, atol=1e-12)
        assert (cache.k[:, :, L:] == 0).all() and (cache.v[:, :, L:] == 0).all()
        assert np.abs(ref.k_rot - ref.k).max() > 0.1  # RoPE turned the stored keys visibly
        at = 0
        for st in stages:
            T = st.k.shape[2]
            assert st.k.shape == st.v.shape == st.k_rot.shape == (DB, DK, T, DH) and st.q_rot.shape == (DB, DN, T, DH)
            np.testing.assert_allclose(st.k_rot.numpy(), ref.k_rot[:, :, at:at + T], rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(st.k.numpy(), ref.k[:, :, at:at + T], rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(st.v.numpy(), ref.v[:, :, at:at + T], rtol=1e-12, atol=1e-12)
            assert st.scores.shape == st.weights.shape == (DB, DN, T, CAP)
            at += T

    def test_positions_override(self):
        """positions= sets the new tokens' RoPE positions: shifted by 7 throughout, the decode is the one
        forward at the shifted positions; the cached keys then differ from the default's."""
        rng = np.random.default_rng(13)
        mod, _ = _decode_module(rng, DK, "half")
        x = _t(rng.standard_normal((DB, L, DE)))
        _, pos = _causal_padded(PADDED)
        shifted = torch.from_numpy(pos + 7)
        got, _, cache, _ = _decode(mod, x, PADDED, [P] + [1] * STEPS, False, positions=shifted)
        full, _, full_st = _full(mod, x, PADDED, False, offset=7)
        real = _real_rows(PADDED)
        np.testing.assert_allclose(got.numpy()[real], full.numpy()[real], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(cache.k[:, :, :L].numpy(), full_st.k_rot.numpy(), rtol=1e-12, atol=1e-12)
        _, _, default_cache, _ = _decode(mod, x, PADDED, [P] + [1] * STEPS, False)
        assert (default_cache.k[:, :, :L] - cache.k[:, :, :L]).abs().max() > 0.1
        # (T,) positions, shared by the rows: the unpadded default spelled out
        c0 = mod.init_cache(DB, CAP)
        with torch.no_grad():
            a, _, _ = mod(x[:, :P], x[:, :P], x[:, :P], cache=c0, positions=torch.arange(P))
            b, _, _ = mod(x[:, :P], x[:, :P], x[:, :P], cache=c0)
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    @pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
    def test_zero_policy_on_padding_rows(self, need_weights):
        """masked_rows="zero": a padding column's context is 0, so its output is out_proj's bias."""
        rng = np.random.default_rng(14)
        mod, _ = _decode_module(rng, DK, "half", masked_rows="zero")
        x = _t(rng.standard_normal((DB, L, DE)))
        got, _, _, _ = _decode(mod, x, PADDED, [P] + [1] * STEPS, need_weights)
        full, _, _ = _full(mod, x, PADDED, need_weights)
        real = _real_rows(PADDED)
        bias = mod.out_proj.bias.detach().numpy()
        np.testing.assert_array_equal(got.numpy()[~real], np.broadcast_to(bias, (int((~real).sum()), DE)))
        np.testing.assert_allclose(got.numpy()[real], full.numpy()[real], rtol=1e-12, atol=1e-12)

    def test_the_cache_is_immutable(self):
        """A step returns a new cache: one prefill continued twice gives the same step twice."""
        rng = np.random.default_rng(15)
        mod, _ = _decode_module(rng, DK, "half")
        x = _t(rng.standard_normal((DB, P + 1, DE)))
        _, _, prefill, _ = _decode(mod, x[:, :P], PADDED, [P], True)
        k_before = prefill.k.clone()
        xt = x[:, P:]
        with torch.no_grad():
            a, _, ca = mod(xt, xt, xt, cache=prefill)
            b, _, cb = mod(xt, xt, xt, cache=prefill)
        assert prefill.lengths.tolist() == [P] * DB and torch.equal(prefill.k, k_before)
        assert ca.lengths.tolist() == [P + 1] * DB and torch.equal(ca.k, cb.k)
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
    def test_low_precision_equals_one_forward(self, dtype, need_weights):
        """In float32 and bfloat16: the decode is the one forward of the same module in that dtype, and
        (float32) within float32's bound of the float64 oracle."""
        rng = np.random.default_rng(16)
        mod64, sd = _decode_module(rng, DK, "half")
        x64 = rng.standard_normal((DB, L, DE))
        tdtype = getattr(torch, dtype)
        mod = mod64.to(tdtype)
        x = torch.from_numpy(x64).to(tdtype)
        got, _, cache, _ = _decode(mod, x, PADDED, [P] + [1] * STEPS, need_weights)
        full, _, _ = _full(mod, x, PADDED, need_weights)
        assert got.dtype == tdtype and cache.k.dtype == tdtype
        real = _real_rows(PADDED)
        g, f = got.float().numpy()[real], full.float().numpy()[real]
        # Measured worst |decode - one forward| over seeds 0-3 x both paths, outputs up to |3.7|:
        # float32 4.8e-7 (bound 2e-6), bfloat16 1.6e-2, one bfloat16 ulp in [2, 4) (bound 6e-2).
        bound = {"float32": 2e-6, "bfloat16": 6e-2}[dtype]
        np.testing.assert_allclose(g, f, rtol=0, atol=bound)
        assert np.isnan(got.float().numpy()[~real]).all()
        if dtype == "float32":
            keep, pos = _causal_padded(PADDED)
            ref = reference.forward(sd, x64, x64, x64, keep, num_heads=DN, num_kv_heads=DK, rope="half",
                                    rope_theta=THETA, positions=pos, key_positions=pos)
            assert_close(g, ref.output[real], "float32")

    def test_no_room_is_a_value_error(self):
        mod, _ = _decode_module(np.random.default_rng(17), DK, "half")
        x = torch.zeros(DB, P, DE, dtype=torch.float64)
        cache = mod.init_cache(DB, P + 1)
        with torch.no_grad():
            _, _, cache = mod(x, x, x, cache=cache)
            with pytest.raises(ValueError, match="no room for 5 more tokens"):
                mod(x, x, x, cache=cache)
            y = x[:, :1]
            _, _, cache = mod(y, y, y, cache=cache)  # the last slot
            with pytest.raises(ValueError, match="no room for 1 more tokens"):
                mod(y, y, y, cache=cache)

    @pytest.mark.parametrize("kwargs, error, match", [
        (dict(mask=torch.ones(DB, 1, 1, dtype=torch.bool)), ValueError, "mask= with a cache"),
        (dict(key_positions=torch.zeros(1, dtype=torch.int64)), ValueError, "key_positions= with a cache"),
        (dict(positions=torch.zeros(2, dtype=torch.int64)), ValueError, r"positions must have shape \(1,\) or \(3, 1\)"),
        (dict(positions=torch.zeros(1)), TypeError, "positions must be integers"),
    ])
    def test_bad_arguments_with_a_cache_are_named(self, kwargs, error, match):
        mod, _ = _decode_module(np.random.default_rng(18), DK, "half")
        x = torch.zeros(DB, 1, DE, dtype=torch.float64)
        with pytest.raises(error, match=match):
            mod(x, x, x, cache=mod.init_cache(DB, CAP), **kwargs)

    def test_bad_caches_are_named(self):
        """Wrong dtype -> TypeError; N heads instead of K, another H or B, T != S -> ValueError."""
        from mha_torch import KVCache

        mod, _ = _decode_module(np.random.default_rng(19), DK, None)
        x = torch.zeros(DB, 1, DE, dtype=torch.float64)
        f32 = KVCache.empty(DB, CAP, DK, DH, dtype=torch.float32)
        with pytest.raises(TypeError, match="the cache holds torch.float32 but the module's parameters are torch.float64"):
            mod(x, x, x, cache=f32)
        n_heads = KVCache.empty(DB, CAP, DN, DH, dtype=torch.float64)
        with pytest.raises(ValueError, match=r"have K=4 heads of H=6; the layer has K=2"):
            mod(x, x, x, cache=n_heads)
        with pytest.raises(ValueError, match="has B=2 rows"):
            mod(x, x, x, cache=KVCache.empty(2, CAP, DK, DH, dtype=torch.float64))
        y = torch.zeros(DB, 2, DE, dtype=torch.float64)
        with pytest.raises(ValueError, match="query has T=1, key/value S=2"):
            mod(x, y, y, cache=mod.init_cache(DB, CAP))
        with pytest.raises(TypeError, match="cache must be a mha_torch.KVCache"):
            mod(x, x, x, cache=(torch.zeros(1), torch.zeros(1)))
        with pytest.raises(ValueError, match="rope=None"):
            mod(x, x, x, cache=mod.init_cache(DB, CAP), positions=torch.zeros(1, dtype=torch.int64))

    @pytest.mark.slow
    def test_compiled_step_at_two_positions(self):
        """One fullgraph-compiled step (no graph break) serves two positions without recompiling,
        and gives eager's outputs and caches (fused path, grouped heads, RoPE, left padding)."""
        from torch._dynamo.utils import counters

        rng = np.random.default_rng(20)
        mod, _ = _decode_module(rng, DK, "half")
        x = _t(rng.standard_normal((DB, P + 2, DE)))
        _, _, cache, _ = _decode(mod, x[:, :P], PADDED, [P], False)
        torch._dynamo.reset()
        counters.clear()
        step = torch.compile(mod, fullgraph=True)
        with torch.no_grad():
            c_eager, c_compiled = cache, cache
            for i in (P, P + 1):
                xt = x[:, i:i + 1]
                want, _, c_eager = mod(xt, xt, xt, cache=c_eager, need_weights=False)
                got, _, c_compiled = step(xt, xt, xt, cache=c_compiled, need_weights=False)
                real = i >= np.asarray(PADDED)
                np.testing.assert_allclose(got[:, 0].numpy()[real], want[:, 0].numpy()[real], rtol=1e-12, atol=1e-12)
                assert isinstance(c_compiled, type(c_eager))
                np.testing.assert_allclose(c_compiled.k.numpy(), c_eager.k.numpy(), rtol=1e-12, atol=1e-12)
                np.testing.assert_array_equal(c_compiled.lengths.numpy(), c_eager.lengths.numpy())
        assert counters["stats"]["unique_graphs"] == 1


# ------------------------------------------------------------- structured masks
# docs/semantics.md, "Packed sequences, sliding windows and causal alignment": is_causal, window,
# segment_ids / key_segment_ids and alignment, against the float64 oracle (reference.forward with
# the same keywords; TestMasks in tests/test_oracle.py checks its keep-mask against loops over the
# definition). Cross-attention T=5 over S=7 and T=7 over S=5, packing T=S=8; rows of 2-3 documents
# with a different layout in each row.

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


def _mask_sd(layer: str, seed: int = 0) -> dict:
    cfg = AttentionConfig(12 if layer == "classic" else 24, MASK_LAYERS[layer]["num_heads"],
                          num_kv_heads=MASK_LAYERS[layer].get("num_kv_heads"))
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape) / math.sqrt(shape[-1]) for name, shape in cfg.weight_shapes().items()}


def _mask_inputs(layer: str, T: int, S: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    E = 12 if layer == "classic" else 24
    return tuple(rng.standard_normal((3, L, E)) for L in (T, S, S))


def _tkw(kw: dict) -> dict:
    return {name: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for name, v in kw.items()}


def _mask_module(sd, layer: str, **kw):
    return convert.to_torch(sd, **MASK_LAYERS[layer], **kw)


def _judge_forward(out, exact, low, dtype):
    """float64/float32 against the exact output elementwise (the table's entry: these modules' errors at these
    sizes sit far below it), 16-bit three-way against its stored-stage yardstick `low`."""
    tol = tolerance_for(dtype)
    if low is None:
        return compare(out, exact, tol.forward)
    return compare_three_way(out, exact, low, tol.three_way_k, tol.forward.atol)


class TestMasks:
    """Each structured mask kind against the float64 oracle, on both paths, in every dtype; the
    gradients in float64; alignment; SDPA's is_causal; segment_positions; bad arguments."""

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_each_kind_matches_the_oracle_on_both_paths(self, dtype):
        dt = np_dtype(dtype)
        for name, layer, T, S, kw, mask in MASK_CASES:
            sd = cast_sd(_mask_sd(layer), dt)
            xs = [x.astype(dt) for x in _mask_inputs(layer, T, S)]
            sd64, x64 = {n: reference.as_float64(a) for n, a in sd.items()}, [reference.as_float64(x) for x in xs]
            exact = reference.forward(sd64, *x64, mask, **MASK_LAYERS[layer], **kw)
            low = reference.forward(sd, *x64, mask, dtype=dt, **MASK_LAYERS[layer], **kw) if dt.itemsize < 4 else None
            m = _mask_module(sd, layer)
            args = [convert.numpy_to_tensor(x) for x in xs] + [None if mask is None else torch.from_numpy(mask)]
            for need_weights in (True, False):
                with torch.no_grad():
                    out, w = m(*args, need_weights=need_weights, **_tkw(kw))
                c = _judge_forward(convert.tensor_to_numpy(out), exact.output, None if low is None else low.output, dtype)
                assert c.passed, (name, need_weights, c)
                if need_weights:
                    c = _judge_forward(convert.tensor_to_numpy(w), exact.weights, None if low is None else low.weights, dtype)
                    assert c.passed, (name, "weights", c)
            # the fully masked rows are the structure's: NaN exactly there under the "nan" policy
            keep = reference._combined_keep(mask, 3, 1, T, S, {k: v for k, v in kw.items() if "positions" not in k})
            assert np.array_equal(np.isnan(exact.output).any(-1), ~np.broadcast_to(keep, (3, 1, T, S)).any(-1)[:, 0])

    def test_every_gradient_matches_the_oracle_backward(self):
        """float64, the "zero" policy (fully masked rows have no gradient)."""
        for name, layer, T, S, kw, mask in MASK_CASES:
            sd = _mask_sd(layer, seed=2)
            xs = _mask_inputs(layer, T, S, seed=3)
            g = np.random.default_rng(4).standard_normal(xs[0].shape)
            ref = reference.backward(sd, *xs, mask, g, masked_rows="zero", **MASK_LAYERS[layer], **kw)
            for need_weights in (True, False):
                m = _mask_module(sd, layer, masked_rows="zero")
                tx = [torch.tensor(x, requires_grad=True) for x in xs]
                out, _ = m(*tx, None if mask is None else torch.from_numpy(mask), need_weights=need_weights, **_tkw(kw))
                (out * torch.from_numpy(g)).sum().backward()
                got = {"query": tx[0].grad, "key": tx[1].grad, "value": tx[2].grad,
                       **{n: p.grad for n, p in m.named_parameters()}}
                assert sorted(got) == sorted(ref)
                for grad_name, want in ref.items():
                    c = compare(got[grad_name].numpy(), want, tolerance_for("float64").gradient)
                    assert c.passed, (name, need_weights, grad_name, c)

    def test_the_two_alignments_differ_and_each_matches_the_oracle(self):
        sd = _mask_sd("classic")
        q, k, v = _mask_inputs("classic", 5, 7)
        outs = {}
        for alignment in ("top-left", "bottom-right"):
            ref = reference.forward(sd, q, k, v, num_heads=3, is_causal=True, alignment=alignment).output
            for need_weights in (True, False):
                out, _ = run_torch_kw(_mask_module(sd, "classic"), q, k, v, need_weights=need_weights,
                                      is_causal=True, alignment=alignment)
                assert_close(out, ref)
            outs[alignment] = out
        # top-left row 0 keeps key 0 only, bottom-right keys 0..2: every row differs
        assert (np.abs(outs["top-left"] - outs["bottom-right"]).max(axis=-1) > 1e-3).all()

    def test_fused_causal_runs_sdpa_is_causal(self, monkeypatch):
        """is_causal alone (top-left, or T = S) reaches SDPA as is_causal=True without a mask;
        bottom-right with T != S, a window or a mask= go as a dense keep-mask."""
        calls = []
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def spy(*args, **kwargs):
            calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask")))
            return sdpa(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        sd = _mask_sd("classic")
        m = _mask_module(sd, "classic")
        for T, S, kw, mask, causal in [(8, 8, dict(is_causal=True), None, True),
                                       (8, 8, dict(is_causal=True, alignment="bottom-right"), None, True),
                                       (5, 7, dict(is_causal=True), None, True),
                                       (5, 7, dict(is_causal=True, alignment="bottom-right"), None, False),
                                       (8, 8, dict(is_causal=True, window=(2, 0)), None, False),
                                       (8, 8, dict(is_causal=True), PAD, False)]:
            q, k, v = _mask_inputs("classic", T, S)
            calls.clear()
            out, _ = run_torch_kw(m, q, k, v, mask, need_weights=False, **kw)
            assert len(calls) == 1 and calls[0][0] is causal and (calls[0][1] is None) is causal, (T, S, kw)
            assert_close(out, reference.forward(sd, q, k, v, mask, num_heads=3, **kw).output)

    def test_segment_positions_equal_the_oracles(self):
        for seg in (SEG, SEG[:, ::-1], np.array([[4, 4, 1, 1, 4, 4, 4]]), np.zeros((2, 1), np.int32),
                    np.zeros((3, 0), np.int64)):
            got = segment_positions(torch.from_numpy(np.ascontiguousarray(seg)))
            assert got.dtype == torch.int64
            np.testing.assert_array_equal(got.numpy(), reference.segment_positions(seg))

    @pytest.mark.parametrize("kw, error, match", [
        (dict(window=(-1, 0)), ValueError, r"window left must be a non-negative int or None, got -1"),
        (dict(window=(1.5, None)), ValueError, r"window left must be a non-negative int or None, got 1.5"),
        (dict(window=(1, 2, 3)), TypeError, r"window must be None, an int or a \(left, right\) pair"),
        (dict(is_causal="yes"), TypeError, r"is_causal must be a bool"),
        (dict(alignment="bottom"), ValueError, r"alignment='bottom' is not one of \('top-left', 'bottom-right'\)"),
        (dict(segment_ids=np.zeros((3, 5), np.int64)), ValueError, r"with T=5 != S=7: pass key_segment_ids \(B, S\)"),
        (dict(segment_ids=np.zeros((3, 5)), key_segment_ids=np.zeros((3, 7), np.int64)), TypeError,
         r"segment_ids must be integers, got dtype torch.float64"),
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
            run_torch_kw(m, q, k, v, **kw)

    def test_with_a_cache_they_are_value_errors(self):
        m = _mask_module(_mask_sd("classic"), "classic")
        x = torch.zeros(3, 2, 12, dtype=torch.float64)
        for kw in (dict(is_causal=True), dict(window=2), dict(segment_ids=torch.zeros(3, 2, dtype=torch.int64)),
                   dict(alignment="bottom-right")):
            with pytest.raises(ValueError, match=f"{next(iter(kw))} with a cache"):
                m(x, x, x, cache=m.init_cache(3, 4), **kw)

    @pytest.mark.slow
    def test_compiled_packed_row_takes_segment_ids_as_data(self):
        """fullgraph=True (no graph break: the mask is built from shapes alone); two layouts run one
        graph (the ids are inputs, not constants); both paths match the oracle. aot_eager: the
        capture is what is checked here, inductor's code generation is not ours."""
        from torch._dynamo.utils import counters

        sd = _mask_sd("classic")
        m = _mask_module(sd, "classic")
        q, k, v = _mask_inputs("classic", 8, 8)
        torch._dynamo.reset()
        counters.clear()
        f = torch.compile(lambda seg, nw: m(*(torch.from_numpy(x) for x in (q, k, v)), segment_ids=seg, is_causal=True,
                                           window=(3, 0), need_weights=nw)[0], fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            for need_weights in (True, False):
                for seg in (SEG, SEG[::-1].copy()):
                    out = f(torch.from_numpy(seg), need_weights)
                    ref = reference.forward(sd, q, k, v, num_heads=3, segment_ids=seg, is_causal=True, window=(3, 0))
                    assert_close(out.numpy(), ref.output)
        assert counters["stats"]["unique_graphs"] == 2  # one per path, not per layout


def run_torch_kw(m, q, k, v, mask=None, *, need_weights=True, **kw):
    """run_torch with the structured keywords (NumPy arrays become tensors)."""
    with torch.no_grad():
        out, w = m(*(torch.from_numpy(x) for x in (q, k, v)), None if mask is None else torch.from_numpy(mask),
                   need_weights=need_weights, **_tkw(kw))
    return out.numpy(), None if w is None else w.numpy()
