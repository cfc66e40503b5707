"""jax-dpa-gqa: our projections around jax.nn.dot_product_attention with K key/value heads.

A peer for grouped/multi-query, rotary and bias-free layers. Imports jax, never torch.
Its rotary embedding is its own code (complex multiplication of feature pairs), not
`mha_jax.rotate`: a shared RoPE bug could not hide behind agreement.

    factory(state_dict, num_heads, *, dtype, device, problem) -> fn
    fn(params, query, key, value, keep, *, positions=None, key_positions=None) -> output

keep: bool (B, 1, T, S), True = attend; a fully masked row is uniform (the mean of V), as
jax-dpa-core. `jax.nn.dot_product_attention` takes key/value with K heads and repeats them
per group itself; its softmax runs in float32 even for float64 inputs (so a float64 run is
judged at the float32 entry, as jax-dpa-core's).
Legend (see mha_spec): B T S N K H E.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def _acc(dtype) -> jnp.dtype:
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def rope(x, pos, theta: float, convention: str):
    """x (B, L, n, H) rotated by pos · theta^(-2i/H): each feature pair as one complex number times e^{iθ}.

    The angles are float64 whenever JAX has it (jax_enable_x64), so a long position is not
    rounded before its cos/sin; cos/sin and the rotation then run in float32, or float64
    for float64 inputs.
    """
    B, L, n, H = x.shape
    acc = _acc(x.dtype)
    wide = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    pos = jnp.arange(L) if pos is None else jnp.asarray(pos)
    inv_freq = jnp.asarray(np.power(float(theta), -np.arange(0, H, 2, dtype=np.float64) / H), wide)
    angles = pos.astype(wide).reshape(pos.shape[0] if pos.ndim == 2 else 1, L, 1, 1) * inv_freq  # (B|1, L, 1, H/2)
    turn = jnp.cos(angles).astype(acc) + 1j * jnp.sin(angles).astype(acc)
    xa = x.astype(acc)
    if convention == "half":
        r = (xa[..., : H // 2] + 1j * xa[..., H // 2:]) * turn
        out = jnp.concatenate([r.real, r.imag], axis=-1)
    else:
        r = (xa[..., 0::2] + 1j * xa[..., 1::2]) * turn
        out = jnp.stack([r.real, r.imag], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)


def dpa_gqa(sd, num_heads, *, dtype, device, problem):
    cfg = problem.config
    N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_size
    if N != num_heads:
        raise ValueError(f"jax-dpa-gqa: num_heads={num_heads} but the problem's config has {N}")

    def fn(params, query, key, value, keep, *, positions=None, key_positions=None):
        B, T, _ = query.shape
        S = key.shape[1]

        def proj(x, p, n, L):  # (B, L, E) -> (B, L, n, H); canonical (out, in) weights: x Wᵀ + b
            y = jnp.einsum("BLE,FE->BLF", x, params[f"{p}.weight"])
            if f"{p}.bias" in params:
                y = y + params[f"{p}.bias"]
            return y.reshape(B, L, n, H)

        q, k, v = proj(query, "q_proj", N, T), proj(key, "k_proj", K, S), proj(value, "v_proj", K, S)
        if cfg.rope is not None:
            q, k = rope(q, positions, cfg.rope_theta, cfg.rope), rope(k, key_positions, cfg.rope_theta, cfg.rope)
        ctx = jax.nn.dot_product_attention(q, k, v, mask=keep, scale=1.0 / math.sqrt(H),
                                           implementation="xla")  # (B, T, N, H)
        out = jnp.einsum("BTF,EF->BTE", ctx.reshape(B, T, N * H), params["out_proj.weight"])
        return out + params["out_proj.bias"] if "out_proj.bias" in params else out

    # Jitted here: the harness calls a peer's forward op by op, and RoPE's small ops would each compile.
    return jax.jit(fn)
