"""The chunked kernel (online softmax, flash backward, block skipping) and the fused path that runs it.

Gradients are judged against the oracle's hand-derived float64 backward through the real
module, with the fused path forced onto the chunked kernel with blocks (2, 3): several
blocks on both axes and ragged tails (T=5, S=7 pad to 6 and 9), and masks that leave whole
blocks empty (skipped) and whole rows fully masked."""

from __future__ import annotations

from functools import partial

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mha_jax.chunked as chunked
import mha_jax.kernels as kernels
from conftest import SIZES as S
from conftest import make_inputs, make_state_dict, random_keep_mask
from helpers import build, cast_sd, np_dtype, run
from mha_jax import attention_core, chunked_attention, fused_attention_core
from mha_spec import Structure
from parity import reference
from parity.tolerances import compare, compare_three_way, tolerance_for

POLICIES = ("nan", "zero", "uniform")


def _mask(kind: str, rng):
    """Keep-masks of every accepted shape, for (B, T, S) = (3, 5, 7) and blocks (2, 3).

    "causal", "padding" and "holes" leave whole blocks empty (the kernel skips them) and
    whole rows fully masked; all but "none"/"heads"/"keys" have a fully masked row."""
    if kind == "none":
        return None
    if kind == "2d":  # [T, S]
        return random_keep_mask(rng, (S.T, S.S), fully_masked_row=(0, 2))
    if kind == "3d":  # [B, T, S]
        return random_keep_mask(rng, (S.B, S.T, S.S), fully_masked_row=(1, 4))
    if kind == "heads":  # [B, N, T, S], a different mask per head
        return rng.random((S.B, S.N, S.T, S.S)) > 0.3
    if kind == "keys":  # [B, 1, 1, S]: key padding, broadcast over heads and queries
        keep = np.ones((S.B, 1, 1, S.S), bool)
        keep[0, ..., 4:] = False
        return keep
    if kind == "queries":  # [1, 1, T, 1]: query 3 sees nothing, the others everything
        keep = np.ones((1, 1, S.T, 1), bool)
        keep[..., 3, :] = False
        return keep
    if kind == "causal":  # query t sees keys s <= t - 1: row 0 sees nothing
        return np.arange(S.S)[None, :] <= np.arange(S.T)[:, None] - 1
    if kind == "padding":  # key lengths 5, 0, 6: batch 1 sees nothing, key block 2 (keys 6..8) is empty
        return (np.arange(S.S)[None, :] < np.array([5, 0, 6])[:, None])[:, None, None, :]
    if kind == "holes":  # random, with block (0, 1) (queries 0-1, keys 3-5) empty in every batch
        keep = random_keep_mask(rng, (S.B, S.T, S.S), fully_masked_row=(1, 4))
        keep[:, 0:2, 3:6] = False
        return keep
    raise ValueError(kind)


def _expected_kinds(keep, T: int, Sk: int, cq: int, ck: int) -> np.ndarray:
    """Block kinds by looping over the blocks of the broadcast, padded mask: padded keys are never
    kept, padded queries are masked unless the mask has no query axis (then it holds for them too)."""
    k4 = keep.reshape((1,) * (4 - keep.ndim) + keep.shape)
    Tp, Sp = -(-T // cq) * cq, -(-Sk // ck) * ck
    rows = Tp if k4.shape[2] == 1 else T
    full = np.zeros((S.B, S.N, Tp, Sp), bool)
    full[:, :, :rows, :Sk] = np.broadcast_to(k4, (S.B, S.N, rows, Sk))
    kinds = np.empty((Tp // cq, Sp // ck), int)
    for i in range(kinds.shape[0]):
        for j in range(kinds.shape[1]):
            block = full[:, :, i * cq:(i + 1) * cq, j * ck:(j + 1) * ck]
            kinds[i, j] = chunked.FULL if block.all() else chunked.PARTIAL if block.any() else chunked.EMPTY
    return kinds


@pytest.mark.parametrize("kind", ["causal", "padding", "holes"])
def test_block_kinds_find_the_empty_blocks(kind, rng):
    keep = _mask(kind, rng)
    k4 = jnp.asarray(keep.reshape((1,) * (4 - keep.ndim) + keep.shape))
    padded = chunked._pad_keep(k4, S.S, 6, 9)
    plan = chunked._Plan(S=S.S, cq=2, ck=3, scale=1.0, precision=None)
    got = np.asarray(chunked._block_kinds(plan, padded, 3, 3))  # (1, 3) when the mask has no query axis
    want = _expected_kinds(keep, S.T, S.S, 2, 3)
    np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)
    assert (want == chunked.EMPTY).any()  # these masks exercise the skip


def test_a_skipped_block_never_reads_its_values():
    """An empty block's matmuls do not run: a NaN value there reaches no query of that block
    (the materialised path's 0 x NaN reaches every row), and rows that keep the key get NaN."""
    T = 6
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, T, 1, 4))) for _ in range(3))
    v = v.at[0, 5].set(jnp.nan)  # the last key's value
    keep = jnp.asarray(np.tril(np.ones((T, T), bool)))[None, None]  # causal: blocks (0, 2), (1, 2) are empty
    got = np.asarray(chunked_attention(q, k, v, keep, q_chunk=2, k_chunk=2))
    assert np.isfinite(got[0, :4]).all() and np.isnan(got[0, 5]).all()
    assert np.isnan(np.asarray(attention_core(q, k, v, keep)[0])).all()  # the check can fail


@pytest.fixture
def force_kernel(monkeypatch):
    """Make fused_attention_core run one kernel, e.g. force_kernel("chunked", 2, 3)."""

    def force(kernel, q_chunk=None, k_chunk=None, head_chunk=None):
        monkeypatch.setattr(kernels, "choose", lambda **kw: kernels.Choice(kernel, q_chunk, k_chunk, "forced by a test",
                                                                          head_chunk=head_chunk))

    return force


def _module_fused(m, q, k, v, keep, g):
    """(output, gradients of sum(output * g) w.r.t. the parameters and the three inputs) on the
    fused path, as NumPy in the oracle's names; one jitted program (compiling beats eager here)."""
    mask = None if keep is None else jnp.asarray(keep)

    def loss(m, q, k, v):
        out = m(q, k, v, mask, need_weights=False)[0]
        return jnp.sum(out * g), out

    step = nnx.jit(nnx.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (gm, gq, gk, gv), out = step(m, *(jnp.asarray(x) for x in (q, k, v)))
    got = {"query": gq, "key": gk, "value": gv}
    for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
        got[f"{p}.weight"] = np.asarray(getattr(gm, p).kernel[...]).T
        got[f"{p}.bias"] = getattr(gm, p).bias[...]
    return np.asarray(out), {n: np.asarray(x) for n, x in got.items()}


CASES = [(m, "nan", (2, 3)) for m in ("none", "2d", "3d", "heads", "keys", "queries")]
CASES += [(m, p, (2, 3)) for m in ("causal", "padding", "holes") for p in POLICIES]  # skipped blocks, every policy
CASES += [("3d", "nan", (8, 8)), ("causal", "uniform", (8, 8))]  # one block on both axes
# Head steps (B·K = 9 head blocks): one at a time, or one batch element's 3 heads; per-head and
# per-batch masks, a batch element that keeps nothing ("padding"), skipped blocks.
CASES += [("heads", "nan", (2, 3, 1)), ("padding", "uniform", (2, 3, 1)), ("holes", "nan", (2, 3, 3)),
          ("3d", "zero", (8, 8, 1))]


@pytest.mark.parametrize(("mask_kind", "policy", "blocks"), CASES)
def test_float64_forward_and_all_gradients_match_the_oracle(mask_kind, policy, blocks, force_kernel, sd64, rng):
    force_kernel("chunked", *blocks)
    q, k, v = make_inputs(rng)
    keep = _mask(mask_kind, rng)
    g = rng.standard_normal((S.B, S.T, S.E))
    m = build("jax", sd64, S.N, masked_rows=policy)
    out, got = _module_fused(m, q, k, v, keep, g)
    tol = tolerance_for("float64")
    c = compare(out, reference.forward(sd64, q, k, v, keep, num_heads=S.N, masked_rows=policy).output, tol.forward)
    assert c.passed, c
    ref = reference.backward(sd64, q, k, v, keep, g, num_heads=S.N, masked_rows=policy)
    assert len(ref) == 11
    for name, expected in ref.items():
        c = compare(got[name], expected, tol.gradient)  # NaNs required at the oracle's places
        assert c.passed, (name, c)
    if policy == "nan" and mask_kind in ("2d", "3d", "queries", "causal", "padding", "holes"):  # the NaN check above can fail
        assert np.isnan(ref["value"]).any() and not np.isnan(ref["query"]).all()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mask_kind", ["none", "random", "causal"])
def test_kernel_matches_the_materialised_core(policy, mask_kind, rng):
    """Kernel level, long ragged axes (T=37, S=29, blocks 8 x 5): forward within the float64 table."""
    B, T, Sk, N, H = 2, 37, 29, 3, 4
    q, k, v = (rng.standard_normal(s) for s in ((B, T, N, H), (B, Sk, N, H), (B, Sk, N, H)))
    keep = None
    if mask_kind == "random":
        keep = random_keep_mask(rng, (B, 1, T, Sk), fully_masked_row=(1, 30))
    elif mask_kind == "causal":  # query t sees keys s <= t - 3: rows 0..2 see nothing
        keep = (np.arange(Sk)[None, :] <= np.arange(T)[:, None] - 3)[None, None]
    expected, _ = attention_core(q, k, v, keep, masked_rows=policy)
    got = chunked_attention(q, k, v, keep, masked_rows=policy, q_chunk=8, k_chunk=5)
    c = compare(np.asarray(got), np.asarray(expected), tolerance_for("float64").forward)
    assert c.passed, c
    if keep is not None and policy == "nan":
        assert np.isnan(np.asarray(got)).any()


@pytest.mark.parametrize("policy", POLICIES)
def test_nan_gradients_sit_where_the_materialised_path_puts_them(policy, rng):
    """Kernel level: d(q, k, v) of the chunked kernel vs jax.grad of the materialised core."""
    B, T, Sk, N, H = 2, 5, 7, 3, 4
    q, k, v = (rng.standard_normal(s) for s in ((B, T, N, H), (B, Sk, N, H), (B, Sk, N, H)))
    keep = jnp.asarray(random_keep_mask(rng, (B, 1, T, Sk), fully_masked_row=(1, 2)))
    ct = rng.standard_normal((B, T, N, H))

    def grads(f):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * ct), argnums=(0, 1, 2)))(q, k, v)

    want = grads(lambda q, k, v: attention_core(q, k, v, keep, masked_rows=policy)[0])
    got = grads(lambda q, k, v: chunked_attention(q, k, v, keep, masked_rows=policy, q_chunk=2, k_chunk=3))
    for name, a, e in zip("qkv", got, want):
        c = compare(np.asarray(a), np.asarray(e), tolerance_for("float64").gradient)
        assert c.passed, (name, c)
    assert np.isnan(np.asarray(want[2])).any() == (policy == "nan")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_low_precision_close_to_the_plain_core(dtype, rng):
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    q, k, v = (rng.standard_normal(s).astype(dt) for s in ((2, 37, 3, 4), (2, 29, 3, 4), (2, 29, 3, 4)))
    exact, _ = attention_core(*(x.astype(np.float64) for x in (q, k, v)))
    got = chunked_attention(q, k, v, q_chunk=8, k_chunk=5)
    plain, _ = attention_core(q, k, v)
    assert got.dtype == dt
    err_chunked = np.abs(np.asarray(got, np.float64) - np.asarray(exact)).max()
    err_plain = np.abs(np.asarray(plain, np.float64) - np.asarray(exact)).max()
    # Same accumulation dtype, different summation order: within 2x of the plain path's
    # error plus a few units of the dtype's rounding (measured: ratio ~1 in float32 and bfloat16).
    eps = float(jnp.finfo(dt).eps)
    assert err_chunked <= 2 * err_plain + 4 * eps, (err_chunked, err_plain)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_within_the_three_way_bound(dtype, force_kernel, rng):
    """Forward and every gradient within k x the oracle's own error in that dtype (large logits)."""
    force_kernel("chunked", 2, 3)
    dt = np_dtype(dtype)
    sd = cast_sd(make_state_dict(rng, S.E, scale=1.5), dt)
    q, k, v = (x.astype(dt) for x in make_inputs(rng))
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    g = rng.standard_normal((S.B, S.T, S.E)).astype(dt)
    m = build("jax", sd, S.N, masked_rows="zero")
    sd64, x64, g64 = {n: reference.as_float64(a) for n, a in sd.items()}, [reference.as_float64(x) for x in (q, k, v)], reference.as_float64(g)
    kw = {"num_heads": S.N, "masked_rows": "zero"}
    tol = tolerance_for(dt)
    out, got = _module_fused(m, q, k, v, keep, jnp.asarray(g))
    exact, low = reference.forward(sd64, *x64, keep, **kw), reference.forward(sd, *x64, keep, dtype=dt, **kw)
    c = compare_three_way(np.asarray(out), exact.output, low.output, tol.three_way_k, tol.forward.atol)
    assert c.passed, c
    exact_g, low_g = reference.backward(sd64, *x64, keep, g64, **kw), reference.backward(sd, *x64, keep, g64, dtype=dt, **kw)
    for name in exact_g:
        c = compare_three_way(got[name], exact_g[name], low_g[name], tol.three_way_k, tol.gradient.atol)
        assert c.passed, (name, c)


def test_module_fused_path_matches_the_oracle_above_the_memory_guard(rng, monkeypatch):
    """With the guard at 0 the module's own choice (not a forced one) runs the chunked kernel."""
    monkeypatch.setattr(kernels, "MATERIALIZE_LIMIT", 0)
    B, T, Sk, N, H = 2, 37, 29, 3, 4
    E = N * H
    assert kernels.fused_choice(B, N, T, Sk, H, jnp.float64, has_mask=True).kernel == "chunked"
    sd = make_state_dict(rng, E)
    x_q, x_k, x_v = rng.standard_normal((B, T, E)), rng.standard_normal((B, Sk, E)), rng.standard_normal((B, Sk, E))
    keep = random_keep_mask(rng, (B, T, Sk), fully_masked_row=(0, 4))
    g = rng.standard_normal((B, T, E))
    m = build("jax", sd, N, masked_rows="uniform")
    out, _ = run("jax", m, x_q, x_k, x_v, keep, need_weights=False)
    ref = reference.forward(sd, x_q, x_k, x_v, keep, num_heads=N, masked_rows="uniform")
    assert compare(out, ref.output, tolerance_for("float64").forward).passed
    grads = jax.grad(lambda a, b, c: jnp.sum(m(a, b, c, keep, need_weights=False)[0] * g), argnums=(0, 1, 2))(x_q, x_k, x_v)
    ref_g = reference.backward(sd, x_q, x_k, x_v, keep, g, num_heads=N, masked_rows="uniform")
    for name, got in zip(("query", "key", "value"), grads):
        c = compare(np.asarray(got), ref_g[name], tolerance_for("float64").gradient)
        assert c.passed, (name, c)


def _small(rng, B=2, T=5, Sk=7, N=3, H=4):
    return tuple(jnp.asarray(rng.standard_normal(s)) for s in ((B, T, N, H), (B, Sk, N, H), (B, Sk, N, H)))


def test_under_jit_and_vmap(rng):
    """jax.jit and jax.vmap of the flash gradient agree with the materialised core's gradient."""
    q, k, v = _small(rng)
    keep = jnp.asarray(random_keep_mask(rng, (2, 1, 5, 7), fully_masked_row=(0, 1)))

    def grad_of(core):
        return jax.grad(lambda q, k, v: jnp.sum(core(q, k, v) ** 2), argnums=(0, 1, 2))

    flash = grad_of(lambda q, k, v: chunked_attention(q, k, v, keep, masked_rows="uniform", q_chunk=2, k_chunk=3))
    plain = jax.jit(grad_of(lambda q, k, v: attention_core(q, k, v, keep, masked_rows="uniform")[0]))
    # vmap over a leading axis of 2 copies (the second scaled), against the plain core one at a time
    stack = [jnp.stack([x, 0.5 * x]) for x in (q, k, v)]
    mapped = jax.jit(jax.vmap(flash))(*stack)
    jitted = jax.jit(flash)(q, k, v)
    tol = tolerance_for("float64").gradient
    for j, s in enumerate((1.0, 0.5)):
        want = plain(q * s, k * s, v * s)
        for i in range(3):
            assert compare(np.asarray(mapped[i][j]), np.asarray(want[i]), tol).passed, (i, j)
            if j == 0:
                assert compare(np.asarray(jitted[i]), np.asarray(want[i]), tol).passed, i


@pytest.mark.parametrize("mode", ["jvp", "linearize"])
def test_forward_mode_is_a_clear_error(mode, rng):
    """A custom VJP has no forward-mode rule; JAX's TypeError says so (documented in chunked.py)."""
    q, k, v = _small(rng)

    def f(q):
        return chunked_attention(q, k, v, q_chunk=2, k_chunk=3)

    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        if mode == "jvp":
            jax.jvp(f, (q,), (q,))
        else:  # linearize traces the primal; applying the linear map raises
            _, f_jvp = jax.linearize(f, q)
            f_jvp(q)


def test_hessian_forward_over_reverse_works(rng):
    """jax.hessian differentiates the backward (plain JAX) forward-mode: it works and is right."""
    q, k, v = (jnp.asarray(rng.standard_normal(s)) for s in ((1, 3, 1, 2), (1, 4, 1, 2), (1, 4, 1, 2)))
    got = jax.hessian(lambda q: jnp.sum(chunked_attention(q, k, v, q_chunk=2, k_chunk=3) ** 2))(q)
    want = jax.hessian(lambda q: jnp.sum(attention_core(q, k, v)[0] ** 2))(q)
    assert compare(np.asarray(got), np.asarray(want), tolerance_for("float64").gradient).passed


@pytest.mark.parametrize("kernel", ["einsum", "chunked", "dpa-xla"])
@pytest.mark.parametrize("policy", POLICIES)
def test_nan_input_gives_nan_output_like_the_materialised_path(kernel, policy, force_kernel, rng):
    """NaN in one query row and one key: NaN exactly where attention_core puts it; batch 1 stays finite."""
    force_kernel(kernel, 2, 3)
    dtype = jnp.float32 if kernel == "dpa-xla" else jnp.float64
    q, k, v = (x.astype(dtype) for x in _small(rng))
    q = q.at[0, 1].set(jnp.nan)  # batch 0, query 1 (a row that attends)
    k = k.at[0, 5].set(jnp.nan)  # batch 0, key 5: every row of batch 0 that keeps it
    keep = np.ones((2, 1, 5, 7), bool)
    keep[0, :, 3, :] = False  # batch 0, query 3 attends to nothing: the policy, not NaN
    keep[0, :, 4, 5] = False  # batch 0, query 4 drops the NaN key: finite
    keep = jnp.asarray(keep)
    got = np.asarray(fused_attention_core(q, k, v, keep, masked_rows=policy))
    want = np.asarray(attention_core(q, k, v, keep, masked_rows=policy)[0])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[0, 1]).all() and np.isnan(got[0, 0]).all()  # the check can fail
    assert np.isfinite(got[0, 4]).all() and np.isfinite(got[1]).all()
    assert np.isnan(got[0, 3]).all() == (policy == "nan")


def test_nan_input_module_fused_equals_weights_path(force_kernel, sd64, rng):
    force_kernel("chunked", 2, 3)
    q, k, v = make_inputs(rng)
    q[1, 2, 0] = np.nan
    m = build("jax", sd64, S.N, masked_rows="zero")
    fused, _ = m(*(jnp.asarray(x) for x in (q, k, v)), need_weights=False)
    plain, _ = m(*(jnp.asarray(x) for x in (q, k, v)))
    np.testing.assert_array_equal(np.isnan(np.asarray(fused)), np.isnan(np.asarray(plain)))
    assert np.isnan(np.asarray(fused)[1, 2]).all() and np.isfinite(np.asarray(fused)[[0, 2]]).all()


def test_zero_length_queries_and_keys(rng):
    q, k, v = _small(rng)
    empty = chunked_attention(q[:, :0], k, v, q_chunk=2, k_chunk=3)
    assert empty.shape == (2, 0, 3, 4) and empty.dtype == q.dtype
    d_k = jax.grad(lambda k: chunked_attention(q[:, :0], k, v).sum())(k)
    assert np.array_equal(np.asarray(d_k), np.zeros(k.shape))
    with pytest.raises(ValueError, match="S=0"):
        chunked_attention(q, k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match="S=0"):
        fused_attention_core(q, k[:, :0], v[:, :0])


def _largest_intermediate(jaxpr) -> int:
    """The largest element count of any value produced anywhere in a jaxpr, sub-jaxprs included."""
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            biggest = max(biggest, int(np.prod(var.aval.shape)) if var.aval.shape else 1)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            biggest = max(biggest, _largest_intermediate(sub))
    return biggest


@pytest.mark.parametrize("with_grad", [False, True])
def test_never_builds_the_score_tensor(with_grad):
    Bq, L, Nh, Hd = 1, 256, 2, 4
    q = jnp.zeros((Bq, L, Nh, Hd))

    def f(q):
        return chunked_attention(q, q, q, q_chunk=32, k_chunk=64).sum()

    fn = jax.grad(f) if with_grad else f
    biggest = _largest_intermediate(jax.make_jaxpr(fn)(q).jaxpr)
    assert biggest < Bq * Nh * L * L // 4, biggest  # far below the (B, N, T, S) = 131072 elements
    # and the check can fail: the materialised core does build it
    plain = jax.make_jaxpr(lambda q: attention_core(q, q, q)[0].sum())(q).jaxpr
    assert _largest_intermediate(plain) >= Bq * Nh * L * L


@pytest.fixture
def matmul_counter(monkeypatch):
    """A list that grows by one each time a block's Q·Kᵀ runs (at run time, through a debug
    callback in `_block_scores`, which every non-EMPTY branch calls and the EMPTY branch does not).
    The compiled kernel is cleared before and after, so no program traced without the callback is
    reused and none with it outlives the test."""
    calls = []
    original = chunked._block_scores

    def counted(plan, qi, kj, mask_ij):
        jax.debug.callback(lambda: calls.append(1))
        return original(plan, qi, kj, mask_ij)

    chunked._chunked.clear_cache()
    monkeypatch.setattr(chunked, "_block_scores", counted)
    yield calls
    monkeypatch.undo()
    chunked._chunked.clear_cache()


class TestBlockSkipping:
    """The blocks a causal sliding window or packed causal documents rule out are EMPTY, and an EMPTY
    block runs no matmul: `block_census` (the kernel's own summary) against counts derived here by hand
    from block indices, the matmuls that run counted at run time, and the kernel's output and gradients
    with those masks against the materialised core."""

    T, W, C, D = 256, 32, 32, 4  # sequence, window (keys, itself included), block, documents per row

    @staticmethod
    def window_keep(T, w):
        """Mistral's sliding window of w keys: is_causal with window (w - 1, 0), (1, 1, T, T)."""
        return reference.structured_keep(T, T, is_causal=True, window=(w - 1, 0))

    @staticmethod
    def packed_keep(T, D):
        """D equal causal documents in one row, (1, 1, T, T)."""
        seg = np.repeat(np.arange(D), T // D)[None]  # (1, T)
        return reference.structured_keep(T, T, is_causal=True, segment_ids=seg)

    def test_a_sliding_window_leaves_the_diagonal_and_the_block_below_it(self):
        # Blocks of c = w rows and keys: query block i (rows ci .. ci+c-1) keeps keys t-w+1 .. t. Key block
        # i (the diagonal) holds s = t: PARTIAL (the keys above it are masked). Key block i-1: row ci keeps
        # s = ci-w+1 .. ci-1, inside it, but row ci+c-1 drops its first key: PARTIAL. Key block i-2: its last
        # key ci-w-1 < ci-w+1, the first key any row keeps: EMPTY, as every block further left and every
        # block above the diagonal. So n diagonal blocks + (n - 1) below, none FULL.
        n = self.T // self.C
        got = chunked.block_census(self.window_keep(self.T, self.W), 1, 2, self.T, self.T, self.C, self.C)
        assert got == {"empty": n * n - (2 * n - 1), "full": 0, "partial": 2 * n - 1}

    def test_a_sliding_window_with_half_sized_blocks_has_full_blocks_too(self):
        # c = w/2: key block i-1 is FULL (the largest t - s in it is (ci + c - 1) - (ci - c) = w - 1: kept);
        # key block i-2 is PARTIAL (row ci keeps s >= ci - w + 1 = c(i-2) + 1, row ci+c-1 none of it);
        # key block i-3 ends at ci - w - 1: EMPTY. Rows i = 0, 1 lack the blocks left of column 0.
        c = self.W // 2
        n = self.T // c
        got = chunked.block_census(self.window_keep(self.T, self.W), 1, 2, self.T, self.T, c, c)
        assert got == {"empty": n * n - (3 * n - 3), "full": n - 1, "partial": n + (n - 2)}

    def test_packed_causal_documents_leave_the_blocks_of_each_document_on_or_below_its_diagonal(self):
        # Documents of L = T/D = 64 tokens, m = L/c = 2 blocks each, aligned to the blocks. Within a
        # document: the m diagonal blocks PARTIAL (causal), the m(m-1)/2 below FULL; every block that
        # mixes two documents, or lies above a diagonal, EMPTY.
        n, m = self.T // self.C, self.T // self.D // self.C
        got = chunked.block_census(self.packed_keep(self.T, self.D), 1, 2, self.T, self.T, self.C, self.C)
        full, partial = self.D * m * (m - 1) // 2, self.D * m
        assert got == {"empty": n * n - full - partial, "full": full, "partial": partial}

    def test_a_block_is_empty_only_where_every_batch_row_keeps_nothing(self):
        # Row 0 packs 4 documents (2 blocks each), row 1 two (4 blocks each). Row 0's non-empty blocks lie
        # inside row 1's, so the union is row 1's: 2 documents x (4 + 3 + 2 + 1) = 20 blocks. FULL needs
        # FULL in both rows: row 0's 4 (its below-diagonal block per document, FULL in row 1 too).
        seg = np.stack([np.repeat(np.arange(4), 64), np.repeat(np.arange(2), 128)])  # (2, T)
        keep = reference.structured_keep(self.T, self.T, is_causal=True, segment_ids=seg)  # (2, 1, T, T)
        got = chunked.block_census(keep, 2, 2, self.T, self.T, self.C, self.C)
        assert got == {"empty": 64 - 20, "full": 4, "partial": 20 - 4}

    def test_grouped_heads_stack_their_rows_so_the_count_is_per_group(self):
        # N = 4 query heads on K = 2 key/value heads: G = 2 copies of the T rows stacked per key/value head,
        # each aligned to the blocks (T is a multiple of c): twice the ungrouped grid's blocks of each kind.
        keep = self.window_keep(self.T, self.W)
        one = chunked.block_census(keep, 1, 2, self.T, self.T, self.C, self.C)
        assert chunked.block_census(keep, 1, 4, self.T, self.T, self.C, self.C, kv_heads=2) == {
            k: 2 * v for k, v in one.items()}

    def test_the_non_empty_fraction_shrinks_as_w_over_t(self):
        # n = T/c blocks per axis with c = w: 2n - 1 of n² blocks run, about 2·w/T, halving as T doubles.
        fractions = []
        for T in (256, 512, 1024):
            got = chunked.block_census(self.window_keep(T, self.W), 1, 1, T, T, self.C, self.C)
            fractions.append((got["full"] + got["partial"]) / sum(got.values()))
            assert self.W / T <= fractions[-1] <= 2 * self.W / T, (T, got)
        assert fractions[0] > 1.9 * fractions[1] > 1.9 * 1.9 * fractions[2]
        # and without a mask nothing is skipped; a ragged key tail is the one PARTIAL column
        assert chunked.block_census(None, 1, 1, 256, 256, 32, 32) == {"empty": 0, "full": 64, "partial": 0}
        assert chunked.block_census(None, 1, 1, 256, 250, 32, 32) == {"empty": 0, "full": 56, "partial": 8}

    def test_census_checks_its_arguments(self):
        with pytest.raises(ValueError, match="kv_heads must divide N=4"):
            chunked.block_census(None, 1, 4, 8, 8, 4, 4, kv_heads=3)
        with pytest.raises(ValueError, match="q_chunk must be a positive int"):
            chunked.block_census(None, 1, 4, 8, 8, 0, 4)
        with pytest.raises(ValueError, match=r"\(9, 8\)"):  # keep_4d names the shapes
            chunked.block_census(np.ones((9, 8), bool), 1, 4, 8, 8, 4, 4)
        assert chunked.block_census(None, 1, 4, 0, 8, 4, 4) == {"empty": 0, "full": 0, "partial": 0}

    @pytest.mark.parametrize("mask", ["window", "packed", "window as structure"])
    def test_only_the_non_empty_blocks_run_their_matmuls(self, mask, matmul_counter, rng):
        keep = self.window_keep(self.T, self.W) if mask.startswith("window") else self.packed_keep(self.T, self.D)
        census = chunked.block_census(keep, 1, 2, self.T, self.T, self.C, self.C)
        running = census["full"] + census["partial"]
        # The structure (no keep-mask) is the window's: the same blocks run.
        given = dict(is_causal=True, window=(self.W - 1, 0)) if mask == "window as structure" else dict(keep=keep)
        q, k, v = (jnp.asarray(rng.standard_normal((1, self.T, 2, 8)), jnp.float32) for _ in range(3))
        chunked_attention(q, k, v, q_chunk=self.C, k_chunk=self.C, **given).block_until_ready()
        jax.effects_barrier()
        assert len(matmul_counter) == running < sum(census.values())  # one Q·Kᵀ per non-empty block
        matmul_counter.clear()
        jax.grad(lambda q: chunked_attention(q, k, v, q_chunk=self.C, k_chunk=self.C, **given).sum())(q).block_until_ready()
        jax.effects_barrier()
        assert len(matmul_counter) == 2 * running  # the forward's, and the backward's recomputed P

    @pytest.mark.parametrize("mask", ["window", "packed"])
    def test_output_and_gradients_equal_the_materialised_core(self, mask, rng):
        """float32 kernel and float32 einsum core each within the float32 table of the float64 core;
        every row keeps its own key, so nothing is NaN."""
        keep = self.window_keep(self.T, self.W) if mask == "window" else self.packed_keep(self.T, self.D)
        B, N, H = 2, 3, 8
        x64 = [rng.standard_normal((B, self.T, N, H)) for _ in range(3)]
        ct = rng.standard_normal((B, self.T, N, H))

        def run(core, xs):
            out, vjp = jax.vjp(core, *xs)
            return (out, *vjp(jnp.asarray(ct, out.dtype)))

        flash = jax.jit(lambda q, k, v: chunked_attention(q, k, v, keep, q_chunk=self.C, k_chunk=self.C))
        plain = jax.jit(lambda q, k, v: attention_core(q, k, v, keep)[0])
        want = run(plain, [jnp.asarray(x) for x in x64])  # float64
        x32 = [jnp.asarray(x, jnp.float32) for x in x64]
        tol = tolerance_for("float32")
        for name, core in (("chunked", flash), ("einsum", plain)):
            got = run(core, x32)
            for what, a, e in zip(("output", "dq", "dk", "dv"), got, want):
                assert a.dtype == jnp.float32 and np.isfinite(np.asarray(a)).all(), (name, what)
                c = compare(np.asarray(a, np.float64), np.asarray(e), tol.forward if what == "output" else tol.gradient)
                assert c.passed, (name, what, c)
        # the mask matters here: the unmasked kernel is far from the masked core
        free = chunked_attention(x32[0], x32[1], x32[2], q_chunk=self.C, k_chunk=self.C)
        assert np.abs(np.asarray(free, np.float64) - np.asarray(want[0])).max() > 0.1

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
    def test_long_masked_problems_run_the_chunked_kernel_on_every_cpu_of_the_table(self, dtype):
        """A sliding-window or packed mask at T = 8192 (and 2048, under the memory guard) goes to the
        kernel that skips blocks on every built-in CPU's rows, with that processor's blocks."""
        for key in kernels.BUILTIN:
            proc = kernels.Processor(*key.split(" | "))
            for BN, T in ((8, 8192), (8, 2048)):
                got = kernels.choose(platform="cpu", sources=kernels.sources_for(proc, {}), dtype=dtype, B=1, N=BN,
                                     T=T, S=T, H=64, has_mask=True, materialize_limit=kernels.MATERIALIZE_LIMIT)
                assert got.kernel == kernels.CHUNKED and got.q_chunk and got.k_chunk, (key, T, got)
        assert kernels.fused_choice(1, 8, 8192, 8192, 64, jnp.float32, has_mask=True).kernel == kernels.CHUNKED


class TestHeadSteps:
    """`head_chunk`: the kernel runs a piece of its B·K head blocks a step. Which piece (`head_steps`), that
    the numbers do not change (float64, with masks of every axis, grouped heads, a band and ragged tails),
    that block skipping is decided per piece (`block_census` and the Q·Kᵀ that run), and that a bad
    head_chunk is named."""

    @pytest.mark.parametrize(("B", "K", "head_chunk", "steps"), [
        (3, 4, None, (3, 4)), (3, 4, 12, (3, 4)), (3, 4, 100, (3, 4)),  # all of them: one step
        (3, 4, 1, (1, 1)), (3, 4, 2, (1, 2)), (3, 4, 3, (1, 2)),  # heads of one element: a divisor of K
        (3, 4, 4, (1, 4)), (3, 4, 8, (1, 4)), (3, 4, 11, (1, 4)),  # whole elements: K times a divisor of B (3: 1)
        (4, 4, 8, (2, 4)), (4, 4, 15, (2, 4)), (6, 2, 6, (3, 2)), (6, 2, 10, (3, 2)),
        (1, 8, 5, (1, 4)), (5, 1, 3, (1, 1)),
    ])
    def test_the_piece_a_step_runs(self, B, K, head_chunk, steps):
        assert chunked.head_steps(B, K, head_chunk) == steps

    @pytest.mark.parametrize(("B", "N", "K", "keep_shape", "structure"), [
        (4, 6, 6, (4, 6, 9, 11), {}),  # a mask per batch element and head
        (4, 6, 2, (4, 1, 9, 11), {}),  # grouped: 3 query heads a key/value head, a mask per element
        (4, 6, 3, (1, 6, 9, 11), {"is_causal": True}),  # a mask per head ANDed with a band
        (4, 4, 4, None, {"window": (3, 1), "alignment": "bottom-right"}),  # a band alone
        (4, 4, 4, (4, 1, 1, 11), {}),  # key padding
    ])
    def test_output_and_gradients_do_not_change(self, B, N, K, keep_shape, structure, rng):
        """Each block's arithmetic is the same, only the steps differ: equal bit for bit on a 2-core Xeon;
        the bound (1e-13 relative) leaves room for another summation order that XLA may
        pick for a matmul with fewer batch entries on another CPU, far below any real bug's size."""
        T, Sk, H = 9, 11, 4
        q = jnp.asarray(rng.standard_normal((B, T, N, H)))
        k, v = (jnp.asarray(rng.standard_normal((B, Sk, K, H))) for _ in range(2))
        keep = None if keep_shape is None else rng.random(keep_shape) > 0.4
        if keep is not None and keep.shape[0] > 1:
            keep[0] = False  # batch element 0 keeps nothing: a step of its own skips every block
        ct = jnp.asarray(rng.standard_normal((B, T, N, H)))

        def run(head_chunk):
            f = lambda q, k, v: chunked_attention(q, k, v, keep, q_chunk=4, k_chunk=3, head_chunk=head_chunk,  # noqa: E731
                                                  masked_rows="uniform", **structure)
            out, vjp = jax.vjp(jax.jit(f), q, k, v)
            return [np.asarray(x) for x in (out, *vjp(ct))]

        want = run(None)
        assert np.isfinite(want[0]).all() and np.abs(want[1]).max() > 0
        # One head block a step and one element's heads; in the first case also two blocks and two elements.
        for head_chunk in (1, K) + ((2, 2 * K) if keep_shape == (4, 6, 9, 11) else ()):
            for name, a, e in zip(("output", "dq", "dk", "dv"), run(head_chunk), want):
                np.testing.assert_allclose(a, e, rtol=1e-13, atol=1e-15, err_msg=f"{name}, head_chunk={head_chunk}")

    def test_a_bad_head_chunk_is_named(self, rng):
        q, k, v = (jnp.asarray(rng.standard_normal((2, 5, 2, 4))) for _ in range(3))
        for bad in (0, -1, 1.5, True, "2"):
            with pytest.raises(ValueError, match=f"head_chunk must be a positive integer or None, got {bad!r}"):
                chunked_attention(q, k, v, head_chunk=bad)
            with pytest.raises(ValueError, match="head_chunk must be a positive integer or None"):
                chunked.block_census(None, 2, 2, 5, 5, 4, 4, head_chunk=bad)

    T, C = 256, 32

    def packed_rows(self):
        """Row 0 packs 4 causal documents of 2 blocks, row 1 two of 4 blocks: (2, 1, T, T)."""
        seg = np.stack([np.repeat(np.arange(4), 64), np.repeat(np.arange(2), 128)])
        return reference.structured_keep(self.T, self.T, is_causal=True, segment_ids=seg)

    def test_each_step_skips_the_blocks_its_own_batch_elements_leave_empty(self):
        # A document of m blocks has m PARTIAL blocks on its diagonal and m(m-1)/2 FULL below. Row 0:
        # 4 x (2 PARTIAL + 1 FULL); row 1: 2 x (4 + 6). All at once a block is EMPTY only where both rows
        # keep nothing (20 non-empty of 64, `TestBlockSkipping`); one element a step (2 heads), each row's
        # own blocks, over 2 grids of 64; one head block a step, each of those twice.
        keep, n = self.packed_rows(), (self.T // self.C) ** 2
        census = partial(chunked.block_census, keep, 2, 2, self.T, self.T, self.C, self.C)
        assert census() == {"empty": 64 - 20, "full": 4, "partial": 16}
        full, part = 4 * 1 + 2 * 6, 4 * 2 + 2 * 4
        assert census(head_chunk=2) == {"empty": 2 * n - full - part, "full": full, "partial": part}
        assert census(head_chunk=1) == {"empty": 4 * n - 2 * (full + part), "full": 2 * full, "partial": 2 * part}

    def test_only_the_blocks_a_step_keeps_run_their_matmuls(self, matmul_counter, rng):
        keep = self.packed_rows()
        census = chunked.block_census(keep, 2, 2, self.T, self.T, self.C, self.C, head_chunk=2)
        q, k, v = (jnp.asarray(rng.standard_normal((2, self.T, 2, 8)), jnp.float32) for _ in range(3))
        run = lambda q: chunked_attention(q, k, v, keep, q_chunk=self.C, k_chunk=self.C, head_chunk=2)  # noqa: E731
        run(q).block_until_ready()
        jax.effects_barrier()
        # 32 blocks of one element each, where all at once 20 blocks of both elements run (40)
        assert len(matmul_counter) == census["full"] + census["partial"] == 32
        matmul_counter.clear()
        jax.grad(lambda q: run(q).sum())(q).block_until_ready()
        jax.effects_barrier()
        assert len(matmul_counter) == 2 * 32  # the forward's, and the backward's recomputed P


class TestBand:
    """A causal triangle or sliding window given as structure (is_causal / window / alignment, no
    keep-mask): no (T, S) mask is built, the block kinds and the rows that keep nothing come from the
    band while tracing, and the loops visit the non-empty blocks only. Output and gradients must be
    bit-identical to the same mask given densely (the same blocks, kinds and selects run), and the
    count of each kind the same."""

    # (B, T, S, N, K, keywords, blocks, policy)
    CASES = [
        (2, 13, 17, 6, 2, dict(is_causal=True, window=(4, 0)), (4, 3), "nan"),  # G=3: stacked rows cross blocks
        (1, 7, 5, 3, 3, dict(is_causal=True, alignment="bottom-right"), (2, 3), "nan"),  # rows 0, 1 keep nothing
        (3, 5, 7, 3, 3, dict(window=(1, 1), alignment="bottom-right"), (2, 2), "uniform"),
        (1, 16, 16, 4, 2, dict(window=(None, 2)), (64, 64), "zero"),  # one block: the forward keeps P
        (1, 40, 40, 4, 2, dict(is_causal=True, window=(7, 0)), (8, 8), "nan"),  # EMPTY blocks on both sides
    ]

    @pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[1]}S{c[2]}-{c[6][0]}x{c[6][1]}")
    def test_output_and_gradients_equal_the_dense_mask_bit_for_bit(self, case, rng):
        B, T, S, N, K, kw, (cq, ck), policy = case
        q = jnp.asarray(rng.standard_normal((B, T, N, 4)))
        k, v = (jnp.asarray(rng.standard_normal((B, S, K, 4))) for _ in range(2))
        keep = jnp.asarray(reference.structured_keep(T, S, **kw))  # (1, 1, T, S)
        ct = jnp.asarray(rng.standard_normal((B, T, N, 4)))

        def run(**given):
            out, vjp = jax.vjp(lambda q, k, v: chunked_attention(q, k, v, masked_rows=policy, q_chunk=cq, k_chunk=ck,
                                                                 **given), q, k, v)
            return [np.asarray(x) for x in (out, *vjp(ct))]

        band, dense = run(**kw), run(keep=keep)
        for what, a, b in zip(("output", "dq", "dk", "dv"), band, dense):
            np.testing.assert_array_equal(a, b, err_msg=what)
        assert chunked.block_census(None, B, N, T, S, cq, ck, kv_heads=K, **kw) == \
            chunked.block_census(keep, B, N, T, S, cq, ck, kv_heads=K)
        # and the band masks: without it the output differs
        free = np.asarray(chunked_attention(q, k, v, masked_rows=policy, q_chunk=cq, k_chunk=ck))
        assert not np.allclose(np.nan_to_num(band[0]), free)

    def test_no_score_sized_array_is_built_and_only_the_non_empty_blocks_are_visited(self):
        T, W, C = 256, 32, 32
        kw = dict(is_causal=True, window=(W - 1, 0))
        q = jnp.zeros((1, T, 2, 4))
        band = jax.make_jaxpr(jax.grad(lambda q: chunked_attention(q, q, q, q_chunk=C, k_chunk=C, **kw).sum()))(q)
        assert _largest_intermediate(band.jaxpr) < T * T // 4
        keep = jnp.asarray(reference.structured_keep(T, T, **kw))  # the same mask as data is padded and sliced
        dense = jax.make_jaxpr(jax.grad(lambda q: chunked_attention(q, q, q, keep, q_chunk=C, k_chunk=C).sum()))(q)
        assert _largest_intermediate(dense.jaxpr) >= T * T
        # Blocks of w: query block i reaches key blocks i-1 and i, key block j query blocks j and j+1,
        # so each loop runs 2 steps instead of T/c = 8 (the first and last lists padded with the EMPTY index).
        plan = chunked._Plan(S=T, cq=C, ck=C, scale=1.0, precision=None,
                             band=chunked._Band(T, T, *chunked.diagonal_band(Structure.of(T, T, **kw))))
        kinds, keys, queries = (np.asarray(x) for x in chunked._band_visits(plan, T // C, T // C))
        n = T // C
        assert keys.shape == queries.shape == (n, 2) and kinds.shape == (n + 1, n + 1)
        assert keys[0].tolist() == [0, n] and keys[3].tolist() == [2, 3]
        assert queries[3].tolist() == [3, 4] and queries[n - 1].tolist() == [n - 1, n]
        assert (kinds[n] == chunked.EMPTY).all() and (kinds[:, n] == chunked.EMPTY).all()

    def test_diagonal_band_of_each_keyword(self):
        def band(T, S, **kw):
            return chunked.diagonal_band(Structure.of(T, S, **kw))

        assert band(5, 7) is None
        assert band(5, 7, is_causal=True) == (None, 0)
        assert band(5, 7, is_causal=True, alignment="bottom-right") == (None, 2)
        assert band(5, 7, window=(3, 1)) == (-3, 1)
        assert band(5, 7, is_causal=True, window=(3, 1), alignment="bottom-right") == (-1, 2)  # causal caps the right
        assert band(5, 7, window=(None, 4), is_causal=True) == (None, 0)
        for kw in (dict(is_causal=True, window=(2, 1)), dict(window=(None, 2), alignment="bottom-right"), dict(window=1)):
            lo, hi = band(5, 7, **kw)
            d = np.arange(7)[None, :] - np.arange(5)[:, None]
            want = np.ones((5, 7), bool) & (True if lo is None else d >= lo) & (True if hi is None else d <= hi)
            np.testing.assert_array_equal(np.asarray(chunked.band_keep(5, 7, (lo, hi)))[0, 0],
                                          reference.structured_keep(5, 7, **kw)[0, 0])
            np.testing.assert_array_equal(want, reference.structured_keep(5, 7, **kw)[0, 0])
        with pytest.raises(TypeError, match="is_causal must be a bool"):
            band(5, 7, is_causal=1)
        with pytest.raises(ValueError, match="alignment='middle' is not one of"):
            band(5, 7, alignment="middle")
