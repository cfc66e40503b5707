"""jax.nn.dot_product_attention as a peer: our projections around XLA's attention core.

    jax-dpa-core   the classic layer: N heads, mask True = attend
    jax-dpa-gqa    grouped/multi-query, rotary and bias-free layers: K key/value heads, which
                   dot_product_attention repeats per group itself
    jax-dpa-masks  the same layers on the structured mask cases (structured=True), the masks as
                   dot_product_attention's own arguments: is_causal, local_window_size for a window,
                   key_value_seq_lengths for the padding; documents (it has no segment ids) as a mask

    factory(state_dict, num_heads, *, dtype, device[, problem]) -> fn
    fn(params, query, key, value, keep[, *, positions=None, key_positions=None]) -> output

keep: bool (B, 1, T, S), True = attend; a fully masked row is uniform (the mean of V).
Its softmax runs in float32 even for float64 inputs, declared as computes_in="float32"
(measured, seed 0, default matrix: its float64 output is ~1e-8 off the float64 oracle), so a
float64 run is judged at the float32 entry. The rotary embedding is its own code (complex
multiplication of feature pairs), not `mha_jax.rotate`: a shared RoPE bug could not hide
behind agreement. No converter: it computes with the canonical parameters themselves.
jax is imported on first use.
Legend (see mha_spec): B T S N K H E.
"""

from __future__ import annotations

import math

import numpy as np

from mha_spec import LLAMA_FEATURES, Structure
from parity.implementation import Implementation
from parity.peers.common import FRAMEWORK_PEER_CASES, jax_project


# What no other file of parity/ calls (tests/test_house.py).
OWNS = ("jax.nn.dot_product_attention",)

# ---------------------------------------------------------------- factories (parity.impls.registry's contract)


def dpa_core(sd, num_heads, *, dtype, device):
    import jax
    import jax.numpy as jnp

    def fn(params, query, key, value, keep):
        B, T, E = query.shape
        N, H = num_heads, E // num_heads
        q, k, v = (jax_project(x, params, p, N, H) for x, p in ((query, "q_proj"), (key, "k_proj"), (value, "v_proj")))
        ctx = jax.nn.dot_product_attention(q, k, v, mask=keep, scale=1.0 / math.sqrt(H),
                                           implementation="xla")  # (B, T, N, H)
        return jnp.einsum("BTF,EF->BTE", ctx.reshape(B, T, E), params["out_proj.weight"]) + params["out_proj.bias"]

    return fn


def _acc(dtype):
    import jax.numpy as jnp

    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def rope(x, pos, theta: float, convention: str):
    """x (B, L, n, H) rotated by pos · theta^(-2i/H): each feature pair as one complex number times e^{iθ}.

    The angles are float64 whenever JAX has it (jax_enable_x64), so a long position is not
    rounded before its cos/sin; cos/sin and the rotation then run in float32, or float64
    for float64 inputs.
    """
    import jax
    import jax.numpy as jnp

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
    import jax
    import jax.numpy as jnp

    cfg = problem.config
    N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_size
    if N != num_heads:
        raise ValueError(f"jax-dpa-gqa: num_heads={num_heads} but the problem's config has {N}")

    def fn(params, query, key, value, keep, *, positions=None, key_positions=None):
        B, T, _ = query.shape
        q = jax_project(query, params, "q_proj", N, H)  # (B, T, N, H)
        k, v = jax_project(key, params, "k_proj", K, H), jax_project(value, params, "v_proj", K, H)  # (B, S, K, H)
        if cfg.rope is not None:
            q, k = rope(q, positions, cfg.rope_theta, cfg.rope), rope(k, key_positions, cfg.rope_theta, cfg.rope)
        ctx = jax.nn.dot_product_attention(q, k, v, mask=keep, scale=1.0 / math.sqrt(H),
                                           implementation="xla")  # (B, T, N, H)
        out = jnp.einsum("BTF,EF->BTE", ctx.reshape(B, T, N * H), params["out_proj.weight"])
        return out + params["out_proj.bias"] if "out_proj.bias" in params else out

    # Jitted here: the harness calls a peer's forward op by op, and RoPE's small ops would each compile.
    return jax.jit(fn)


def key_lengths(padding):
    """A key-padding keep-mask (B, 1, T, S) -> (key_value_seq_lengths (B,) int32, whether it IS that: per row
    the first L keys for every query). Traceable: under jit the check is a traced bool."""
    import jax.numpy as jnp

    B, _, T, S = padding.shape
    lengths = jnp.sum(padding[:, 0, 0, :], axis=-1).astype(jnp.int32)  # (B,)
    prefix = jnp.arange(S)[None, None, None, :] < lengths[:, None, None, None]  # (B, 1, 1, S)
    return lengths, jnp.all(padding == prefix)


def dpa_masks(sd, num_heads, *, dtype, device, problem):
    """jax-dpa-gqa with the structured masks as jax.nn.dot_product_attention's arguments (see the module
    docstring). Its is_causal and local_window_size are top-left aligned (query t at key t), so a
    bottom-right alignment with T != S is a ValueError; a padding mask that is not a key prefix per row
    is a ValueError when it is concrete and a NaN output under jit (key_value_seq_lengths says only a length)."""
    import jax
    import jax.numpy as jnp

    cfg = problem.config
    N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_size
    if N != num_heads:
        raise ValueError(f"jax-dpa-masks: num_heads={num_heads} but the problem's config has {N}")

    def fn(params, query, key, value, padding, *, positions=None, key_positions=None, is_causal=False, window=None,
           segment_ids=None, key_segment_ids=None, alignment="top-left"):
        B, T, _ = query.shape
        st = Structure.of(T, key.shape[1], is_causal=is_causal, window=window, segment_ids=segment_ids,
                          key_segment_ids=key_segment_ids, alignment=alignment)
        if st.offset != 0:
            raise ValueError(f"jax.nn.dot_product_attention aligns is_causal and local_window_size top-left (query t "
                             f"at key t): alignment='bottom-right' with T={T} != S={st.S} cannot be expressed")
        q = jax_project(query, params, "q_proj", N, H)  # (B, T, N, H)
        k, v = jax_project(key, params, "k_proj", K, H), jax_project(value, params, "v_proj", K, H)  # (B, S, K, H)
        if cfg.rope is not None:
            q, k = rope(q, positions, cfg.rope_theta, cfg.rope), rope(k, key_positions, cfg.rope_theta, cfg.rope)
        kw = {"is_causal": st.is_causal}
        if st.window is not None:  # an unbounded side reaches every key
            kw["local_window_size"] = tuple(st.S if w is None else w for w in st.window)
        mask, ok = None, True
        if st.segment_ids is not None:
            mask = st.segment_ids[:, None, :, None] == st.key_segment_ids[:, None, None, :]  # (B, 1, T, S)
        if padding is not None:
            lengths, ok = key_lengths(padding)
            if not isinstance(ok, jax.core.Tracer) and not bool(ok):
                raise ValueError("jax-dpa-masks passes the padding as key_value_seq_lengths: it must keep the first "
                                 "L keys of a row for every query")
            kw["key_value_seq_lengths"] = lengths
        ctx = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=1.0 / math.sqrt(H), implementation="xla",
                                           **kw)  # (B, T, N, H)
        out = jnp.einsum("BTF,EF->BTE", ctx.reshape(B, T, N * H), params["out_proj.weight"])
        out = out + params["out_proj.bias"] if "out_proj.bias" in params else out
        return jnp.where(ok, out, jnp.nan)

    # Jitted here as dpa_gqa is; the structure is the program's shape, not data.
    return jax.jit(fn, static_argnames=("is_causal", "window", "alignment"))


# ---------------------------------------------------------------- declarations

IMPLEMENTATIONS = (
    Implementation("jax-dpa-core", "jax", f"{__name__}:dpa_core", "jit", False, masked_rows="uniform", computes_in="float32",
                   role="peer", runs_on=FRAMEWORK_PEER_CASES, materializes=True,
                   doc="the same projections around jax.nn.dot_product_attention (XLA); mask True = attend; "
                   "softmax always in float32 (also for float64 inputs)"),
    # Each unit of jax-dpa-gqa is two XLA compiles (forward, gradients): it runs on the masks and
    # attention kinds the default matrix's classic peer cases lack (there it is jax-dpa-core's kernel).
    Implementation("jax-dpa-gqa", "jax", f"{__name__}:dpa_gqa", "jit", False, masked_rows="uniform",
                   computes_in="float32", role="peer", bench=True, materializes=True,
                   runs_on=("cross/*/float64", "cross/*/float32", "self/padding/float64", "self/padding/float32"),
                   variants=LLAMA_FEATURES,
                   doc="our projections around jax.nn.dot_product_attention with K key/value heads, RoPE as complex "
                   "pairs; mask True = attend; empty rows uniform; softmax in float32 (also for float64 inputs)"),
    # Self-attention only: its is_causal and local_window_size are top-left aligned (see dpa_masks). float32
    # only: it computes in float32 (a float64 unit is judged at the float32 bound) and each unit is two compiles.
    Implementation("jax-dpa-masks", "jax", f"{__name__}:dpa_masks", "jit", False, masked_rows="uniform",
                   computes_in="float32", role="peer", bench=False, materializes=True, structured=True,
                   runs_on=("self/packed/float32", "self/window/float32"),
                   variants=LLAMA_FEATURES,
                   doc="jax-dpa-gqa with the structured masks as jax.nn.dot_product_attention's arguments: is_causal, "
                   "local_window_size=(left, right), key_value_seq_lengths for the padding, documents as a bool mask; "
                   "empty rows uniform; softmax in float32"),
)
