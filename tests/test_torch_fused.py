"""The torch fused path (SDPA) against the weights path and the float64 oracle.

Masks whose key axis is 1, finite values near the dtype's largest, torch.func.vmap, and a
causal keep-mask run as SDPA's is_causal.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha_torch
import mha_torch.attention as attention
from conftest import SIZES, make_inputs
from helpers import build, cast_sd, run
from parity import reference
from parity.tolerances import compare, compare_three_way, tolerance_for

S = SIZES
POLICIES = ("nan", "zero", "uniform")


def oracle(sd, q, k, v, mask=None, masked_rows="nan", num_heads=S.N, dtype=np.float64):
    return reference.forward(sd, q, k, v, mask, num_heads=num_heads, masked_rows=masked_rows, dtype=dtype)


def assert_same_nans_and_close(got, expected, tol):
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    c = compare(got, expected, tol)
    assert c.passed, c


# ------------------------------------------------------------- masks whose key axis is 1

KEY_AXIS_1_SHAPES = [(S.T, 1), (S.B, S.T, 1), (S.B, 1, S.T, 1), (1, S.N, S.T, 1), (S.B, S.N, 1, 1), (1, 1, 1, 1)]


@pytest.mark.parametrize("shape", KEY_AXIS_1_SHAPES)
@pytest.mark.parametrize("policy", POLICIES)
def test_mask_with_key_axis_1_runs_like_the_weights_path(shape, policy, sd64, rng):
    """A query-padding mask (one flag per row, broadcast over keys), with NaN in a query and a key."""
    q, k, v = make_inputs(rng)
    q[2, 1, 0] = np.nan  # batch 2, row 1
    k[0, 3, 0] = np.nan  # batch 0, key 3: every row of batch 0 that keeps keys
    keep = rng.random(shape) > 0.5
    keep.flat[0] = keep.size > 1  # a single flag: every query attends to nothing
    keep.flat[-1] = False  # at least one query that may attend to nothing
    m = build("torch", sd64, S.N, masked_rows=policy)
    weights_out, _ = run("torch", m, q, k, v, keep, need_weights=True)
    fused_out, _ = run("torch", m, q, k, v, keep, need_weights=False)
    ref = oracle(sd64, q, k, v, keep, policy)
    tol = tolerance_for("float64").forward
    assert_same_nans_and_close(weights_out, ref.output, tol)
    assert_same_nans_and_close(fused_out, ref.output, tol)
    assert_same_nans_and_close(fused_out, weights_out, tol)
    full = np.broadcast_to(keep.reshape((1,) * (4 - keep.ndim) + shape), (S.B, S.N, S.T, S.S))
    assert not full.any(axis=-1).all()  # the policy's rows are really there


# ------------------------------------------------------------- finite values near the largest

HUGE = 3e38  # float32 and bfloat16 hold it; two of them overflow


def _identity_sd(E: int) -> dict:
    """Projections that pass inputs through unchanged: a huge finite input stays finite."""
    sd = {}
    for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
        sd[f"{p}.weight"], sd[f"{p}.bias"] = np.eye(E), np.zeros(E)
    return sd


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", POLICIES)
def test_huge_finite_values_make_no_nan(dtype, policy, rng):
    """A query row, a key row and value columns of ±3e38, with H=16 and S=16 keys.

    In exact arithmetic every output is finite: the scores are large but finite (the other
    operand is small), and the policy's row is the mean of V. Sums of these rows are not:
    partial sums reach +inf and -inf, and NaN where they meet. NaN placement must be the
    weights path's, which is the oracle's. The huge values are in keys that every row of
    their batch masks out: SDPA accumulates exp(score - max) · V before it normalises, so
    kept values above ~max/S overflow inside the kernel itself (not checked here).
    """
    B, T, S_, N, H = 2, 5, 16, 3, 16
    E = N * H
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    q, k = rng.standard_normal((B, T, E)) * 1e-3, rng.standard_normal((B, S_, E)) * 1e-3
    v = rng.standard_normal((B, S_, E))
    q[0, 2, :H] = HUGE * np.tile([1, -1], H // 2)  # batch 0, row 2, head 0
    k[1, 5, 2 * H :] = HUGE * np.tile([1, -1], H // 2)  # batch 1, key 5, head 2
    v[1, 8:, H : 2 * H] = HUGE * np.tile([1, 1, -1, -1], 2)[:, None]  # batch 1, keys 8-15, head 1
    v[1, 8:, H] *= np.linspace(0.5, 1.0, 8)  # one column with a mean far from 0
    q[1, 3, 1] = np.nan  # and one real NaN: batch 1, row 3
    keep = rng.random((B, T, S_)) > 0.4
    keep[..., 0] = keep[1, :, 5] = True
    keep[1, :, 8:] = False
    keep[1, 4] = False  # batch 1, row 4 keeps nothing: the policy's row, which reads mean(V)
    q, k, v = (x.astype(dt) for x in (q, k, v))
    sd = cast_sd(_identity_sd(E), dt)
    m = build("torch", sd, N, masked_rows=policy)
    weights_out, _ = run("torch", m, q, k, v, keep, need_weights=True)
    fused_out, _ = run("torch", m, q, k, v, keep, need_weights=False)

    x64 = [reference.as_float64(x) for x in (q, k, v)]
    exact = oracle(_identity_sd(E), *x64, keep, policy, num_heads=N).output
    expected_nan = np.zeros((B, T), bool)
    expected_nan[1, 3] = True
    if policy == "nan":
        expected_nan[1, 4] = True
    np.testing.assert_array_equal(np.isnan(exact).any(-1), expected_nan)  # the oracle agrees with the maths
    assert np.isfinite(exact[~np.isnan(exact)]).all()
    if policy == "uniform":  # the policy's row is the mean of the huge values
        assert np.abs(exact[1, 4]).max() > 1e37
    for out in (weights_out, fused_out):
        np.testing.assert_array_equal(np.isnan(out), np.isnan(exact))
        assert np.isfinite(out[~np.isnan(out)].astype(np.float64)).all()
    if dtype == "float32":
        assert_same_nans_and_close(fused_out, exact, tolerance_for(dtype).forward)
    else:
        low = oracle(sd, *x64, keep, policy, num_heads=N, dtype=dt).output
        tol = tolerance_for(dtype)
        c = compare_three_way(fused_out, exact, low, tol.three_way_k, tol.forward.atol)
        assert c.passed, c


# ------------------------------------------------------------- torch.func.vmap

# torch's notice that vmap runs the CPU SDPA kernel once per instance (no batching rule).
VMAP_SDPA_FALLBACK = "ignore:There is a performance drop because we have not yet implemented the batching rule"



@pytest.mark.filterwarnings(VMAP_SDPA_FALLBACK)
@pytest.mark.parametrize("need_weights", [True, False])
def test_vmap_with_a_float_mask(need_weights, sd64, rng):
    """vmap over a stack of (query, key, value, float keep-mask) equals one call per instance."""
    V = 2  # instances
    q, k, v = (np.stack([x, x[::-1]]) for x in make_inputs(rng))  # (V, B, L, E)
    keep = rng.random((V, S.B, S.T, S.S)) > 0.4
    keep[..., 0] = True
    keep[1, 0, 2] = False
    m = build("torch", sd64, S.N, masked_rows="uniform")
    args = [torch.from_numpy(x) for x in (q, k, v, keep.astype(np.float64))]
    with torch.no_grad():
        got = torch.func.vmap(lambda *a: m(*a, need_weights=need_weights)[0])(*args).numpy()
    for i in range(V):
        ref = oracle(sd64, q[i], k[i], v[i], keep[i], "uniform")
        c = compare(got[i], ref.output, tolerance_for("float64").forward)
        assert c.passed, (i, c)
    bad = keep.astype(np.float64)
    bad[1, 0, 0, 0] = -np.inf  # one additive entry, in the second instance only
    args[3] = torch.from_numpy(bad)
    with pytest.raises(ValueError, match="looks like an additive mask"):
        torch.func.vmap(lambda *a: m(*a, need_weights=need_weights)[0])(*args)


# ------------------------------------------------------------- causal keep-masks


def _tril(T, S_):
    return np.tril(np.ones((T, S_), bool))


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Record whether each SDPA call got is_causal (and a mask)."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((bool(kwargs.get("is_causal", False)), kwargs.get("attn_mask") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    return calls


def _causal_masks(T, S_):
    tril = _tril(T, S_)
    return {
        "[T,S] bool": torch.from_numpy(tril),
        "[1,1,T,S] bool": torch.from_numpy(tril[None, None]),
        "[T,S] float": torch.from_numpy(tril.astype(np.float64)),
        "[T,S] int": torch.from_numpy(tril.astype(np.int32)),
        "[B,T,S] expanded": torch.from_numpy(tril).expand(S.B, T, S_),
        "[B,1,T,S] copies": torch.from_numpy(np.broadcast_to(tril, (S.B, 1, T, S_)).copy()),
        "[T,S] not contiguous": torch.from_numpy(np.tril(np.ones((T, 2 * S_), bool))[:, :S_]),
    }


# (8, 7): T·S is a multiple of 8 but S is not (the comparison reads int64 words).
@pytest.mark.parametrize("T, S_", [(S.T, S.T), (S.T, S.S), (S.S, S.T), (8, S.S)])
def test_causal_mask_runs_as_is_causal(T, S_, sdpa_calls, sd64, rng):
    q = rng.standard_normal((S.B, T, S.E))
    k, v = rng.standard_normal((S.B, S_, S.E)), rng.standard_normal((S.B, S_, S.E))
    m = build("torch", sd64, S.N)
    ref = oracle(sd64, q, k, v, _tril(T, S_))
    for name, mask in _causal_masks(T, S_).items():
        sdpa_calls.clear()
        out, _ = run("torch", m, q, k, v, mask, need_weights=False)
        assert sdpa_calls == [(True, False)], name
        c = compare(out, ref.output, tolerance_for("float64").forward)
        assert c.passed, (name, c)


def test_masks_that_are_not_exactly_causal_keep_the_mask(sdpa_calls, sd64, rng):
    q, k, v = make_inputs(rng)
    tril = _tril(S.T, S.S)
    near = tril.copy()
    near[3, 4] = True  # one key beyond the diagonal
    short = tril.copy()
    short[4, 0] = False  # one key less
    per_batch = np.broadcast_to(tril, (S.B, S.T, S.S)).copy()
    per_batch[1, 2, 1] = False  # real per-batch copies, one of them not causal
    m = build("torch", sd64, S.N)
    for keep in (near, short, per_batch, ~tril, np.triu(np.ones((S.T, S.S), bool))):
        sdpa_calls.clear()
        out, _ = run("torch", m, q, k, v, keep, need_weights=False)
        assert sdpa_calls == [(False, True)]
        c = compare(out, oracle(sd64, q, k, v, keep).output, tolerance_for("float64").forward)
        assert c.passed, c


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("where", [None, "query", "key", "value"])
def test_causal_path_equals_the_mask_path(policy, where, monkeypatch, sd64, rng):
    """is_causal against the same mask given to SDPA, and the oracle: outputs, NaNs, gradients.

    With a NaN query one difference is allowed, in V's gradient: the mask path's NaN row has
    NaN weights at its masked keys too (softmax subtracts the row's max, NaN), and NaN times
    a zero cotangent is NaN there; the causal kernel never computes those entries.
    """
    T = S.S
    q, k, v = (rng.standard_normal((S.B, T, S.E)) for _ in range(3))
    if where is not None:
        {"query": q, "key": k, "value": v}[where][0, 3, 1] = np.nan  # batch 0, position 3
    keep = _tril(T, T)
    m = build("torch", sd64, S.N, masked_rows=policy)

    def fused(recognise: bool):
        if not recognise:
            monkeypatch.setattr(attention, "_is_causal", lambda *a: False)
        args = [torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v)]
        m.zero_grad()
        out, _ = m(*args, torch.from_numpy(keep), need_weights=False)
        torch.nan_to_num(out, nan=0.0).sum().backward()
        monkeypatch.undo()
        grads = dict(zip(("query", "key", "value"), (a.grad.numpy() for a in args)))
        grads.update({name: p.grad.numpy().copy() for name, p in m.named_parameters()})
        return out.detach().numpy(), grads

    out_causal, grads_causal = fused(True)
    out_mask, grads_mask = fused(False)
    ref = oracle(sd64, q, k, v, keep, policy).output
    expected_nan = np.zeros((S.B, T), bool)  # a NaN query: its row; a NaN key: rows that keep it
    if where is not None:
        expected_nan[0, {"query": slice(3, 4), "key": slice(3, None), "value": slice(None)}[where]] = True
    np.testing.assert_array_equal(np.isnan(ref).any(-1), expected_nan)
    tol = tolerance_for("float64")
    assert_same_nans_and_close(out_causal, ref, tol.forward)
    assert_same_nans_and_close(out_causal, out_mask, tol.forward)
    for name, g in grads_causal.items():
        if where == "query" and name == "value":
            masked_keys = (slice(0, 1), slice(4, None))  # batch 0, keys after the NaN row's last
            assert np.isnan(grads_mask[name][masked_keys]).all() and np.isfinite(g[masked_keys]).all()
            g, expected = g.copy(), grads_mask[name].copy()
            g[masked_keys] = expected[masked_keys] = 0.0
            assert_same_nans_and_close(g, expected, tol.gradient)
        else:
            assert_same_nans_and_close(g, grads_mask[name], tol.gradient)
    if where is None:  # and the true gradients
        ref_grads = reference.backward(sd64, q, k, v, keep, np.ones_like(q), num_heads=S.N, masked_rows=policy)
        for name, g in grads_causal.items():
            c = compare(g, ref_grads[name], tol.gradient)
            assert c.passed, (name, c)


@pytest.mark.filterwarnings(VMAP_SDPA_FALLBACK)
def test_causal_mask_under_vmap(sdpa_calls, sd64, rng):
    """A causal mask shared by every vmapped instance is recognised; a batched one is not looked into."""
    q, k, v = (np.stack([x, 2 * x]) for x in make_inputs(rng, S.__class__(S=S.T)))
    tril = _tril(S.T, S.T)
    m = build("torch", sd64, S.N)
    args = [torch.from_numpy(x) for x in (q, k, v)]
    with torch.no_grad():
        shared = torch.func.vmap(lambda a, b, c: m(a, b, c, torch.from_numpy(tril), need_weights=False)[0])(*args)
        assert sdpa_calls == [(True, False)]
        batched = torch.func.vmap(lambda a, b, c, mk: m(a, b, c, mk, need_weights=False)[0])(
            *args, torch.from_numpy(np.stack([tril, tril]))
        )
        assert sdpa_calls[1:] == [(False, True)]
    for i in range(2):
        ref = oracle(sd64, q[i], k[i], v[i], tril).output
        for got in (shared, batched):
            c = compare(got[i].numpy(), ref, tolerance_for("float64").forward)
            assert c.passed, c


def test_causal_recognition_is_exact(rng):
    """Recognised exactly when every (T, S) copy equals tril(ones(T, S)), over layouts and sizes."""
    seen = {True: 0, False: 0}
    for T, S_ in [(1, 1), (1, 3), (3, 1), (5, 7), (7, 5), (8, 7), (8, 8), (16, 16), (9, 24)]:
        tril = np.tril(np.ones((T, S_), bool))
        for lead in [(), (1, 1), (3, 1), (3, 2)]:
            for flip in (False, True):
                keep = np.broadcast_to(tril, lead + (T, S_)).copy()
                if flip:  # one entry of one copy
                    keep[tuple(rng.integers(0, n) for n in keep.shape)] ^= True
                layouts = {
                    "contiguous": torch.from_numpy(keep),
                    "transposed twice": torch.from_numpy(keep).transpose(-1, -2).contiguous().transpose(-1, -2),
                    "sliced": torch.from_numpy(np.concatenate([keep, keep], axis=-1))[..., :S_],
                }
                expected = bool(np.all(keep == tril))
                for name, t in layouts.items():
                    assert attention._is_causal(t, T, S_) == expected, (T, S_, lead, flip, name)
                seen[expected] += 1
    assert min(seen.values()) > 10


@pytest.mark.parametrize("T", [1, S.T])
@pytest.mark.parametrize("policy", POLICIES)
def test_one_key_head_runs_its_query_heads_as_rows_of_that_head(T, policy, monkeypatch, rng):
    """One key/value head (multi-query; MLA's absorbed form) and a mask alike for every query: SDPA gets one head
    of N·T query rows instead of enable_gqa (whose CPU path copies K and V per query head), with the numbers of
    the materialised core given K and V per head, fully masked rows and every policy included."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((tuple(q.shape), bool(kwargs.get("enable_gqa", False))))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    H = 4
    q = torch.from_numpy(rng.standard_normal((S.B, S.N, T, H)))
    k, v = (torch.from_numpy(rng.standard_normal((S.B, 1, S.S, H))) for _ in range(2))
    keep = torch.from_numpy(rng.random((S.B, 1, 1, S.S)) < 0.6)
    keep[1] = False  # batch row 1 keeps no key: the policy's rows
    out = attention.fused_attention_core(q, k, v, keep, masked_rows=policy)
    assert seen == [((S.B, 1, S.N * T, H), False)]
    want, _ = attention.attention_core(q, k.expand(-1, S.N, -1, -1), v.expand(-1, S.N, -1, -1), keep, masked_rows=policy)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert out.isnan().any() == (policy == "nan")
