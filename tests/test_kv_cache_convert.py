"""parity.cache_transfer: KV caches between mha_torch and mha_jax, bit for bit, and a prefill run in one
framework continued in the other, judged against the float64 oracle (parity.reference.decode and
one causal forward). Sizes pairwise distinct: B=3 rows, K=2 key/value heads, C=11 slots, H=6
(E=24, N=4), L=9 tokens of which a prompt of P=5, left padding [0, 2, 1].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from mha_jax.kv_cache import KVCache as JaxCache
from mha_torch.kv_cache import KVCache as TorchCache
from parity import convert, reference
from parity.cache_transfer import NumpyKVCache, from_numpy, jax_to_torch, to_numpy, torch_to_jax
from parity.tolerances import compare, tolerance_for

B, K, C, H = 3, 2, 11, 6
E, N, L, P = 24, 4, 9, 5
STARTS = np.array([0, 2, 1])
LENGTHS = np.array([5, 7, 6])  # written slots per row: not all equal, not all C
THETA = 500.0
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float64": np.float64, "float16": np.float16}


def _bits(a: np.ndarray) -> np.ndarray:
    """The array's bit patterns: equal bits, not equal values (NaN == NaN, -0.0 != 0.0)."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def _filled(dtype, seed=0) -> np.ndarray:
    """(B, K, C, H) random values in `dtype`, with a NaN, an infinity and a negative zero."""
    a = np.random.default_rng(seed).standard_normal((B, K, C, H)).astype(dtype)
    a[0, 1, 2, 3], a[1, 0, 4, 5], a[2, 1, 0, 0] = np.nan, -np.inf, -0.0
    return a


def _torch_cache(dtype) -> TorchCache:
    k, v = _filled(dtype, 0), _filled(dtype, 1)
    return TorchCache(convert.numpy_to_tensor(k), convert.numpy_to_tensor(v), torch.tensor(STARTS),
                      torch.tensor(LENGTHS))


def _jax_cache(dtype) -> JaxCache:
    k, v = (_filled(dtype, s).transpose(0, 2, 1, 3) for s in (2, 3))  # (B, C, K, H)
    return JaxCache(jnp.asarray(k), jnp.asarray(v), jnp.asarray(STARTS, jnp.int32), jnp.asarray(LENGTHS, jnp.int32))


# ---------------------------------------------------------------- the containers, bit for bit


@pytest.mark.parametrize("name", list(DTYPES))
def test_torch_to_jax_and_back_is_bit_exact(name):
    t = _torch_cache(DTYPES[name])
    j = torch_to_jax(t)
    assert isinstance(j, JaxCache)
    assert j.k.shape == j.v.shape == (B, C, K, H) and np.dtype(j.k.dtype) == np.dtype(DTYPES[name])
    assert j.starts.dtype == jnp.int32 and j.lengths.dtype == jnp.int32
    assert np.asarray(j.starts).tolist() == STARTS.tolist() and np.asarray(j.lengths).tolist() == LENGTHS.tolist()
    for ours, theirs in ((j.k, t.k), (j.v, t.v)):  # slot c of head k: jax [b, c, k, h] is torch [b, k, c, h]
        assert np.array_equal(_bits(np.asarray(ours)), _bits(convert.tensor_to_numpy(theirs).transpose(0, 2, 1, 3)))
    back = jax_to_torch(j)
    assert isinstance(back, TorchCache) and back.k.dtype == t.k.dtype and back.starts.dtype == torch.int64
    for name_ in ("k", "v", "starts", "lengths"):
        assert np.array_equal(_bits(convert.tensor_to_numpy(getattr(back, name_))),
                              _bits(convert.tensor_to_numpy(getattr(t, name_)))), name_


@pytest.mark.parametrize("name", list(DTYPES))
def test_jax_to_torch_and_back_is_bit_exact(name):
    j = _jax_cache(DTYPES[name])
    t = jax_to_torch(j)
    assert t.k.shape == t.v.shape == (B, K, C, H) and t.k.device.type == "cpu"
    assert (t.starts.dtype, t.lengths.dtype) == (torch.int64, torch.int64)
    assert np.array_equal(_bits(convert.tensor_to_numpy(t.k)), _bits(np.asarray(j.k).transpose(0, 2, 1, 3)))
    back = torch_to_jax(t)
    for name_ in ("k", "v", "starts", "lengths"):
        assert np.array_equal(_bits(np.asarray(getattr(back, name_))), _bits(np.asarray(getattr(j, name_)))), name_


def test_the_numpy_form_is_torchs_layout_and_goes_to_either():
    t = _torch_cache(np.float32)
    n = to_numpy(t)
    assert isinstance(n, NumpyKVCache) and n.k.shape == (B, K, C, H) and n.starts.dtype == np.int64
    assert n.capacity == C
    n.k[0, 0, 0, 0] = 123.0  # a copy: the torch cache is not changed through it
    assert float(t.k[0, 0, 0, 0]) != 123.0
    j = from_numpy(n, "jax")
    assert float(j.k[0, 0, 0, 0]) == 123.0 and np.array_equal(_bits(np.asarray(to_numpy(j).v)), _bits(n.v))
    assert float(from_numpy(n, "torch").k[0, 0, 0, 0]) == 123.0
    with pytest.raises(ValueError, match="framework must be one of"):
        from_numpy(n, "numpy")


@pytest.mark.parametrize("call, arg, match", [
    (torch_to_jax, lambda: _jax_cache(np.float32), "expected a mha_torch.kv_cache.KVCache.*use jax_to_torch"),
    (jax_to_torch, lambda: _torch_cache(np.float32), "expected a mha_jax.kv_cache.KVCache.*use torch_to_jax"),
    (torch_to_jax, lambda: {"k": 1}, "expected a mha_torch.kv_cache.KVCache, got builtins.dict"),
    (to_numpy, lambda: (1, 2), "expected mha_torch.kv_cache.KVCache, mha_jax.kv_cache.KVCache or NumpyKVCache"),
    (lambda c: from_numpy(c, "jax"), lambda: _torch_cache(np.float32), "expected a NumpyKVCache.*to_numpy first"),
])
def test_wrong_types_are_named(call, arg, match):
    with pytest.raises(TypeError, match=match):
        call(arg())


def test_float64_to_jax_without_x64_is_refused_not_narrowed():
    t = _torch_cache(np.float64)
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(TypeError, match="jax_enable_x64"):
            torch_to_jax(t)
    finally:
        jax.config.update("jax_enable_x64", True)


def test_a_traced_cache_and_lengths_past_int32_are_refused():
    with pytest.raises(TypeError, match="traced JAX cache"):
        jax.jit(lambda c: jax_to_torch(c).k.shape[0])(_jax_cache(np.float32))
    t = _torch_cache(np.float32)
    with pytest.raises(ValueError, match=rf"KVCache.lengths must lie in \[0, capacity={C}\].*rows \[1\]"):
        TorchCache(t.k, t.v, t.starts, torch.tensor([5, 2 ** 31, 6]))  # refused where it is made
    with pytest.raises(ValueError, match=r"starts must have shape \(3,\)"):
        NumpyKVCache(np.zeros((B, K, C, H)), np.zeros((B, K, C, H)), np.zeros(2, np.int64), np.zeros(B, np.int64))
    with pytest.raises(TypeError, match="starts must be int64"):
        NumpyKVCache(np.zeros((B, K, C, H)), np.zeros((B, K, C, H)), np.zeros(B, np.int32), np.zeros(B, np.int64))


# ---------------------------------------------------------------- a prefill in one framework, steps in the other


def _layer(seed=0):
    rng = np.random.default_rng(seed)
    sd = {"q_proj.weight": rng.standard_normal((N * H, E)), "k_proj.weight": rng.standard_normal((K * H, E)),
          "v_proj.weight": rng.standard_normal((K * H, E)), "out_proj.weight": rng.standard_normal((E, N * H)),
          "q_proj.bias": rng.standard_normal(N * H), "k_proj.bias": rng.standard_normal(K * H),
          "v_proj.bias": rng.standard_normal(K * H), "out_proj.bias": rng.standard_normal(E)}
    return {k: v / math.sqrt(v.shape[-1]) for k, v in sd.items()}, rng.standard_normal((B, L, E))


def _torch_call(m, x, cache):
    with torch.no_grad():
        out, _, new = m(*(convert.numpy_to_tensor(x),) * 3, cache=cache, need_weights=False)
    return convert.tensor_to_numpy(out), new


def _jax_call(m, x, cache):
    out, _, new = m(*(jnp.asarray(x),) * 3, cache=cache, need_weights=False)
    return np.asarray(out), new


CALLS = {"torch": _torch_call, "jax": _jax_call}


def _run(first: str, then: str, sd, x, rope, tamper=lambda c: c):
    """Prefill P tokens in `first`, convert the cache, one token per call in `then`: outputs (B, L, E), final cache.
    `tamper` changes the converted cache (a planted conversion bug)."""
    kw = dict(num_kv_heads=K, rope=rope, rope_theta=THETA)
    mods = {"torch": convert.to_torch(sd, N, **kw), "jax": convert.to_jax(sd, N, **kw)}
    starts = {"torch": torch.tensor(STARTS), "jax": jnp.asarray(STARTS, jnp.int32)}[first]
    out, cache = CALLS[first](mods[first], x[:, :P], mods[first].init_cache(B, C, starts=starts))
    outs = [out]
    cache = tamper(torch_to_jax(cache) if (first, then) == ("torch", "jax") else jax_to_torch(cache))
    for t in range(P, L):
        out, cache = CALLS[then](mods[then], x[:, t:t + 1], cache)
        outs.append(out)
    return np.concatenate(outs, axis=1), to_numpy(cache)


@pytest.mark.parametrize("first, then", [("torch", "jax"), ("jax", "torch")])
@pytest.mark.parametrize("dtype, rope", [(np.float64, "half"), (np.float32, "interleaved")])
def test_a_prefill_continued_in_the_other_framework_is_one_causal_forward(first, then, dtype, rope):
    sd64, x64 = _layer()
    sd, x = {k: v.astype(dtype) for k, v in sd64.items()}, x64.astype(dtype)
    out, cache = _run(first, then, sd, x, rope)
    want = _want(sd, x, rope)
    pad = np.arange(L)[None, :] < STARTS[:, None]  # (B, L): left-padding columns
    assert np.isnan(out[pad]).all() and np.isfinite(out[~pad]).all()
    c = compare(out, want.output, tolerance_for(dtype).forward)
    assert c.passed, c
    assert cache.lengths.tolist() == [L] * B and cache.starts.tolist() == STARTS.tolist()
    assert cache.k.dtype == np.dtype(dtype) and not cache.k[:, :, L:].any()
    for got, ref in ((cache.k[:, :, :L], want.k_rot), (cache.v[:, :, :L], want.v)):
        c = compare(got, ref, tolerance_for(dtype).forward)
        assert c.passed, c


def _want(sd, x, rope):
    pos = reference.decode_positions(STARTS, L)
    return reference.forward(sd, x, x, x, reference.decode_keep(STARTS, L), num_heads=N, num_kv_heads=K, rope=rope,
                             rope_theta=THETA, positions=pos, key_positions=pos)


@pytest.mark.parametrize("bug", ["heads swapped", "one slot lost", "padding dropped", "keys as values"])
def test_a_planted_conversion_bug_fails_the_check(bug):
    """What the cross-framework check sees: a converted cache with its key/value heads in the other
    order, lengths one short, starts lost, or k and v swapped gives outputs outside the float64 bound."""
    tamper = {"heads swapped": lambda c: JaxCache(c.k[:, :, ::-1], c.v[:, :, ::-1], c.starts, c.lengths),
              "one slot lost": lambda c: JaxCache(c.k, c.v, c.starts, c.lengths - 1),
              "padding dropped": lambda c: JaxCache(c.k, c.v, jnp.zeros_like(c.starts), c.lengths),
              "keys as values": lambda c: JaxCache(c.v, c.k, c.starts, c.lengths)}[bug]
    sd, x = _layer(seed=2)
    out, _ = _run("torch", "jax", sd, x, "half", tamper)
    c = compare(out, _want(sd, x, "half").output, tolerance_for(np.float64).forward)
    assert not c.passed and c.max_abs_err > 1e-2, c  # measured: 0.86 to 3.1


def test_one_prefill_continued_in_both_frameworks_agrees_with_the_oracles_decode():
    """The prefill's cache is immutable: continued once in torch and once in JAX, both equal the
    float64 oracle's decode (and so each other), and the torch cache is unchanged by the conversion."""
    sd, x = _layer(seed=1)
    kw = dict(num_kv_heads=K, rope="half", rope_theta=THETA)
    mt, mj = convert.to_torch(sd, N, **kw), convert.to_jax(sd, N, **kw)
    out_p, prefilled = _torch_call(mt, x[:, :P], mt.init_cache(B, C, starts=torch.tensor(STARTS)))
    before = to_numpy(prefilled)
    caches = {"torch": prefilled, "jax": torch_to_jax(prefilled)}
    oracle = reference.decode(sd, x, starts=STARTS, prefill=P, num_heads=N, capacity=C, **kw)
    mods = {"torch": mt, "jax": mj}
    tol = tolerance_for(np.float64).forward
    for fw, cache in caches.items():
        outs = [out_p]
        for t in range(P, L):
            out, cache = CALLS[fw](mods[fw], x[:, t:t + 1], cache)
            outs.append(out)
        c = compare(np.concatenate(outs, axis=1), oracle.output, tol)
        assert c.passed, (fw, c)
        final = to_numpy(cache)
        for got, ref in ((final.k, oracle.k_rot), (final.v, oracle.v)):
            c = compare(got, ref, tol)
            assert c.passed, (fw, c)
    assert np.array_equal(_bits(to_numpy(prefilled).k), _bits(before.k))
