"""The chunked kernel's flash backward (custom VJP), its edge cases, and the fused path's kernel choice.

Gradients are judged against the oracle's hand-derived float64 backward through the real
module, with the fused path forced onto the chunked kernel with blocks (2, 3): several
blocks on both axes and ragged tails (T=5, S=7)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mha_jax.kernels as kernels
from conftest import SIZES as S
from conftest import make_inputs, make_state_dict, random_keep_mask
from helpers import build, cast_sd, np_dtype
from mha_jax import attention_core, chunked_attention, fused_attention_core
from parity import reference
from parity.tolerances import compare, compare_three_way, errors, tolerance_for

POLICIES = ("nan", "zero", "uniform")


def _mask(kind: str, rng):
    """Keep-masks of every accepted shape; all but "none"/"heads"/"keys" have a fully masked row."""
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
    raise ValueError(kind)


MASKS = ("none", "2d", "3d", "heads", "keys", "queries", "causal")


@pytest.fixture
def force_kernel(monkeypatch):
    """Make fused_attention_core run one kernel, e.g. force_kernel("chunked", 2, 3)."""

    def force(kernel, q_chunk=None, k_chunk=None):
        monkeypatch.setattr(kernels, "choose", lambda **kw: kernels.Choice(kernel, q_chunk, k_chunk, "forced by a test"))

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


CASES = [(m, "nan", (2, 3)) for m in MASKS] + [("3d", "zero", (2, 3)), ("3d", "uniform", (2, 3)), ("causal", "uniform", (2, 3))]
# one block on both axes: the probabilities are kept from the forward instead of recomputed
CASES += [("3d", "nan", (8, 8)), ("causal", "uniform", (8, 8))]


@pytest.mark.parametrize(("mask_kind", "policy", "blocks"), CASES)
def test_flash_float64_matches_oracle_forward_and_backward(mask_kind, policy, blocks, force_kernel, sd64, rng):
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
    for name, expected in ref.items():
        c = compare(got[name], expected, tol.gradient)  # NaNs required at the oracle's places
        assert c.passed, (name, c)
    if policy == "nan" and mask_kind in ("2d", "3d", "queries", "causal"):  # the NaN check above can fail
        assert np.isnan(ref["value"]).any() and not np.isnan(ref["query"]).all()


@pytest.mark.parametrize("policy", POLICIES)
def test_flash_nan_gradients_sit_where_the_materialised_path_puts_them(policy, rng):
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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_flash_16bit_within_the_three_way_bound(dtype, force_kernel, rng):
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


def _small(rng, B=2, T=5, Sk=7, N=3, H=4):
    return tuple(jnp.asarray(rng.standard_normal(s)) for s in ((B, T, N, H), (B, Sk, N, H), (B, Sk, N, H)))


def test_flash_under_jit_and_vmap(rng):
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
def test_flash_forward_mode_is_a_clear_error(mode, rng):
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


def test_flash_hessian_forward_over_reverse_works(rng):
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


# ---------------------------------------------------------------- kernel choice (pure function)


def _choose(**kw):
    args = dict(platform="cpu", kind="cpu", dtype=jnp.float32, B=4, N=8, T=512, S=512, H=64, has_mask=False, materialize_limit=2**26)
    return kernels.choose(**{**args, **kw})


def test_choice_on_a_cuda_gpu_takes_cudnn_only_within_its_limits():
    gpu = dict(platform="gpu", kind="NVIDIA H100 80GB HBM3")
    assert _choose(**gpu, dtype=jnp.bfloat16).kernel == "dpa-cudnn"
    assert _choose(**gpu, dtype=jnp.float16, has_mask=True, T=512, S=256).kernel == "dpa-cudnn"
    assert _choose(**gpu, dtype=jnp.float32).kernel == "einsum"  # no table for this kind: einsum below the guard
    assert _choose(**gpu, dtype=jnp.float64).kernel == "einsum"
    assert _choose(**gpu, dtype=jnp.bfloat16, H=12).kernel == "einsum"  # head dim not a multiple of 8
    assert _choose(**gpu, dtype=jnp.bfloat16, H=256).kernel == "einsum"
    assert _choose(**gpu, dtype=jnp.bfloat16, has_mask=True, T=511).kernel == "einsum"  # odd T with a mask
    big = _choose(**gpu, dtype=jnp.float32, T=65536, S=65536)
    assert (big.kernel, big.q_chunk, big.k_chunk) == ("chunked", *kernels.DEFAULT_BLOCKS)
    assert _choose(platform="tpu", kind="TPU v5 lite", dtype=jnp.bfloat16).kernel == "einsum"


def test_choice_rules_that_no_measurement_overrules(monkeypatch):
    fast_dpa = (kernels.Measured(BN=32, T=512, S=512, fastest="dpa-xla", blocks=(64, 128)),)
    monkeypatch.setitem(kernels.TABLE, "fake", fast_dpa)
    assert _choose(kind="fake").kernel == "dpa-xla"
    assert _choose(kind="fake", dtype=jnp.bfloat16).kernel == "dpa-xla"
    assert _choose(kind="fake", dtype=jnp.float64).kernel == "einsum"  # float32 softmax: never for float64
    assert _choose(kind="fake", dtype=jnp.float16).kernel == "einsum"  # XLA:CPU rejects its float16 backward
    over = _choose(kind="fake", T=4096, S=4096, materialize_limit=2**20)
    assert (over.kernel, over.q_chunk, over.k_chunk) == ("chunked", 64, 128)  # the memory guard, blocks from the table
    assert _choose(kind="fake", T=0).kernel == "chunked"


def test_choice_follows_the_nearest_measured_row(monkeypatch):
    rows = (
        kernels.Measured(BN=32, T=256, S=256, fastest="einsum", blocks=None),
        kernels.Measured(BN=32, T=2048, S=2048, fastest="chunked", blocks=(256, 2048)),
        kernels.Measured(BN=8, T=8192, S=8192, fastest="chunked", blocks=(512, 1024)),
    )
    monkeypatch.setitem(kernels.TABLE, "fake", rows)
    assert _choose(kind="fake", T=200, S=200).kernel == "einsum"
    c = _choose(kind="fake", T=2048, S=2048)
    assert (c.kernel, c.q_chunk, c.k_chunk) == ("chunked", 256, 2048)
    c = _choose(kind="fake", B=1, T=32768, S=32768)
    assert (c.kernel, c.q_chunk, c.k_chunk) == ("chunked", 512, 1024)


def test_fused_choice_reports_what_runs_here():
    c = kernels.fused_choice(4, 8, 64, 64, 64, jnp.float32, has_mask=False)
    assert c.kernel in kernels.KERNELS and c.why
