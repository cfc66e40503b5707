"""mha_jax.pallas: our wrappers of jax's Pallas flash kernels, run in Pallas interpret mode on
this CPU (the only way they have run here: no GPU or TPU), against `attention_core` in float32,
forward and the gradients of q, k and v through each kernel's own backward; the masked-row
policy where a query segment id no key has empties a row (causal rows and shared segment ids
never empty one); the helpers (rows that attend, int32 ids, precision under which the kernels
are traced); and the fused core's dispatch on a fake TPU device. Sizes fit the kernels' blocks:
the GPU kernel needs T = S and blocks that are powers of two >= 16 (32 here), the TPU kernel T
and S multiples of 128. Each interpret-mode call costs seconds: the slower cases are marked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mha_jax.attention as attention
from mha_jax import MultiHeadAttention, attention_core, fused_attention_core, kernels, pallas, structured_keep

# Measured on this CPU in interpret mode against attention_core (float32), every case below
# over two random draws: forward and gradients at most 1.9e-6 off. 1e-5 leaves ~5x.
ATOL = 1e-5

GPU = dict(B=2, T=32, S=32, N=4, K=2, H=16)  # G = 2 query heads per key/value head
TPU = dict(B=2, T=128, S=256, N=2, K=1, H=16)  # T != S, G = 2


def _qkv(rng, B, T, S, N, K, H):
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))


def _both(fn, ref, q, k, v, rng):
    """(output, gradients) of fn and of ref for one random cotangent; each a vjp."""
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    out, vjp = jax.vjp(fn, q, k, v)
    r_out, r_vjp = jax.vjp(ref, q, k, v)
    return (out, vjp(w)), (r_out, r_vjp(w))


def _close(got, want):
    """Equal NaN positions, and within ATOL elsewhere."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=0, atol=ATOL)


def _gpu_ids(B, T):
    # Row 0 two documents, row 1 three: a batch mix-up changes the mask.
    return jnp.asarray(np.array([[0] * 10 + [1] * (T - 10), [4] * 5 + [2] * 20 + [9] * (T - 25)]), jnp.int32)


GPU_CASES = {
    "none": dict(),
    "causal, without x64": dict(is_causal=True, x64=False),  # the kernel called as is, no wrapping custom_vjp
    "segments": dict(segment_ids=True),
    "causal+segments": pytest.param(dict(is_causal=True, segment_ids=True), marks=pytest.mark.slow),  # 2.9 s measured
}


@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_the_gpu_kernel_matches_the_core_forward_and_backward(case, rng):
    s = GPU
    q, k, v = _qkv(rng, **s)
    ids = _gpu_ids(s["B"], s["T"]) if case.get("segment_ids") else None
    causal = case.get("is_causal", False)
    keep = structured_keep(s["T"], s["S"], is_causal=causal, segment_ids=ids)
    with jax.enable_x64(case.get("x64", True)):
        (out, grads), (r_out, r_grads) = _both(
            lambda q, k, v: pallas.gpu_flash(q, k, v, is_causal=causal, segment_ids=ids, interpret=True),
            lambda q, k, v: attention_core(q, k, v, keep)[0], q, k, v, rng)
    _close(out, r_out)
    for g, r in zip(grads, r_grads):
        _close(g, r)
    assert float(jnp.abs(out).max()) > 0.1  # not a vacuous match


def _tpu_ids(B, T, S):
    """Query ids (B, T) and key ids (B, S); in row 1 id 7 has no key, so those queries keep nothing."""
    q_ids = np.array([[0] * 64 + [1] * (T - 64), [3] * 40 + [5] * 56 + [7] * (T - 96)])
    k_ids = np.array([[0] * 100 + [1] * (S - 100), [3] * 30 + [5] * (S - 30)])
    return jnp.asarray(q_ids, jnp.int32), jnp.asarray(k_ids, jnp.int32)


TPU_CASES = {
    "causal": dict(is_causal=True),
    "causal+key-segments, zero": dict(is_causal=True, segments=True, masked_rows="zero"),
    "none": pytest.param(dict(), marks=pytest.mark.slow),  # 2.7 s measured
    "key-segments, uniform": pytest.param(dict(segments=True, masked_rows="uniform"), marks=pytest.mark.slow),  # 3.1 s measured
}


@pytest.mark.parametrize("case", TPU_CASES.values(), ids=TPU_CASES.keys())
def test_the_tpu_kernel_matches_the_core_forward_and_backward(case, rng):
    s = TPU
    q, k, v = _qkv(rng, **s)
    causal, policy = case.get("is_causal", False), case.get("masked_rows", "nan")
    q_ids, k_ids = _tpu_ids(s["B"], s["T"], s["S"]) if case.get("segments") else (None, None)
    keep = structured_keep(s["T"], s["S"], is_causal=causal, segment_ids=q_ids, key_segment_ids=k_ids)
    (out, grads), (r_out, r_grads) = _both(
        lambda q, k, v: pallas.tpu_flash(q, k, v, is_causal=causal, segment_ids=q_ids, key_segment_ids=k_ids,
                                         masked_rows=policy, interpret=True),
        lambda q, k, v: attention_core(q, k, v, keep, masked_rows=policy)[0], q, k, v, rng)
    _close(out, r_out)
    for g, r in zip(grads, r_grads):
        _close(g, r)
    if q_ids is not None:  # the fully masked rows are there, and hold the policy's value
        empty = ~np.asarray(keep).any(-1)[:, 0]  # (B, T)
        # Row 1's id 7 (t >= 96) has no key; causal also empties row 0's t in [64, 100): id 1's keys start at 100.
        assert empty[1, 96:].all() and empty.sum() == 32 + (36 if causal else 0)
        # "zero": 0; "uniform": mean V of the row's key/value head (K = 1: both query heads read head 0).
        mean_v = np.asarray(v[1], np.float64).mean(0)[0]  # (H,)
        want = np.zeros((32, 2, 16)) if policy == "zero" else np.broadcast_to(mean_v, (32, 2, 16))
        np.testing.assert_allclose(np.asarray(out)[1, 96:], want, rtol=0, atol=ATOL)


def test_the_nan_policy_on_the_tpu_kernel(rng):
    """The default policy: NaN on the rows that keep nothing, nowhere else (forward; 2.4 s measured)."""
    s = TPU
    q, k, v = _qkv(rng, **s)
    q_ids, k_ids = _tpu_ids(s["B"], s["T"], s["S"])
    out = pallas.tpu_flash(q, k, v, segment_ids=q_ids, key_segment_ids=k_ids, interpret=True)
    keep = structured_keep(s["T"], s["S"], segment_ids=q_ids, key_segment_ids=k_ids)
    _close(out, attention_core(q, k, v, keep)[0])
    nan_rows = np.isnan(np.asarray(out)).all(axis=(2, 3))  # (B, T)
    np.testing.assert_array_equal(nan_rows, ~np.asarray(keep).any(-1)[:, 0])
    assert nan_rows.sum() == 32 and not np.isnan(np.asarray(out)[~nan_rows]).any()


# ---------------------------------------------------------------- helpers, refusals (no kernel runs)


def test_rows_attending_equals_the_dense_masks_rows(rng):
    B, T, S = 3, 9, 11
    for trial in range(4):
        q_ids = jnp.asarray(rng.integers(0, 4, (B, T)))
        k_ids = jnp.asarray(rng.integers(0, 4, (B, S)))
        for causal in (False, True):
            keep = structured_keep(T, S, is_causal=causal, segment_ids=q_ids, key_segment_ids=k_ids)  # (B, 1, T, S)
            want = np.asarray(keep).any(-1)[:, 0]
            got = np.asarray(pallas.rows_attending(q_ids, k_ids, causal))
            np.testing.assert_array_equal(got, want)
    assert not want.all() and want.any()  # both kinds of row occur


def test_wide_segment_ids_keep_their_equalities_as_int32():
    # 2**40 and 2**40 + 2**32 are equal after a cast to int32: the ranks keep them apart.
    ids = jnp.asarray(np.array([[2**40, 2**40 + 2**32, 5, 2**40]]), jnp.int64)
    keys = jnp.asarray(np.array([[5, 2**40 + 2**32, 2**40]]), jnp.int64)
    q32, k32 = pallas._int32_ids(ids, keys)
    assert q32.dtype == k32.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(q32)[:, :, None] == np.asarray(k32)[:, None, :],
                                  np.asarray(ids)[:, :, None] == np.asarray(keys)[:, None, :])
    assert np.asarray(ids.astype(jnp.int32))[0, 0] == np.asarray(ids.astype(jnp.int32))[0, 1]  # what a cast would do
    small = jnp.asarray([[1, 2]], jnp.int16)
    assert pallas._int32_ids(small, None)[0].tolist() == [[1, 2]]


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: pallas.gpu_flash(q, k[:, :16], v[:, :16]), r"pallas-gpu-flash cannot run q \(2, 32, 4, 16\), k \(2, 16, 2, 16\): T=32 != S=16"),
    (lambda q, k, v: pallas.gpu_flash(q.astype(jnp.float64), k.astype(jnp.float64), v.astype(jnp.float64)),
     "float64: it runs float32, float16 and bfloat16"),
    (lambda q, k, v: pallas.tpu_flash(q, k, v), "T=32, S=32: both must be multiples of its 128 blocks"),
    (lambda q, k, v: pallas.flash(kernels.PALLAS_GPU, q, k, v, segment_ids=jnp.zeros((2, 32), jnp.int32),
                                  key_segment_ids=jnp.zeros((2, 32), jnp.int32)), "takes one set of segment ids"),
    (lambda q, k, v: pallas.gpu_flash(q, k, v, masked_rows="drop"), "masked_rows='drop' is not one of"),
    (lambda q, k, v: pallas.gpu_flash(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)), "K must divide N"),
    (lambda q, k, v: pallas.gpu_flash(q, k, v, segment_ids=jnp.zeros((2, 31), jnp.int32)),
     r"segment_ids must have shape \(2, 32\)"),
    (lambda q, k, v: pallas.gpu_flash(q, k, v, precision="bogus"), "precision 'bogus' has no"),
    (lambda q, k, v: pallas.flash("chunked", q, k, v), "is not one of"),
])
def test_what_a_kernel_cannot_run_is_a_value_error_naming_it(call, match, rng):
    q, k, v = _qkv(rng, **GPU)
    with pytest.raises(ValueError, match=match):
        call(q, k, v)


def test_float_segment_ids_are_a_type_error(rng):
    q, k, v = _qkv(rng, **GPU)
    with pytest.raises(TypeError, match="segment_ids must be integers"):
        pallas.gpu_flash(q, k, v, segment_ids=jnp.zeros((2, 32), jnp.float32))


def _dots_in_kernels(jaxpr, inside=False):
    """The precision of every dot_general inside a pallas_call, in this jaxpr and every sub-jaxpr."""
    found = []
    for eqn in jaxpr.eqns:
        here = inside or eqn.primitive.name == "pallas_call"
        if here and eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += _dots_in_kernels(sub.jaxpr, here)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += _dots_in_kernels(sub, here)
    return found


@pytest.mark.parametrize("kernel", kernels.PALLAS_KERNELS)
def test_the_kernels_dots_follow_the_calls_precision_forward_and_backward(kernel, rng):
    s = GPU if kernel == kernels.PALLAS_GPU else dict(TPU, S=128)
    q, k, v = _qkv(rng, **s)

    def traced(precision):
        def loss(q, k, v):
            return pallas.flash(kernel, q, k, v, is_causal=True, precision=precision, interpret=True).sum()

        return _dots_in_kernels(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)

    highest = traced("highest")
    # The forward's two dots and the backward's (GPU: 5, TPU: 4 in dK/dV and 2 in dQ, each once per group).
    assert len(highest) >= 7 and all(p == (jax.lax.Precision.HIGHEST,) * 2 for p in highest)
    default = traced(None)
    assert len(default) == len(highest) and all(p is None for p in default)  # the kernels pass none themselves


# ---------------------------------------------------------------- the fused core's dispatch


class FakeTPU:
    platform, device_kind = "tpu", "TPU v5 lite"


@pytest.fixture
def on_a_tpu(monkeypatch):
    """fused_choice's rule as on a TPU (the data stays on this CPU, the kernel in interpret mode);
    the Pallas calls the dispatch made, with their keywords."""
    real, flash, calls = kernels.fused_choice, pallas.flash, []

    def spy(kernel, *a, **kw):
        calls.append((kernel, kw))
        return flash(kernel, *a, **kw)

    monkeypatch.setattr(kernels, "fused_choice", lambda *a, **kw: real(*a, **{**kw, "device": FakeTPU()}))
    monkeypatch.setattr(pallas, "flash", spy)
    return calls


def test_the_module_on_a_tpu_runs_the_flash_kernel_with_its_structure(on_a_tpu, rng):
    """mask-free causal packed rows go to pallas-tpu-flash as is_causal and segment ids, and give the
    weights path's output (forward; 3.0 s measured)."""
    B, T, E, N = 2, 128, 32, 2
    layer = MultiHeadAttention(E, N, num_kv_heads=1, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((B, T, E)), jnp.float32)
    ids = jnp.asarray(np.array([[0] * 50 + [1] * 78, [2] * 128]), jnp.int32)
    fused, _ = layer(x, x, x, need_weights=False, is_causal=True, segment_ids=ids)
    (kernel, kw), = on_a_tpu
    assert kernel == kernels.PALLAS_TPU and kw["is_causal"] is True and kw["key_segment_ids"] is None
    np.testing.assert_array_equal(np.asarray(kw["segment_ids"]), np.asarray(ids))
    weights_path, _ = layer(x, x, x, need_weights=True, is_causal=True, segment_ids=ids)
    _close(fused, weights_path)


def test_on_a_tpu_what_the_kernel_cannot_express_runs_chunked(on_a_tpu, monkeypatch, rng):
    ran = []
    chunked = attention.chunked_attention
    monkeypatch.setattr(attention, "chunked_attention", lambda *a, **kw: ran.append(kw["q_chunk"]) or chunked(*a, **kw))
    q, k, v = _qkv(rng, B=2, T=128, S=128, N=2, K=2, H=8)
    cases = [dict(keep=np.tril(np.ones((128, 128), bool))),  # a mask given as data, even a triangle
             dict(window=4), dict(is_causal=True, alignment="bottom-right", keep=None)]
    for case in cases:
        keep = case.pop("keep", None)
        out = fused_attention_core(q, k, v, keep, **case)
        want = attention_core(q, k, v, structured_keep(128, 128, **case) if keep is None else keep)[0]
        _close(out, want)
    # The dense mask and the window ran chunked; bottom-right with T = S is the top-left triangle: the kernel.
    assert len(ran) == 2 and [c[0] for c in on_a_tpu] == [kernels.PALLAS_TPU] and on_a_tpu[0][1]["is_causal"]


def test_a_pallas_kernel_forced_past_the_rule_refuses_a_dense_mask(monkeypatch, rng):
    monkeypatch.setattr(kernels, "fused_choice", lambda *a, **kw: kernels.Choice(kernels.PALLAS_TPU))
    q, k, v = _qkv(rng, B=2, T=128, S=128, N=2, K=2, H=8)
    with pytest.raises(ValueError, match=r"pallas-tpu-flash was chosen for q \(2, 128, 2, 8\), k \(2, 128, 2, 8\), "
                                         "but a dense mask"):
        fused_attention_core(q, k, v, np.ones((128, 128), bool))


def test_on_this_cpu_the_structured_keywords_give_the_bits_of_their_keep_mask(rng):
    q, k, v = _qkv(rng, B=3, T=5, S=7, N=3, K=1, H=4)
    ids, kids = jnp.asarray(rng.integers(0, 2, (3, 5))), jnp.asarray(rng.integers(0, 2, (3, 7)))
    user = jnp.asarray(rng.random((3, 5, 7)) > 0.3)
    for kw in (dict(is_causal=True), dict(segment_ids=ids, key_segment_ids=kids, window=(1, None)),
               dict(is_causal=True, alignment="bottom-right")):
        for keep in (None, user):
            built = structured_keep(5, 7, **kw)
            both = built if keep is None else attention.keep_4d(keep, 3, 3, 5, 7) & built
            np.testing.assert_array_equal(np.asarray(fused_attention_core(q, k, v, keep, masked_rows="zero", **kw)),
                                          np.asarray(fused_attention_core(q, k, v, both, masked_rows="zero")))
