"""What a KV cache accepts, in both frameworks: `starts`/`lengths` checked where the cache is made,
T = 0 new tokens and more new tokens than slots refused by name (under `nnx.jit` too).

Sizes pairwise distinct: B=3 rows, C=7 slots, K=2 key/value heads of H=6 (E=24, N=4).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import mha_jax
import mha_torch
from mha_jax.kv_cache import KVCache as JaxCache
from mha_torch.kv_cache import KVCache as TorchCache
from parity.cache_transfer import NumpyKVCache

B, C, K, H = 3, 7, 2, 6
E, N = 24, 4


def _torch(starts, lengths):
    k = torch.zeros(B, K, C, H)
    return TorchCache(k, k.clone(), torch.tensor(starts), torch.tensor(lengths))


def _jax(starts, lengths):
    k = jnp.zeros((B, C, K, H), jnp.float32)
    return JaxCache(k, k, jnp.asarray(starts, jnp.int32), jnp.asarray(lengths, jnp.int32))


def _numpy(starts, lengths):
    k = np.zeros((B, K, C, H))
    return NumpyKVCache(k, k.copy(), np.asarray(starts, np.int64), np.asarray(lengths, np.int64))


MAKERS = {"torch": _torch, "jax": _jax, "numpy": _numpy}


# ---------------------------------------------------------------- starts and lengths, on construction


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("field, starts, lengths, bad", [
    ("starts", [0, -2, 1], [4, 4, 4], "[0, -2, 1]: rows [1]"),  # a negative start: every RoPE position shifted
    ("lengths", [0, 2, 1], [4, -1, 4], "[4, -1, 4]: rows [1]"),  # a negative length: a write before slot 0
    ("starts", [0, 2, 8], [4, 4, 4], "[0, 2, 8]: rows [2]"),  # past the capacity
    ("lengths", [0, 2, 1], [8, 4, 4], "[8, 4, 4]: rows [0]"),
])
def test_out_of_range_counts_are_a_value_error_naming_the_field(kind, field, starts, lengths, bad):
    with pytest.raises(ValueError, match=rf"KVCache.{field} must lie in \[0, capacity={C}\].*got " + re.escape(bad)):
        MAKERS[kind](starts, lengths)


@pytest.mark.parametrize("kind", list(MAKERS))
def test_the_counts_a_cache_goes_through_are_accepted(kind):
    """Empty with left padding still to write (starts > lengths), mid-prompt, full."""
    for starts, lengths in (([0, 2, 1], [0, 0, 0]), ([0, 2, 1], [1, 1, 1]), ([0, 7, 1], [7, 7, 7])):
        cache = MAKERS[kind](starts, lengths)
        assert np.asarray(cache.lengths).tolist() == lengths


def test_negative_starts_through_init_cache_are_refused_in_both_modules():
    tm = mha_torch.MultiHeadAttention(E, N, num_kv_heads=K, rope="half")
    jm = mha_jax.MultiHeadAttention(E, N, num_kv_heads=K, rope="half", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"KVCache.starts must lie in \[0, capacity=7\].*got \[0, -2, 1\]"):
        tm.init_cache(B, C, starts=torch.tensor([0, -2, 1]))
    with pytest.raises(ValueError, match=r"KVCache.starts must lie in \[0, capacity=7\].*got \[0, -2, 1\]"):
        jm.init_cache(B, C, starts=np.array([0, -2, 1]))


def test_jax_counts_must_be_integers_even_under_jit():
    k = jnp.zeros((B, C, K, H), jnp.float32)
    with pytest.raises(TypeError, match=r"KVCache.lengths must be integers \(int32\), got dtype float32"):
        JaxCache(k, k, jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.float32))
    with pytest.raises(TypeError, match="KVCache.lengths must be integers"):
        jax.jit(lambda s: JaxCache(k, k, s, s.astype(jnp.float32)).lengths)(jnp.zeros(B, jnp.int32))


def test_under_jit_the_values_are_data_and_a_rebuilt_cache_is_not_rechecked():
    """Traced counts cannot be read (documented: make caches outside jit); JAX rebuilding a cache from
    its leaves (a jitted step's output) does not check it again, so no step waits to read its lengths."""
    k = jnp.zeros((B, C, K, H), jnp.float32)
    out = jax.jit(lambda s: JaxCache(k, k, s, s).starts)(jnp.asarray([0, -2, 1], jnp.int32))
    assert np.asarray(out).tolist() == [0, -2, 1]  # traced: not checked
    cache = _jax([0, 2, 1], [3, 3, 3])
    rebuilt = jax.tree.unflatten(jax.tree.structure(cache), [None] * 4)  # JAX's own placeholders
    assert isinstance(rebuilt, JaxCache) and rebuilt.k is None
    assert [path[0].name for path, _ in jax.tree_util.tree_flatten_with_path(cache)[0]] == ["k", "v", "starts", "lengths"]


# ---------------------------------------------------------------- what a call with a cache takes


def _modules():
    torch.manual_seed(0)
    tm = mha_torch.MultiHeadAttention(E, N, num_kv_heads=K, rope="half")
    from parity import convert

    return tm, convert.torch_to_jax(tm)


@pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
def test_more_new_tokens_than_slots_is_the_documented_value_error_under_nnx_jit(need_weights):
    _, jm = _modules()
    x = np.random.default_rng(0).standard_normal((B, C + 1, E)).astype(np.float32)
    step = nnx.jit(lambda m, x, c: m(x, x, x, cache=c, need_weights=need_weights))
    message = rf"the cache holds {C} slots per row: {C + 1} new tokens do not fit in any row"
    with pytest.raises(ValueError, match=message):
        step(jm, x, jm.init_cache(B, C))
    with pytest.raises(ValueError, match=message):  # and eager, the same words
        jm(x, x, x, cache=jm.init_cache(B, C), need_weights=need_weights)
    core = jax.jit(lambda c, q, kv: mha_jax.cached_attention(q, kv, kv, c)[0])
    q, kv = jnp.zeros((B, C + 1, N, H), jnp.float32), jnp.zeros((B, C + 1, K, H), jnp.float32)
    with pytest.raises(ValueError, match=message):
        core(jm.init_cache(B, C), q, kv)


def test_t_zero_with_a_cache_is_a_value_error_in_both_modules():
    tm, jm = _modules()
    x = np.zeros((B, 0, E), np.float32)
    words = r"T = 0 new tokens with a cache: query \(3, 0, 24\), key \(3, 0, 24\), value \(3, 0, 24\)"
    for need_weights in (True, False):
        with pytest.raises(ValueError, match=words):
            tm(*(torch.from_numpy(x),) * 3, cache=tm.init_cache(B, C), need_weights=need_weights)
        with pytest.raises(ValueError, match=words):
            jm(x, x, x, cache=jm.init_cache(B, C), need_weights=need_weights)
    with pytest.raises(ValueError, match=words):
        nnx.jit(lambda m, x, c: m(x, x, x, cache=c))(jm, x, jm.init_cache(B, C))
    with pytest.raises(ValueError, match=r"T = 0 new tokens with a cache: q \(3, 0, 4, 6\)"):
        mha_jax.cached_attention(jnp.zeros((B, 0, N, H), jnp.float32), *(jnp.zeros((B, 0, K, H), jnp.float32),) * 2,
                                 jm.init_cache(B, C))
    # without a cache T = 0 stays an empty output
    kv = torch.zeros(B, 4, E)
    out, _ = tm(torch.from_numpy(x), kv, kv)
    assert tuple(out.shape) == (B, 0, E)
