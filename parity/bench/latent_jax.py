"""`mha-bench latent`'s JAX benches: `mha_jax.MultiHeadLatentAttention` under one `jax.jit` per call, forward,
forward+backward and one decode step from the latent cache (naive or absorbed).

Legend: B batch, T query length, S cached tokens, E embed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mha_jax
from parity.bench.measure import Bench

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def module(cfg, weights: dict, dtype: str):
    """The layer from the canonical (torch-layout) weights: Linear kernels are their transposes."""
    m = mha_jax.MultiHeadLatentAttention(
        cfg.embed_dim, cfg.num_heads, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank, rope=cfg.rope,
        rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, norm_eps=cfg.norm_eps, bias=cfg.bias,
        rngs=nnx.Rngs(0), param_dtype=DTYPES[dtype], precision=jax.lax.Precision.HIGHEST)
    for key, value in weights.items():
        name, leaf = key.rsplit(".", 1)
        layer = getattr(m, name)
        arr = np.asarray(value, np.float32)
        if name.endswith("norm"):
            layer.weight[...] = jnp.asarray(arr, DTYPES[dtype])  # an RMSNorm's weight
        elif leaf == "weight":
            layer.kernel[...] = jnp.asarray(arr.T, DTYPES[dtype])  # (out, in) -> (in, out)
        else:
            layer.bias[...] = jnp.asarray(arr, DTYPES[dtype])
    return m


def _sync(out):
    return jax.block_until_ready(out)


def _numpy(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32))


def pass_bench(cfg, weights: dict, x: np.ndarray, cotangent: np.ndarray, dtype: str, form: str, pass_: str) -> Bench:
    """fwd or fwd+bwd over x (B, T, E), causal, one jit program: form "eager" returns the weights
    (need_weights=True), "fused" does not. fwd+bwd: x's and every parameter's gradients."""
    m = module(cfg, weights, dtype)
    graphdef, params = nnx.split(m)
    need = form == "eager"
    xj, g = jnp.asarray(x, DTYPES[dtype]), jnp.asarray(cotangent, DTYPES[dtype])

    def forward(params, x):
        out, w = nnx.merge(graphdef, params)(x, need_weights=need, is_causal=True)
        return out if w is None else (out, w)

    if pass_ == "fwd":
        fn = jax.jit(forward)
        return Bench(step=lambda: fn(params, xj), sync=_sync, aot_compile=lambda: _sync(fn(params, xj)),
                     output=lambda: _numpy(jax.tree.leaves(fn(params, xj))[0]))

    def loss(params, x):
        out = nnx.merge(graphdef, params)(x, need_weights=need, is_causal=True)[0]
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

    fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
    out_fn = jax.jit(forward)

    def gradients(grads):
        d_params, d_x = grads
        named = {"x": _numpy(d_x)}
        for path, leaf in jax.tree_util.tree_leaves_with_path(d_params):
            names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
            names = [n for n in names if n != "value"]  # (module, kernel | weight | bias)
            arr = _numpy(leaf)
            named[f"{names[0]}.{'weight' if names[-1] == 'kernel' else names[-1]}"] = arr.T if names[-1] == "kernel" else arr
        return named

    return Bench(step=lambda: fn(params, xj), sync=_sync, aot_compile=lambda: _sync(fn(params, xj)),
                 output=lambda: _numpy(jax.tree.leaves(out_fn(params, xj))[0]), gradients=gradients)


def decode_bench(cfg, weights: dict, x_prefill: np.ndarray, x_new: np.ndarray, dtype: str, form: str) -> tuple[Bench, int]:
    """One decode step of x_new (B, 1, E) from the latent cache prefilled with x_prefill (B, S, E) (capacity
    S + 1), and the bytes that cache holds. Every timed call starts from the same cache (not donated: each call
    does the same work and returns a new cache). form "latent" (naive: keys and values expanded) or "absorbed"."""
    m = module(cfg, weights, dtype)
    graphdef, params = nnx.split(m)
    B, S, _ = x_prefill.shape
    absorb = form == "absorbed"

    def call(params, cache, x, absorb):
        out, _, new = nnx.merge(graphdef, params)(x, need_weights=False, cache=cache, absorb=absorb)
        return out, new

    prefill = jax.jit(lambda p, c, x: call(p, c, x, False))
    _, cache = prefill(params, m.init_cache(B, S + 1), jnp.asarray(x_prefill, DTYPES[dtype]))
    new = jnp.asarray(x_new, DTYPES[dtype])
    fn = jax.jit(lambda p, c, x: call(p, c, x, absorb)[0])
    nbytes = sum(a.size * a.dtype.itemsize for a in (cache.c, cache.k_pe))
    return Bench(step=lambda: fn(params, cache, new), sync=_sync, aot_compile=lambda: _sync(fn(params, cache, new)),
                 output=lambda: _numpy(fn(params, cache, new))), nbytes
