"""Module-level edges.

Zero lengths, NaN placement on every path, dtype rules, mask-value checks, the
intermediates API and the shard-agnostic head split, in both frameworks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

import mha_jax
import mha_torch
from conftest import SIZES, make_inputs, random_keep_mask
from helpers import build, cast_sd, np_dtype, run
from mha_spec import STAGE_NAMES, Stages
from parity import convert, reference
from parity.tolerances import compare, compare_three_way, tolerance_for

FRAMEWORKS = ("torch", "jax")
S = SIZES
# Both jax fused kernels: the size/dtype table may pick different ones for float32 and float64.
FRAMEWORK_DTYPES = [("torch", "float64"), ("jax", "float64"), ("jax", "float32")]


def oracle(sd, q, k, v, mask=None, masked_rows="nan", dtype=np.float64):
    return reference.forward(sd, q, k, v, mask, num_heads=S.N, masked_rows=masked_rows, dtype=dtype)


def array(framework, x):
    return convert.numpy_to_tensor(np.asarray(x)) if framework == "torch" else jnp.asarray(x)


def to_numpy(x):
    return convert.tensor_to_numpy(x.detach()) if isinstance(x, torch.Tensor) else np.asarray(x)


def call(framework, m, q, k, v, mask=None, **kw):
    """m on NumPy inputs of any dtype (bfloat16 masks included); NumPy outputs."""
    with torch.no_grad():
        out, w = m(*(array(framework, x) for x in (q, k, v)), None if mask is None else array(framework, mask), **kw)
    return to_numpy(out), None if w is None else to_numpy(w)


# ------------------------------------------------------------- zero lengths


@pytest.mark.parametrize("framework, dtype", FRAMEWORK_DTYPES)
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("B, T", [(3, 0), (0, 5)])
@pytest.mark.parametrize("masked", [False, True])
def test_empty_query_or_batch_gives_empty_outputs(framework, need_weights, dtype, B, T, masked, sd64):
    q, kv = np.zeros((B, T, S.E), dtype), np.ones((B, S.S, S.E), dtype)
    mask = np.ones((T, S.S), bool) if masked else None
    out, w = run(framework, build(framework, cast_sd(sd64, dtype), S.N), q, kv, kv, mask, need_weights=need_weights)
    assert out.shape == (B, T, S.E) and out.dtype == np.dtype(dtype)
    assert w is None if not need_weights else w.shape == (B, S.N, T, S.S)


@pytest.mark.parametrize("framework", FRAMEWORKS + ("oracle",))
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_empty_keys_are_a_value_error(framework, need_weights, masked, sd64):
    q, kv = np.zeros((S.B, S.T, S.E)), np.zeros((S.B, 0, S.E))
    mask = np.ones((S.T, 0), bool) if masked else None
    with pytest.raises(ValueError, match=r"key/value length S=0: a query must have at least one key"):
        if framework == "oracle":
            oracle(sd64, q, kv, kv, mask)
        else:
            run(framework, build(framework, sd64, S.N), q, kv, kv, mask, need_weights=need_weights)


# ------------------------------------------------------------- NaN placement


def _nan_inputs(rng, where: str, dtype):
    """Inputs with one NaN: query[0, 2], key[0, 3] or value[0, 3] (one element of the row)."""
    q, k, v = (x.astype(dtype) for x in make_inputs(rng))
    x, pos = {"query": (q, (0, 2, 5)), "key": (k, (0, 3, 5)), "value": (v, (0, 3, 5))}[where]
    x[pos] = np.nan
    return q, k, v


def _expected_nan_rows(where: str, keep):
    """Output rows (B, T) that must be NaN, from the maths, not from any implementation.

    A NaN element of query/key/value spreads over its whole projected row (every feature of
    the projection sums it). A NaN query row gives NaN scores, so its softmax is NaN, unless
    the row keeps no key at all (the policy's constant replaces it). A NaN key is one NaN score
    column: NaN in the rows that keep it; a masked score is replaced by -inf, NaN or not.
    A NaN value meets every row of its batch element: weights (zero or not) times NaN is NaN.
    """
    rows = np.zeros((S.B, S.T), bool)
    keep = np.ones((S.B, S.T, S.S), bool) if keep is None else keep
    if where == "query":
        rows[0, 2] = keep[0, 2].any()
    elif where == "key":
        rows[0] = keep[0, :, 3]
    else:
        rows[0] = True
    return rows


@pytest.mark.parametrize("framework, dtype", FRAMEWORK_DTYPES)
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("where", ["query", "key", "value"])
@pytest.mark.parametrize("masked", [False, True])
def test_nan_input_gives_nan_where_the_maths_puts_it(framework, need_weights, where, masked, dtype, sd64, rng):
    """Every path, both frameworks; NaN in batch 0 never leaks into batches 1 and 2."""
    q, k, v = _nan_inputs(rng, where, dtype)
    keep = None
    if masked:  # row 2 of batch 0 keeps nothing; key 3 is masked out of rows 0 and 1 only
        keep = random_keep_mask(rng, (S.B, S.T, S.S), fully_masked_row=(1, 4))
        keep[0, :, 3] = [False, False, True, True, True]
        keep[0, 2] = False
    sd = cast_sd(sd64, dtype)
    out, _ = run(framework, build(framework, sd, S.N, masked_rows="zero"), q, k, v, keep, need_weights=need_weights)
    expected = _expected_nan_rows(where, keep)
    ref = oracle(sd, q, k, v, keep, masked_rows="zero")
    np.testing.assert_array_equal(np.isnan(ref.output).any(axis=-1), expected)  # the oracle agrees with the maths
    np.testing.assert_array_equal(np.isnan(out), np.broadcast_to(expected[..., None], out.shape))
    c = compare(out, ref.output, tolerance_for(dtype).forward)  # finite values right too
    assert c.passed, c


CORE_MASK_SHAPES = [(5, 7), (3, 1, 5, 7), (1, 2, 1, 7), (3, 2, 5, 7), (3, 2, 1, 7)]
# A key axis of 1 (one flag per query row: a query-padding mask), and the causal triangle
# tril(ones(T, S)), which torch's fused core runs as SDPA's is_causal.
KEY_AXIS_1_SHAPES = [(5, 1), (3, 2, 5, 1), (1, 2, 1, 1)]
# JAX runs one key-axis-1 layout here (each jax case compiles; torch's are cheap).
CORE_CASES = [(f, shape) for f in FRAMEWORKS for shape in [None, *CORE_MASK_SHAPES, (3, 2, 5, 1), "causal"]]
CORE_CASES += [("torch", shape) for shape in KEY_AXIS_1_SHAPES if shape != (3, 2, 5, 1)]


@pytest.mark.parametrize("framework, mask_shape", CORE_CASES, ids=[f"{f}-{m}".replace(" ", "") for f, m in CORE_CASES])
def test_fused_core_puts_nan_where_the_weights_core_does(framework, mask_shape, rng):
    """Single NaN elements of q, k and v, straight into the cores, under every mask layout."""
    B, N, T, S_, H = 3, 2, 5, 7, 4
    q, k, v = rng.standard_normal((B, N, T, H)), rng.standard_normal((B, N, S_, H)), rng.standard_normal((B, N, S_, H))
    q[1, 0, 2, 1] = k[0, 1, 3, 0] = k[2, 0, 5, 3] = v[2, 1, 6, 2] = np.nan
    keep = None
    if mask_shape == "causal":
        keep = np.tril(np.ones((1, 1, T, S_), bool))  # key 3 from row 3 on; no row keeps nothing
    elif mask_shape is not None:
        keep = rng.random(mask_shape) > 0.4
        keep = keep.reshape((1,) * (4 - keep.ndim) + keep.shape)
        keep[..., 0] = True  # rows keep something...
        if mask_shape[-1] > 1:
            keep[..., 3] = np.arange(mask_shape[-2]) % 2 == 0  # ...key 3 only in even rows
        if mask_shape[-2] > 1:
            keep[..., 1, :] = False  # and row 1 keeps nothing: the policy's row
        elif mask_shape[-1] == 1:
            keep[:, -1] = False  # or the last head keeps nothing at all
    for policy in ("nan", "zero", "uniform"):
        if framework == "torch":
            args = [torch.from_numpy(x) for x in (q, k, v)] + [None if keep is None else torch.from_numpy(keep)]
            ctx_w, _ = mha_torch.attention_core(*args, masked_rows=policy)
            ctx_f = mha_torch.fused_attention_core(*args, masked_rows=policy)
        else:  # the jax cores take (B, L, N, H)
            args = [jnp.asarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)] + [keep]
            ctx_w, _ = mha_jax.attention_core(*args, masked_rows=policy)
            ctx_f = mha_jax.fused_attention_core(*args, masked_rows=policy)
        nan_w, nan_f = np.isnan(to_numpy(ctx_w)), np.isnan(to_numpy(ctx_f))
        assert nan_w.any() and not nan_w.all()
        np.testing.assert_array_equal(nan_f, nan_w, err_msg=policy)


# ------------------------------------------------------------- dtypes


def test_jax_constructor_rejects_non_floating_and_unavailable_dtypes():
    with pytest.raises(TypeError, match="dtype must be a floating dtype, got int32"):
        mha_jax.MultiHeadAttention(12, 3, rngs=nnx.Rngs(0), dtype=jnp.int32)
    with pytest.raises(TypeError, match="param_dtype must be a floating dtype, got complex64"):
        mha_jax.MultiHeadAttention(12, 3, rngs=nnx.Rngs(0), param_dtype=jnp.complex64)
    with jax.enable_x64(False):
        with pytest.raises(TypeError, match="param_dtype=float64 needs jax_enable_x64"):
            mha_jax.MultiHeadAttention(12, 3, rngs=nnx.Rngs(0), param_dtype=jnp.float64)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int32, "float32"])
def test_torch_constructor_rejects_non_floating_dtypes(dtype):
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        mha_torch.MultiHeadAttention(12, 3, dtype=dtype)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("input_dtype", ["float16", "float64", "bfloat16"])
def test_input_dtype_must_match_the_parameters(framework, input_dtype, sd64):
    m = build(framework, cast_sd(sd64, np.float32), S.N)
    x = np.zeros((S.B, S.T, S.E), np_dtype(input_dtype))
    with pytest.raises(TypeError, match=rf"query has dtype (torch\.)?{input_dtype} but the module's parameters are (torch\.)?float32"):
        run(framework, m, x, x, x)


def test_jax_computation_dtype_sets_the_input_dtype(sd64, rng):
    """dtype= (mixed precision: float32 parameters, bfloat16 compute) wants bfloat16 inputs."""
    m = build("jax", cast_sd(sd64, np.float32), S.N, dtype=jnp.bfloat16)
    q, k, v = make_inputs(rng)
    with pytest.raises(TypeError, match="query has dtype float32 but the module computes in dtype=bfloat16"):
        run("jax", m, *(x.astype(np.float32) for x in (q, k, v)))
    bf = [x.astype(ml_dtypes.bfloat16) for x in (q, k, v)]
    out, w = run("jax", m, *bf)
    assert out.dtype == w.dtype == ml_dtypes.bfloat16
    # The module computes with its float32 parameters cast to bfloat16: the same maths as the
    # oracle on bfloat16 weights, judged three-way as every 16-bit result is.
    sd_bf = cast_sd(cast_sd(sd64, np.float32), ml_dtypes.bfloat16)
    x64 = [reference.as_float64(x) for x in bf]
    exact = oracle({n: reference.as_float64(a) for n, a in sd_bf.items()}, *x64)
    low = oracle(sd_bf, *x64, dtype=ml_dtypes.bfloat16)
    tol = tolerance_for("bfloat16")
    c = compare_three_way(out, exact.output, low.output, tol.three_way_k, tol.forward.atol)
    assert c.passed, c


# ------------------------------------------------------------- mask values


def _additive(keep, dtype, big=-np.inf):
    return np.where(keep, 0.0, big).astype(dtype)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("mask_dtype", ["float32", "float16", "bfloat16", "float64"])
def test_float_mask_values_are_checked(framework, mask_dtype, sd64, rng):
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    m = build(framework, sd64, S.N)
    dt = np_dtype(mask_dtype)
    for bad in (_additive(keep, dt), _additive(keep, dt, -1e4)):
        with pytest.raises(ValueError, match=r"looks like an additive mask \(0 = attend, -inf = masked\).*\(mask == 0\)"):
            call(framework, m, q, k, v, bad)
    with_nan = keep.astype(dt)
    with_nan[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="contains NaN"):
        call(framework, m, q, k, v, with_nan)
    for nw in (True, False):  # a 0/1 float keep-mask still works, exactly as the bool one
        got, _ = call(framework, m, q, k, v, keep.astype(dt), need_weights=nw)
        expected, _ = call(framework, m, q, k, v, keep, need_weights=nw)
        np.testing.assert_array_equal(got, expected)


def test_jax_mask_values_are_not_checked_under_jit(sd64, rng):
    """Documented limit: a traced mask's values are unknown; an additive mask is read as a keep-mask."""
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.B, S.T, S.S), fully_masked_row=(0, 0))
    m = build("jax", sd64, S.N, masked_rows="zero")
    out = jax.jit(lambda mask: m(q, k, v, mask)[0])(_additive(keep, np.float64))
    expected = oracle(sd64, q, k, v, ~keep, masked_rows="zero").output  # -inf is nonzero: "keep"
    c = compare(np.asarray(out), expected, tolerance_for("float64").forward)
    assert c.passed, c


# ------------------------------------------------------------- intermediates


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("need_weights", [True, False])
def test_intermediates_match_the_oracle_stages(framework, need_weights, sd64, rng):
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.B, S.T, S.S))
    m = build(framework, sd64, S.N, masked_rows="uniform")
    args = [array(framework, x) for x in (q, k, v, keep)]
    with torch.no_grad():
        out, w, stages = m(*args, need_weights=need_weights, return_intermediates=True)
        plain_out, _ = m(*args, need_weights=need_weights)
    assert isinstance(stages, Stages)
    np.testing.assert_array_equal(to_numpy(out), to_numpy(plain_out))
    assert stages.output is out and stages.weights is w
    ref = oracle(sd64, q, k, v, keep, "uniform")
    for name in STAGE_NAMES:
        got = getattr(stages, name)
        if not need_weights and name in ("scores", "weights"):
            assert got is None, name  # the fused paths never build them
            continue
        got, expected = to_numpy(got), getattr(ref, name)
        if name == "scores":  # -inf where masked, in the same places; the rest compared
            np.testing.assert_array_equal(got == -np.inf, expected == -np.inf)
            got, expected = (np.where(expected == -np.inf, 0.0, x) for x in (got, expected))
        c = compare(got, expected, tolerance_for("float64").forward)
        assert c.passed, (name, c)


def test_jax_intermediates_under_jit(sd64, rng):
    q, k, v = make_inputs(rng)
    m = build("jax", sd64, S.N)
    eager = m(q, k, v, return_intermediates=True)[2]
    jitted = jax.jit(lambda q, k, v: m(q, k, v, need_weights=False, return_intermediates=True))(q, k, v)[2]
    assert jitted.scores is None and jitted.weights is None
    for name in ("q", "k", "v", "context", "output"):
        c = compare(np.asarray(getattr(jitted, name)), np.asarray(getattr(eager, name)), tolerance_for("float64").forward)
        assert c.passed, (name, c)


@pytest.mark.parametrize("framework, dtype", [("torch", "float16"), ("jax", "bfloat16")])
def test_16bit_scores_are_float32(framework, dtype, sd64, rng):
    dt = np_dtype(dtype)
    q, k, v = (x.astype(dt) for x in make_inputs(rng))
    m = build(framework, cast_sd(sd64, dt), S.N)
    with torch.no_grad():
        _, _, stages = m(*(array(framework, x) for x in (q, k, v)), return_intermediates=True)
    assert to_numpy(stages.scores).dtype == np.float32
    assert to_numpy(stages.weights).dtype == to_numpy(stages.q).dtype == dt


# ------------------------------------------------------------- local head count


def _shard(framework, m, sd, heads: slice):
    """Give module m the q/k/v/out weights of a subset of heads, as one tensor-parallel rank holds them."""
    H = S.E // S.N
    cols = slice(heads.start * H, heads.stop * H)
    w_in = {p: (sd[f"{p}.weight"][cols], sd[f"{p}.bias"][cols]) for p in ("q_proj", "k_proj", "v_proj")}
    w_in["out_proj"] = (sd["out_proj.weight"][:, cols], np.zeros(S.E))  # the bias is added once, not per rank
    for p, (w, b) in w_in.items():
        if framework == "torch":
            layer = torch.nn.Linear(w.shape[1], w.shape[0], dtype=torch.float64)
            layer.weight.data, layer.bias.data = torch.from_numpy(w.copy()), torch.from_numpy(b.copy())
            setattr(m, p, layer)
        else:
            layer = getattr(m, p)
            layer.kernel, layer.bias = nnx.Param(jnp.asarray(w.T)), nnx.Param(jnp.asarray(b))
    return m


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("need_weights", [True, False])
def test_head_split_follows_the_local_width(framework, need_weights, sd64, rng):
    """Two "ranks" holding heads [0, 1) and [1, 3): their outputs sum to the full module's (plus one bias)."""
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (S.T, S.S))
    full = oracle(sd64, q, k, v, keep, "zero")
    total = np.zeros((S.B, S.T, S.E))
    for heads in (slice(0, 1), slice(1, 3)):
        m = _shard(framework, build(framework, sd64, S.N, masked_rows="zero"), sd64, heads)
        out, w = run(framework, m, q, k, v, keep, need_weights=need_weights)
        total += out
        if need_weights:
            assert w.shape == (S.B, heads.stop - heads.start, S.T, S.S)
            c = compare(w, full.weights[:, heads], tolerance_for("float64").forward)
            assert c.passed, c
    c = compare(total + sd64["out_proj.bias"], full.output, tolerance_for("float64").forward)
    assert c.passed, c
