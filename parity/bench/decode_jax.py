"""`mha-bench --decode`'s JAX steppers: our module under one `jax.jit` with its cache's buffers donated (updated
in place, as a JAX decoding loop runs it), flax.nnx.MultiHeadAttention(decode=True) with its own cache, and a
decoder of the protocol (`Implementation.decode=True`).

Legend: B batch, S cached tokens, E embed, C the cache's slots (S + 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parity import convert
from parity.bench.measure import Bench
from parity.impls.registry import layer_kwargs

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _sync(out):
    return jax.block_until_ready(out)


def _numpy(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32))


def nbytes(*arrays) -> int:
    return sum(a.size * a.dtype.itemsize for a in arrays)


def ours(case, sd: dict, tokens: np.ndarray, pass_: str) -> tuple[Bench, dict]:
    """Our module under jax.jit: prefill (S tokens into an empty cache of S + 1 slots, one program) or step
    (token S). The step's program donates the cache's k and v, so it writes slot S in place; each timed call
    gets the buffers the previous one returned with the prefill's lengths again, so it writes slot S anew: every
    call does the same work, as the step of a decoding loop does."""
    cfg = case.config
    m = convert.to_jax({k: np.asarray(v) for k, v in sd.items()}, cfg.num_heads, masked_rows="nan",
                       **layer_kwargs(sd, cfg.num_heads, case.problem))
    graphdef, state = nnx.split(m)
    x = jnp.asarray(tokens, DTYPES[case.dtype])
    B, L, _ = x.shape
    pre, new = x[:, :L - 1], x[:, L - 1:]

    def call(state, cache, x):
        out, _, cache = nnx.merge(graphdef, state)(x, x, x, cache=cache, need_weights=False)
        return out, cache

    prefill = jax.jit(call)
    empty = m.init_cache(B, L)
    if pass_ == "prefill":
        return (Bench(step=lambda: prefill(state, empty, pre)[0], sync=_sync,
                      aot_compile=lambda: _sync(prefill(state, empty, pre)),
                      output=lambda: _numpy(prefill(state, empty, pre)[0])),
                {"cache_bytes": nbytes(empty.k, empty.v)})
    cache = prefill(state, empty, pre)[1]
    starts, lengths = cache.starts, cache.lengths

    def step_fn(state, k, v, x):  # k, v donated: the new cache's buffers are theirs
        out, new_cache = call(state, type(cache)(k, v, starts, lengths), x)
        return out, new_cache.k, new_cache.v

    step_jit = jax.jit(step_fn, donate_argnums=(1, 2))
    held = {"k": cache.k, "v": cache.v}

    def step():
        out, held["k"], held["v"] = step_jit(state, held["k"], held["v"], new)
        return out

    return (Bench(step=step, sync=_sync, aot_compile=lambda: _sync(step()), output=lambda: _numpy(step())),
            {"cache_bytes": nbytes(cache.k, cache.v)})


def flax_nnx(case, sd: dict, tokens: np.ndarray) -> tuple[Bench, dict]:
    """flax.nnx.MultiHeadAttention(decode=True) (the classic layer: no RoPE, one key/value head per query head):
    its cache of S + 1 slots filled one token per call (flax decodes one token at a time), then the step at
    slot S under jax.jit, every timed call from the same cache (flax's cache is the module's state, passed in
    and out here: `parity.peers.flax.flax_nnx_decode_step`)."""
    from parity.peers.flax import flax_nnx_decode_step, to_flax_nnx

    cfg = case.config
    m = to_flax_nnx({k: np.asarray(v) for k, v in sd.items()}, cfg.num_heads, dtype=DTYPES[case.dtype], decode=True)
    graphdef, state = nnx.split(m)
    x = jnp.asarray(tokens, DTYPES[case.dtype])
    B, L, E = x.shape
    step_jit = jax.jit(lambda cache, x_t, real: flax_nnx_decode_step(graphdef, state, {}, x_t, cache, real))
    zeros = jnp.zeros((B, L, cfg.num_heads, cfg.head_size), x.dtype)
    cache = {"key": zeros, "value": zeros, "index": jnp.zeros((), jnp.int32)}
    real = jnp.ones((B, L), bool)
    for t in range(L - 1):
        _, cache = step_jit(cache, x[:, t:t + 1], real)
    new = x[:, L - 1:]

    def step():
        return step_jit(cache, new, real)[0]

    return (Bench(step=step, sync=_sync, aot_compile=lambda: _sync(step()), output=lambda: _numpy(step())),
            {"cache_bytes": nbytes(cache["key"], cache["value"])})


def protocol(impl, case, sd: dict, tokens: np.ndarray) -> tuple[Bench, dict]:
    """A JAX decoder of the protocol: the S prompt tokens one per call (untimed), then the step at position S
    from that cache, every timed call from the same one (`jax.jit` when its mode is "jit")."""
    fn = impl.make({k: np.asarray(v) for k, v in sd.items()}, case.config.num_heads, "nan", jax.devices("cpu")[0],
                   case.problem)
    fn = jax.jit(fn) if impl.mode == "jit" else fn
    p = {k: jnp.asarray(v) for k, v in sd.items()}
    x = jnp.asarray(tokens, DTYPES[case.dtype])
    B, L, _ = x.shape
    cache = None
    for t in range(L - 1):
        _, cache = fn(p, x[:, t:t + 1], cache, jnp.full((B,), t, jnp.int32))
    position = jnp.full((B,), L - 1, jnp.int32)

    def step():
        return fn(p, x[:, L - 1:], cache, position)[0]

    return Bench(step=step, sync=_sync, output=lambda: _numpy(step())), {"cache_bytes": None}
